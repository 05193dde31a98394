"""/v1/completions and /v1/chat/completions: admit the choices, then answer in one JSON body or as
server-sent events (`data: {json}` per chunk, `data: [DONE]` last).

Every choice is its own engine request (n > 1 fans out). Leaving early (client disconnect, error)
aborts every choice still running, which frees its pages."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from halfbyte.async_llm import AsyncLLM, PromptInput, RequestStream, StreamDelta
from halfbyte.errors import InvalidParameterError
from halfbyte.sampling_params import SamplingParams
from halfbyte.server.logprobs import LogprobFormatter
from halfbyte.server.metrics import RequestTimer, ServerMetrics
from halfbyte.server.protocol import ChatCompletionRequest, CompletionRequest, usage
from halfbyte.server.sampling import fan_out, sampling_params

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Choices:
    """The admitted engine requests of one HTTP request, in choice-index order."""

    streams: list[RequestStream]
    prompt_tokens: int  # each prompt counted once, whatever n is
    arrival: float
    texts: list[list[str]] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, float]]] = field(default_factory=list)  # when the request asked for them

    def __post_init__(self) -> None:
        k = len(self.streams)
        self.texts = [[] for _ in range(k)]
        self.completion_tokens = [0] * k
        self.finish_reasons = [None] * k
        self.token_ids = [[] for _ in range(k)]
        self.logprobs = [[] for _ in range(k)]

    def abort_all(self) -> None:
        for s in self.streams:
            s.abort()

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, sum(self.completion_tokens))


async def admit(
    llm: AsyncLLM, prompts: list[PromptInput], params: SamplingParams, n: int, metrics: ServerMetrics
) -> Choices:
    """Submit prompts x n choices (choice index = prompt index * n + j). All or none are admitted."""
    arrival = time.perf_counter()
    streams: list[RequestStream] = []
    prompt_tokens = 0
    try:
        for prompt in prompts:
            for j, p in enumerate(fan_out(params, n)):
                stream = await llm.submit(prompt, p)
                streams.append(stream)
                if j == 0:
                    prompt_tokens += stream.prompt_tokens
    except BaseException:
        for s in streams:
            s.abort()
        raise
    metrics.prompt_tokens.inc(prompt_tokens)
    return Choices(streams, prompt_tokens, arrival)


async def merged(choices: Choices, metrics: ServerMetrics) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(choice index, delta) as they arrive from every choice; records the choices' progress."""
    timers = [RequestTimer(metrics, choices.arrival) for _ in choices.streams]

    def record(i: int, d: StreamDelta) -> None:
        timers[i].on_delta(len(d.token_ids))
        choices.texts[i].append(d.text)
        choices.token_ids[i].extend(d.token_ids)
        choices.logprobs[i].extend(d.extra.get("logprobs") or [])
        choices.completion_tokens[i] = d.completion_tokens
        if d.finish_reason is not None:
            choices.finish_reasons[i] = d.finish_reason
            metrics.finished.labels(d.finish_reason).inc()

    if len(choices.streams) == 1:  # the common case: no helper task
        try:
            async for d in choices.streams[0]:
                record(0, d)
                yield 0, d
        finally:
            choices.abort_all()
        return

    out: asyncio.Queue[tuple[int, StreamDelta] | BaseException] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for d in stream:
                out.put_nowait((i, d))
        except Exception as e:
            out.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(choices.streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await out.get()
            if isinstance(item, BaseException):
                raise item
            record(*item)
            if item[1].finished:
                remaining -= 1
            yield item
    finally:
        for t in tasks:
            t.cancel()
        choices.abort_all()


# --- inputs -------------------------------------------------------------------------------
def completion_prompts(req: CompletionRequest) -> list[PromptInput]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidParameterError("prompt must not be empty")
    if all(isinstance(x, int) for x in p):
        return [[int(x) for x in p]]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


def chat_prompt(req: ChatCompletionRequest) -> list[PromptInput]:
    messages: list[dict[str, Any]] = [{"role": m.role, "content": m.text()} for m in req.messages]
    return [messages]


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.echo:
        raise InvalidParameterError("echo is not supported by this server")
    return sampling_params(req, COMPLETIONS_DEFAULT_MAX_TOKENS)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    return sampling_params(req, None)


# --- answers ------------------------------------------------------------------------------
class Responder:
    """Builds one endpoint's JSON answer and SSE chunks."""

    def __init__(self, chat: bool, model: str, include_usage: bool, logprobs: LogprobFormatter | None = None) -> None:
        self.chat = chat
        self.logprobs = logprobs
        self.model = model
        self.include_usage = include_usage
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, float]], offset: int) -> dict[str, Any] | None:
        if self.logprobs is None or not lps:
            return None
        n = min(len(token_ids), len(lps))
        if self.chat:
            return self.logprobs.chat(token_ids[:n], lps[:n])
        return self.logprobs.completion(token_ids[:n], lps[:n], offset)

    def _choice(
        self, index: int, text: str | None, finish_reason: str | None, final: bool,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if final:
            return {
                "index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        delta: dict[str, Any] = {} if text is None else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def body(self, choices: Choices) -> dict[str, Any]:
        return {
            "id": self.id, "object": self.object, "created": self.created, "model": self.model,
            "choices": [
                self._choice(
                    i, "".join(choices.texts[i]), choices.finish_reasons[i], final=True,
                    logprobs=self._logprobs(choices.token_ids[i], choices.logprobs[i], 0),
                )
                for i in range(len(choices.streams))
            ],
            "usage": choices.usage(),
        }

    def _event(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> str:
        chunk: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage_
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    async def sse(self, choices: Choices, metrics: ServerMetrics) -> AsyncIterator[str]:
        try:
            async for event in self._events(choices, metrics):
                yield event
        except Exception as e:  # headers are sent: the error travels as an event
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'param': None, 'code': None}})}\n\n"
        finally:  # a disconnect closes this generator: abort now, not when merged() is collected
            choices.abort_all()

    async def _events(self, choices: Choices, metrics: ServerMetrics) -> AsyncIterator[str]:
        if self.chat:  # OpenAI opens each choice with the role
            for i in range(len(choices.streams)):
                yield self._event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}])
        offsets = [0] * len(choices.streams)
        async for i, d in merged(choices, metrics):
            lps = self._logprobs(d.token_ids, d.extra.get("logprobs") or [], offsets[i])
            if d.text or lps is not None:
                yield self._event([self._choice(i, d.text, None, final=False, logprobs=lps)])
            offsets[i] += len(d.text)
            if d.finish_reason is not None:
                yield self._event([self._choice(i, None if self.chat else "", d.finish_reason, final=False)])
        if self.include_usage:
            yield self._event([], choices.usage())
        yield "data: [DONE]\n\n"
