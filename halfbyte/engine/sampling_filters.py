"""Batched vocabulary filters on temperature-scaled fp32 logits: top-k, top-p, typical, min-p.

Each filter sets dropped tokens to -inf and the next one renormalises over the survivors.
top-k and top-p work on a bounded candidate set from torch.topk (no full-vocabulary sort);
a top-p row whose candidates hold less than top_p of the mass falls back to a full sort.
Typical sampling ranks tokens by |-log p - H|, not by p, so its rows take a full sort.
min-p is a threshold on the logits (p >= min_p * p_max <=> x >= x_max + log min_p): no sort."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_P_CANDIDATES = 1024  # top-p looks at this many best tokens before falling back to a sort
NEG_INF = float("-inf")


@dataclass
class FilterParams:
    """Per-row filter parameters as device tensors, and host flags of which filters are on."""

    top_k: torch.Tensor  # [B] int64; vocab size where off
    top_p: torch.Tensor  # [B] fp32; 1 where off
    typical_p: torch.Tensor  # [B] fp32; 1 where off
    min_p: torch.Tensor  # [B] fp32; 0 where off
    max_top_k: int  # largest top_k among rows that use it (0: none)
    use_top_p: bool
    typical_rows: torch.Tensor | None  # [R] int64 rows with typical_p < 1 (built on the host: no sync)
    use_min_p: bool
    # every sampling row has a top_k: all filtering and the draw can stay on [B, max_top_k] candidates
    candidates_only: bool = False


def _keep_before_mass(probs_sorted: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Keep a ranked token while the tokens ranked above it hold less than `mass`; the first stays."""
    before = probs_sorted.cumsum(dim=1) - probs_sorted
    keep = before < mass.unsqueeze(1)
    keep[:, 0] = True
    return keep


def _top_k_top_p(x: torch.Tensor, f: FilterParams) -> torch.Tensor:
    rows, vocab = x.shape
    has_k = f.top_k < vocab  # [B]
    k_bound = min(vocab, max(f.max_top_k, TOP_P_CANDIDATES if f.use_top_p and not f.candidates_only else 0))
    vals, idx = x.topk(k_bound, dim=1)  # [B, K] descending
    pos = torch.arange(k_bound, device=x.device)
    keep = pos.unsqueeze(0) < f.top_k.unsqueeze(1)  # top_k = vocab keeps every candidate
    short = None
    if f.use_top_p:
        # top-p's mass is over top-k's survivors: the candidates where top-k is on, else the whole row
        kept_vals = vals.masked_fill(~keep, NEG_INF)
        lse = torch.where(has_k, kept_vals.logsumexp(dim=1), x.logsumexp(dim=1))
        probs = (kept_vals - lse.unsqueeze(1)).exp()  # [B, K]
        keep &= _keep_before_mass(probs, f.top_p)
        short = ~has_k & (probs.sum(dim=1) < f.top_p)  # the cut lies beyond the candidates
    out = torch.full_like(x, NEG_INF).scatter_(1, idx, vals.masked_fill(~keep, NEG_INF))
    # without top-k or top-p a row keeps everything (top_k >= vocab and top_p = 1 drop nothing)
    untouched = ~has_k & (f.top_p >= 1.0)
    out = torch.where(untouched.unsqueeze(1), x, out)
    if short is not None and bool(short.any()):  # rare: flat distributions; one host sync
        rows_short = short.nonzero().squeeze(1)
        out[rows_short] = _top_p_sorted(x[rows_short], f.top_p[rows_short])
    return out


def _top_p_sorted(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = x.sort(dim=1, descending=True)
    keep_sorted = _keep_before_mass(sorted_x.softmax(dim=1), top_p)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return x.masked_fill(~keep, NEG_INF)


def _typical(x: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    logp = x.log_softmax(dim=1)
    probs = logp.exp()
    entropy = -(probs * logp.masked_fill(probs == 0, 0.0)).sum(dim=1, keepdim=True)  # [B, 1]
    surprise_gap = (-logp - entropy).abs().masked_fill(probs == 0, float("inf"))
    gap_sorted, order = surprise_gap.sort(dim=1)
    keep_sorted = _keep_before_mass(probs.gather(1, order), typical_p)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return x.masked_fill(~keep, NEG_INF)


def filter_candidates(x: torch.Tensor, f: FilterParams) -> tuple[torch.Tensor, torch.Tensor]:
    """When every row has a top_k (f.candidates_only): ([B, K] filtered candidate logits with
    dropped ones at -inf, [B, K] their token ids). Never touches the full vocabulary again."""
    vals, idx = x.topk(f.max_top_k, dim=1)  # [B, K] descending
    pos = torch.arange(f.max_top_k, device=x.device)
    vals = vals.masked_fill(pos.unsqueeze(0) >= f.top_k.unsqueeze(1), NEG_INF)
    if f.use_top_p:
        vals = vals.masked_fill(~_keep_before_mass(vals.softmax(dim=1), f.top_p), NEG_INF)
    if f.typical_rows is not None:
        rows = f.typical_rows
        vals = vals.index_copy(0, rows, _typical(vals[rows], f.typical_p[rows]))
    if f.use_min_p:
        vals = _min_p(vals, f.min_p)
    return vals, idx


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = x.max(dim=1, keepdim=True).values + min_p.log().unsqueeze(1)  # log 0 = -inf keeps all
    return x.masked_fill(x < threshold, NEG_INF)


def apply_filters(x: torch.Tensor, f: FilterParams) -> torch.Tensor:
    """x [B, V] fp32 scaled logits -> the same with filtered-out tokens at -inf."""
    if f.max_top_k > 0 or f.use_top_p:
        x = _top_k_top_p(x, f)
    if f.typical_rows is not None:  # typical rows only pay for the sort
        rows = f.typical_rows
        x = x.index_copy(0, rows, _typical(x[rows], f.typical_p[rows]))
    if f.use_min_p:
        x = _min_p(x, f.min_p)
    return x
