"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Filters work on the whole [B, V] batch at once; the draw is the exponential race
(argmax p / E with E ~ Exp(1)), which needs no cumulative sum and lets each request draw its
noise from its own generator, so a seeded request samples the same tokens in any batch."""

from __future__ import annotations

import torch

from halfbyte.sampling_params import SamplingParams


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled fp32 logits [B, V] with filtered-out tokens at -inf."""
    device = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    logits = logits.float() / temps.unsqueeze(1)
    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor([k or vocab for k in top_k], device=device)
        kth = logits.sort(dim=1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        sorted_logits, order = logits.sort(dim=1, descending=True)
        probs = sorted_logits.softmax(dim=1)
        # drop a token when the tokens ranked above it already cover top_p; the top one stays
        drop_sorted = (probs.cumsum(dim=1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = logits.softmax(dim=1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=1, keepdim=True).values, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # [B, V]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One token id per row, int64 [B]."""
    greedy = logits.argmax(dim=1)
    if all(p.greedy for p in params):
        return greedy
    probs = apply_filters(logits, params).softmax(dim=1)
    noise = torch.empty_like(probs)
    for row, gen in enumerate(generators):  # O(batch) launches; issue 6 batches these on the GPU
        noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=1)
    is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return torch.where(is_greedy, greedy, sampled)
