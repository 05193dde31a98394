"""Plain per-row references for the sampler's processing, written from the definitions with
Python loops (double precision), and a minimal sequence the sampler can read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from halfbyte.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass(eq=False)
class FakeSeq:
    params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)


def _mask(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, logits, torch.tensor(NEG_INF, dtype=logits.dtype))


def _keep_by_mass(order: list[int], probs: torch.Tensor, keep: torch.Tensor, mass_limit: float) -> None:
    mass = 0.0
    first = True
    for t in order:
        if not keep[t]:
            continue
        if mass >= mass_limit and not first:
            keep[t] = False
        first = False
        mass += probs[t].item()


def ref_penalized(row: torch.Tensor, seq: FakeSeq, eos: set[int]) -> torch.Tensor:
    """Penalties, bias, allowed / banned ids, min_tokens and temperature on one row."""
    p = seq.params
    x = row.double().clone()
    prompt, output = seq.prompt_token_ids, seq.token_ids[len(seq.prompt_token_ids):]
    if p.penalty_window is None:
        counted, seen = output, set(prompt) | set(output)
    else:
        counted = seq.token_ids[-p.penalty_window:]
        seen = set(counted)
    for t in seen:
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(counted):
        x[t] -= p.frequency_penalty * counted.count(t) + p.presence_penalty
    for t, b in p.logit_bias.items():
        x[t] += b
    if p.allowed_token_ids is not None:
        allowed = set(p.allowed_token_ids)
        for t in range(len(x)):
            if t not in allowed:
                x[t] = NEG_INF
    for t in p.bad_token_ids:
        x[t] = NEG_INF
    if len(output) < p.min_tokens:
        for t in eos | set(p.stop_token_ids):
            x[t] = NEG_INF
    return x / (p.temperature or 1.0)


def ref_filtered_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """top-k -> top-p -> typical -> min-p on one scaled row, each over the previous survivors."""
    keep = torch.isfinite(x) | (x > 0)
    order = x.argsort(descending=True, stable=True).tolist()
    if p.greedy:
        return torch.nn.functional.one_hot(x.argmax(), len(x)).double()
    if p.top_k > 0:
        for t in [t for t in order if keep[t]][p.top_k:]:
            keep[t] = False
    if p.top_p < 1:
        _keep_by_mass(order, _mask(x, keep).softmax(0), keep, p.top_p)
    if p.typical_p < 1:
        probs = _mask(x, keep).softmax(0)
        entropy = -sum(probs[t].item() * math.log(probs[t].item()) for t in range(len(x)) if probs[t] > 0)
        gaps = {t: abs(-math.log(probs[t].item()) - entropy) for t in range(len(x)) if probs[t] > 0}
        _keep_by_mass(sorted(gaps, key=gaps.__getitem__), probs, keep, p.typical_p)
    if p.min_p > 0:
        probs = _mask(x, keep).softmax(0)
        keep &= probs >= p.min_p * probs.max()
    return _mask(x, keep).softmax(0)
