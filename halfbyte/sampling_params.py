"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names).

The order the sampler applies them in (halfbyte/engine/sampler.py):
logits_processors -> repetition / frequency / presence penalties -> logit_bias, allowed and
banned ids, min_tokens -> temperature -> top_k -> top_p -> typical_p -> min_p -> draw.
Each filter renormalises over the tokens the previous ones kept."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from halfbyte.errors import InvalidParameterError

# fn(output_token_ids, logits_row [vocab] fp32) -> logits_row: runs on that request's row only
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
# fn(request_output) -> request_output or None (None keeps it): runs on each finished output
OutputProcessor = Callable[[Any], Any]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidParameterError(message)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    typical_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (1: off)
    frequency_penalty: float = 0.0  # subtracts penalty * count of each output token
    presence_penalty: float = 0.0  # subtracts penalty from each token present in the output
    penalty_window: int | None = None  # penalties count only the last N tokens (prompt + output)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_token_ids: list[int] = field(default_factory=list)  # these are never sampled
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens
    n: int = 1  # independent samples of the prompt (LLM.generate fans out; seeds seed + i)
    logprobs: int | None = None  # top-N logprobs per generated token, plus the sampled one's
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    output_processors: list[OutputProcessor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0 <= self.temperature < math.inf, f"temperature must be >= 0 and finite, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1, f"top_k must be an integer >= 0 (0 or -1 disable it), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(_is_number(self.typical_p) and 0 < self.typical_p <= 1, f"typical_p must be in (0, 1], got {self.typical_p!r}")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
               f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(self.penalty_window is None or (_is_int(self.penalty_window) and self.penalty_window >= 1),
               f"penalty_window must be None or an integer >= 1, got {self.penalty_window!r}")
        _check(isinstance(self.logit_bias, dict), f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for token, bias in self.logit_bias.items():
            _check(_is_int(token) and token >= 0, f"logit_bias keys must be token ids >= 0, got {token!r}")
            # -inf bans a token; +inf or NaN would make the distribution undefined
            _check(_is_number(bias) and bias < math.inf, f"logit_bias[{token}] must be a number < inf, got {bias!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty (None allows all)")
            _check(all(_is_int(t) and t >= 0 for t in self.allowed_token_ids), "allowed_token_ids must be token ids >= 0")
        self.bad_token_ids = list(self.bad_token_ids)
        _check(all(_is_int(t) and t >= 0 for t in self.bad_token_ids), "bad_token_ids must be token ids >= 0")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens, f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.min_tokens <= self.max_tokens, f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be None or an integer in [0, 20], got {self.logprobs!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")
        for name in ("logits_processors", "output_processors"):
            hooks = list(getattr(self, name))
            _check(all(callable(h) for h in hooks), f"{name} must be a list of callables")
            setattr(self, name, hooks)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_token_state(self) -> bool:
        """Whether the sampler keeps per-request device rows (counts, bias) for this request."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_token_ids))

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id the params name must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias)), ("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_token_ids", self.bad_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, f"{name} has token id {bad[0] if bad else 0} outside the vocabulary [0, {vocab_size})")

    def for_sample(self, index: int) -> SamplingParams:
        """The params of parallel sample `index` of n: n = 1, seed + index when seeded."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)
