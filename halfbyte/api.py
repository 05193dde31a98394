"""The public Python API: LLM (sync, batch and streaming), SamplingParams, RequestOutput."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from halfbyte.engine.config import EngineConfig
from halfbyte.engine.llm_engine import LLMEngine
from halfbyte.errors import InvalidParameterError
from halfbyte.model.rope import RopeScaling
from halfbyte.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "RopeScaling", "EngineConfig"]

Prompt = str | list[int]
Message = dict[str, Any]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    logprobs: list[dict[int, float]] | None = None  # per token when SamplingParams.logprobs is set
    samples: list[RequestOutput] = field(default_factory=list)  # all n when n > 1 (text is the first's)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    """A model loaded for generation. `LLM()` loads the embedded default model.

    Use as a context manager to free its memory on exit:
        with LLM() as llm:
            print(llm.chat([{"role": "user", "content": "Hi"}])[0].text)
    """

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
        show_progress: bool = False,
        tensor_parallel_size: int | None = None,
    ) -> None:
        """tensor_parallel_size: split the model over that many ranks (processes; one GPU each on
        CUDA). None runs one process; 1 runs the tensor-parallel code path on one rank."""
        config = EngineConfig(
            max_model_len=max_model_len,
            kv_cache_tokens=kv_cache_tokens,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
        )
        self.engine = LLMEngine(
            model, dtype=dtype, device=device, rope_scaling=rope_scaling, config=config, show_progress=show_progress,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    # --- inputs -------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidParameterError("a prompt must be a string or a list of token ids")

    @staticmethod
    def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        plist = list(params)
        if len(plist) != n:
            raise InvalidParameterError(f"got {len(plist)} SamplingParams for {n} prompts")
        return plist

    # --- generation ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_token: Callable[[str, str], None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); outputs in the prompts' order.
        on_token(request_id, delta_text) is called as text arrives."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        token_lists = [self._tokenize(p) for p in prompts]  # type: ignore[arg-type]
        return self._run(token_lists, self._per_prompt(params, len(token_lists)), on_token)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_token: Callable[[str, str], None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or several; answers in order."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [self.tokenizer.encode_chat(c) for c in convs]  # type: ignore[arg-type]
        return self._run(token_lists, self._per_prompt(params, len(token_lists)), on_token)

    def stream(self, prompt: Prompt | list[Message], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt (or one conversation) as they are generated."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.encode_chat(prompt)
        else:
            ids = self._tokenize(prompt)  # type: ignore[arg-type]
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, ids, params or SamplingParams())
        try:
            finished = False
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.delta_text:
                            yield out.delta_text
                        finished = out.finished
        finally:
            self.engine.abort_request(rid)

    def _run(
        self,
        token_lists: list[list[int]],
        params: list[SamplingParams],
        on_token: Callable[[str, str], None] | None,
    ) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        texts: dict[str, list[str]] = {}
        hooks: dict[str, SamplingParams] = {}
        parents: list[tuple[str, list[str]]] = []  # (parent id, its n child request ids)
        order = []
        try:
            for ids, p in zip(token_lists, params, strict=True):
                rid = f"req-{next(self._ids)}"
                # n > 1: n child requests sharing the prompt (the prefix cache shares its pages)
                children = [(rid, p)] if p.n == 1 else [(f"{rid}-{i}", p.for_sample(i)) for i in range(p.n)]
                for child_id, child_params in children:
                    self.engine.add_request(child_id, ids, child_params)
                    results[child_id] = RequestOutput(child_id, ids)
                    texts[child_id] = []
                    hooks[child_id] = child_params
                    order.append(child_id)
                parents.append((rid, [c for c, _ in children]))
            pending = set(order)
            while pending:
                for out in self.engine.step():
                    if out.request_id not in pending:
                        continue
                    res = results[out.request_id]
                    res.token_ids.extend(out.new_token_ids)
                    if out.logprobs is not None:
                        if res.logprobs is None:
                            res.logprobs = []
                        res.logprobs.extend(out.logprobs)
                    if out.delta_text:
                        texts[out.request_id].append(out.delta_text)
                        if on_token is not None:
                            on_token(out.request_id, out.delta_text)
                    if out.finished:
                        res.finish_reason = out.finish_reason
                        pending.discard(out.request_id)
        finally:
            for rid in order:
                self.engine.abort_request(rid)
        for rid in order:
            results[rid].text = "".join(texts[rid])
            for hook in hooks[rid].output_processors:  # post-processing hooks, in order
                changed = hook(results[rid])
                if changed is not None:
                    results[rid] = changed
        outputs = []
        for rid, child_ids in parents:  # a name apart from the loop above: mypy types it once
            if len(child_ids) == 1:
                outputs.append(results[rid])
                continue
            first = results[child_ids[0]]
            outputs.append(RequestOutput(rid, first.prompt_token_ids, first.text, list(first.token_ids),
                                         first.finish_reason, first.logprobs, [results[c] for c in child_ids]))
        return outputs

    # --- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        if hasattr(self, "engine"):
            self.engine.close()
            del self.engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
