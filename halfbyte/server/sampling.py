"""OpenAI request fields -> SamplingParams, for whichever fields SamplingParams has.

A field SamplingParams lacks is fine at its neutral value and a 400 otherwise, so a client never
silently gets sampling it did not ask for. n > 1 fans out n requests (seeded ones get seed + i)."""

from __future__ import annotations

import dataclasses
from typing import Any

from halfbyte.errors import InvalidParameterError
from halfbyte.sampling_params import SamplingParams
from halfbyte.server.protocol import ChatCompletionRequest, CompletionRequest

# request field -> its value that means "off" (None always means "not given")
_NEUTRAL: dict[str, object] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "typical_p": 1.0,
    "min_tokens": 0,
    "logit_bias": {},
}
_DIRECT = (
    "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "penalty_window", "allowed_token_ids", "bad_token_ids",
)


def _param_names() -> set[str]:
    return {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params(req: ChatCompletionRequest | CompletionRequest, default_max_tokens: int | None) -> SamplingParams:
    names = _param_names()
    kwargs: dict[str, Any] = {}
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    if req.stop is not None:
        kwargs["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    for name in _DIRECT:
        value = getattr(req, name)
        if value is None:
            continue
        if name not in names:
            raise InvalidParameterError(f"{name} is not supported by this server")
        kwargs[name] = value
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name)
        if value is None:
            continue
        if name == "logit_bias":
            value = _token_bias(value)
        if name in names:
            kwargs[name] = value
        elif value != neutral:
            raise InvalidParameterError(f"{name} is not supported by this server")
    top_n = requested_logprobs(req)
    if top_n is not None:
        if "logprobs" not in names:
            raise InvalidParameterError("logprobs are not supported by this server yet")
        kwargs["logprobs"] = top_n
    if "n" in names:
        kwargs["n"] = 1  # the server fans n out into separate requests itself
    return SamplingParams(**kwargs)


def requested_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many top alternatives a request wants per token (0: the sampled token's only); None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n independent choices: a seeded request gives choice i the seed + i."""
    if n == 1:
        return [params]
    for_sample = getattr(params, "for_sample", None)
    if callable(for_sample):  # SamplingParams' own rule for parallel samples
        return [for_sample(i) for i in range(n)]
    if params.seed is None:
        return [dataclasses.replace(params) for _ in range(n)]
    return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


def _token_bias(bias: dict[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise InvalidParameterError(f"logit_bias keys must be token ids, got {key!r}") from None
        if not -100 <= value <= 100:
            raise InvalidParameterError(f"logit_bias values must be in [-100, 100], got {value!r}")
    return out
