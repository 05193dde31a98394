"""AsyncLLM: the engine for asyncio programs. Many concurrent requests share one LLMEngine.

Engine steps are blocking torch calls, so one background thread owns the engine: it takes
commands (add, abort, stop) from a queue, steps, and hands each request's outputs to that
request's asyncio queue with loop.call_soon_threadsafe. Nothing else touches the engine.

    async with AsyncLLM() as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.text, end="")
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from halfbyte.engine.config import EngineConfig
from halfbyte.engine.llm_engine import LLMEngine, StepOutput
from halfbyte.errors import HalfbyteError, InvalidParameterError
from halfbyte.model.rope import RopeScaling
from halfbyte.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "StreamDelta", "QueueFullError", "EngineDeadError", "RequestStream"]

Message = dict[str, Any]
PromptInput = str | list[int] | list[Message]


class QueueFullError(HalfbyteError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread failed or was stopped; no request can run on it any more."""


@dataclass
class StreamDelta:
    """What one request gained since its last delta."""

    request_id: str
    text: str  # new text (may be "" while a multi-byte character is incomplete)
    token_ids: list[int]  # new token ids
    prompt_tokens: int
    completion_tokens: int  # generated so far, this delta included
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last delta
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific fields (e.g. logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_Item = StreamDelta | BaseException


@dataclass
class _Sink:
    """The asyncio side of one request, as the engine thread sees it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]
    prompt_tokens: int
    completion_tokens: int = 0


@dataclass
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    sink: _Sink
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str
    done: asyncio.Future[None] | None


class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class RequestStream:
    """One admitted request. Iterate it for deltas; leaving the loop early (break, an exception,
    cancellation) aborts the request and frees its pages."""

    def __init__(self, owner: AsyncLLM, request_id: str, sink: _Sink) -> None:
        self.owner = owner
        self.request_id = request_id
        self.prompt_tokens = sink.prompt_tokens
        self._queue = sink.queue
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.owner._release(self.request_id, abort=not self.finished)
            self.finished = True

    def abort(self) -> None:
        """Abort without waiting (safe to call from finally blocks and when never iterated)."""
        if not self.finished:
            self.finished = True
            self.owner._release(self.request_id, abort=True)

    def __del__(self) -> None:
        # dropped without being read to the end (e.g. a response body that never started)
        if not getattr(self, "finished", True):
            self.abort()


class AsyncLLM:
    """A model loaded for asyncio serving. `async with AsyncLLM(...)` starts and stops the engine
    thread; max_waiting bounds the requests admitted beyond max_num_seqs (QueueFullError past it)."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        rope_scaling: RopeScaling | str | None = None,
        max_model_len: int | None = None,
        kv_cache_tokens: int | None = None,
        page_size: int = 16,
        max_num_seqs: int = 64,
        max_waiting: int = 256,
        show_progress: bool = False,
        engine: LLMEngine | None = None,
    ) -> None:
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise InvalidParameterError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        if engine is None:
            config = EngineConfig(
                max_model_len=max_model_len, kv_cache_tokens=kv_cache_tokens, page_size=page_size,
                max_num_seqs=max_num_seqs,
            )
            engine = LLMEngine(
                model, dtype=dtype, device=device, rope_scaling=rope_scaling, config=config,
                show_progress=show_progress,
            )
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_num_seqs = engine.config.max_num_seqs
        self.max_waiting = max_waiting
        self._ids = itertools.count()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: set[str] = set()  # asyncio side: admitted requests (ids only: streams may be collected)
        self._started: set[str] = set()  # requests that produced a first delta
        self._sinks: dict[str, _Sink] = {}  # engine-thread side
        self.num_aborted = 0  # requests aborted before finishing (cancelled, disconnected)
        self.engine_stats: Any = None  # the engine's last stats() snapshot, if it has stats()

    # --- lifetime -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._error = None
            self._thread = threading.Thread(target=self._run_loop, name="halfbyte-engine", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Abort every request and join the engine thread (the engine stays loaded)."""
        thread = self._thread
        if thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(thread.join)
        self._thread = None

    def close(self) -> None:
        """Free the model's memory. Call after stop()."""
        if self._thread is not None:
            raise RuntimeError("stop() the engine loop before close()")
        self.engine.close()

    async def __aenter__(self) -> AsyncLLM:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # --- numbers for metrics --------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_waiting(self) -> int:
        """Admitted requests with no token yet (queued or in prefill)."""
        return len(self._in_flight) - len(self._started)

    # --- inputs -------------------------------------------------------------------------
    def tokenize(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.encode_chat(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]  # type: ignore[arg-type]
        raise InvalidParameterError("a prompt must be a string, a list of token ids or a list of messages")

    # --- requests -------------------------------------------------------------------------
    async def submit(
        self, prompt: PromptInput, params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Admit one request; returns once the engine accepted it. Raises QueueFullError past the
        bound, HalfbyteError for bad input (before anything runs), EngineDeadError if stopped."""
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({self._error!r})" if self._error else "the engine loop is not running; use `async with AsyncLLM(...)`")
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        if rid in self._in_flight:
            raise InvalidParameterError(f"request_id {rid!r} is already running")
        if len(self._in_flight) >= self.max_num_seqs + self.max_waiting:
            raise QueueFullError(
                f"the server is at capacity ({len(self._in_flight)} requests in flight; "
                f"max_num_seqs {self.max_num_seqs} + max_waiting {self.max_waiting}); retry later"
            )
        if params is not None and getattr(params, "n", 1) != 1:
            raise InvalidParameterError(
                "AsyncLLM runs one sample per request; for n > 1 submit params.for_sample(i) for i in range(n)"
            )
        ids = self.tokenize(prompt)
        loop = asyncio.get_running_loop()
        sink = _Sink(loop, asyncio.Queue(), prompt_tokens=len(ids))
        self._in_flight.add(rid)  # counted from here: admission stays bounded while awaiting
        accepted: asyncio.Future[None] = loop.create_future()
        self._commands.put(_Add(rid, ids, params or SamplingParams(), sink, accepted))
        try:
            await accepted
        except BaseException:
            if not accepted.done() or accepted.cancelled() or accepted.exception() is None:
                self._commands.put(_Abort(rid, None))  # cancelled while waiting: it may have been added
            self._in_flight.discard(rid)
            raise
        return RequestStream(self, rid, sink)

    async def generate(
        self, prompt: PromptInput, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Yield deltas of one request as tokens arrive. prompt: text, token ids or chat messages."""
        stream = await self.submit(prompt, params, request_id)
        async for delta in stream:
            yield delta

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once the engine freed its pages. Unknown ids are ignored."""
        if not self.is_running:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commands.put(_Abort(request_id, done))
        await done

    def _release(self, request_id: str, abort: bool) -> None:
        """The asyncio side is done with a request (finished, or left early: then abort it)."""
        self._in_flight.discard(request_id)
        self._started.discard(request_id)
        if abort:
            self.num_aborted += 1
            self._commands.put(_Abort(request_id, None))

    def _mark_started(self, request_id: str) -> None:
        if request_id in self._in_flight:
            self._started.add(request_id)

    # --- the engine thread ----------------------------------------------------------------
    def _run_loop(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                for cmd in self._drain(block=idle):
                    if isinstance(cmd, _Stop):
                        self._abort_all(EngineDeadError("the engine loop stopped"))
                        return
                    self._apply(cmd)
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    if outputs:
                        self._dispatch(outputs)
                    elif not getattr(self.engine, "step_in_flight", False):
                        time.sleep(0.001)  # nothing schedulable this step; don't spin hot
                self._snapshot_stats()
        except BaseException as e:  # a bug in the engine: fail every request, refuse new ones
            self._error = e
            self._abort_all(EngineDeadError(f"the engine failed: {e!r}"))

    def _snapshot_stats(self) -> None:
        """engine.stats() (when the engine has it), taken here so that readers never touch the
        engine from another thread while it steps."""
        stats_fn = getattr(self.engine, "stats", None)
        if callable(stats_fn):
            self.engine_stats = stats_fn()

    def _drain(self, block: bool) -> list[_Command]:
        cmds: list[_Command] = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request_id, cmd.token_ids, cmd.params)
            except Exception as e:  # bad input: the caller gets the error, the engine is fine
                _resolve(cmd.sink.loop, cmd.accepted, e)
                return
            self._sinks[cmd.request_id] = cmd.sink
            _resolve(cmd.sink.loop, cmd.accepted, None)
        else:
            self.engine.abort_request(cmd.request_id)
            sink = self._sinks.pop(cmd.request_id, None)
            if sink is not None:
                final = StreamDelta(cmd.request_id, "", [], sink.prompt_tokens, sink.completion_tokens, "abort")
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, final)
            if cmd.done is not None:
                loop = cmd.done.get_loop()
                _resolve(loop, cmd.done, None)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], StreamDelta]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            sink.completion_tokens += len(out.new_token_ids)
            extra = {k: v for k, v in vars(out).items() if k not in _STEP_FIELDS}
            delta = StreamDelta(
                out.request_id, out.delta_text, list(out.new_token_ids), sink.prompt_tokens,
                sink.completion_tokens, out.finish_reason if out.finished else None, extra,
            )
            if out.finished:
                del self._sinks[out.request_id]
            by_loop.setdefault(sink.loop, []).append((sink.queue, delta))
        for loop, items in by_loop.items():  # one wake-up per event loop per step
            loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list[tuple[asyncio.Queue[_Item], StreamDelta]]) -> None:
        for q, delta in items:
            self._mark_started(delta.request_id)
            q.put_nowait(delta)

    def _abort_all(self, error: BaseException) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort_request(rid)
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, error)
        self._sinks.clear()
        while True:  # fail the commands nobody will apply
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                _resolve(cmd.sink.loop, cmd.accepted, error)
            elif isinstance(cmd, _Abort) and cmd.done is not None:
                _resolve(cmd.done.get_loop(), cmd.done, None)


_STEP_FIELDS = {"request_id", "new_token_ids", "delta_text", "finished", "finish_reason"}


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], error: BaseException | None) -> None:
    """Complete an asyncio future from the engine thread (unless its waiter was cancelled)."""

    def settle() -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed; nobody is waiting
        pass

