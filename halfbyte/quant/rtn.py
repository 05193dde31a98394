"""Round-to-nearest quantization: the baseline, and the per-group helpers GPTQ reuses.

Scales and mins are rounded to float16 *before* the values are quantized with them, so that
q * scale + min reproduces exactly what the stored fp16 tensors will give.
"""

from __future__ import annotations

import math

import torch

from halfbyte.errors import QuantizationError
from halfbyte.quant.packing import BLOCK_K, check_bits
from halfbyte.quant.qtensor import ALLOWED_GROUP_SIZES, QuantSlice, QuantWeight

# Smallest scale kept: a constant group would otherwise give scale 0 and a division by zero;
# 2^-24 is fp16's smallest subnormal, so the stored scale stays nonzero.
_MIN_SCALE = 2.0**-24


def check_group_size(group_size: int, k: int) -> None:
    if group_size not in ALLOWED_GROUP_SIZES and group_size != k:
        raise QuantizationError(
            f"group size {group_size} not allowed; expected one of {ALLOWED_GROUP_SIZES} or K = {k} (per-channel)"
        )


def group_params(
    w: torch.Tensor, bits: int, symmetric: bool = False, clip_search: bool = False,
    col_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min), each float32 [..., N] holding fp16-representable values, for the group of
    columns w [..., N, G] (leading dims: several candidates' groups at once). Asymmetric: the
    grid spans [min, max] of each row. Symmetric: a zero point of 2^(bits-1) and a scale from
    max |w| (mins = -z * scale).

    clip_search (asymmetric only): per row, also try grids over the range shrunk towards its
    midpoint (CLIP_FACTORS) and keep the one with the least squared rounding error; at few bits
    clipping a rare outlier buys a finer grid for the rest (searched up to CLIP_MAX_BITS bits;
    above, the full range is used). The full range comes first and is
    kept on ties, so a row already on a grid stays exact. col_weight [G]: weights of the
    columns' squared errors (GPTQ passes its Hessian's diagonal, the inputs' energies)."""
    maxq = (1 << bits) - 1
    w = w.float()
    if symmetric:
        amax = w.abs().amax(dim=-1)
        scale = (2 * amax / maxq).clamp_min(_MIN_SCALE).half().float()
        # z is a power of two, so -z * scale is exact in fp16 as long as it does not overflow
        mn = (-(1 << (bits - 1)) * scale).half().float()
        return scale, mn
    lo = w.amin(dim=-1)
    hi = w.amax(dim=-1)
    scale = ((hi - lo) / maxq).clamp_min(_MIN_SCALE).half().float()
    mn = lo.half().float()
    if not clip_search or bits > CLIP_MAX_BITS:
        return scale, mn
    # every clipped grid at once ([F, ..., N]; the full range first, so argmin keeps it on ties),
    # in chunks of factors that keep the trial tensor [F, ..., N, G] bounded
    mid, half_range = (hi + lo) / 2, (hi - lo) / 2
    f = torch.tensor((1.0,) + CLIP_FACTORS).view(-1, *([1] * lo.dim()))
    scales = torch.cat([scale[None], (2 * f[1:] * half_range / maxq).clamp_min(_MIN_SCALE).half().float()])
    mins = torch.cat([mn[None], (mid - f[1:] * half_range).half().float()])
    per_chunk = max(1, _CLIP_TRIAL_ELEMENTS // max(1, w.numel()))
    errs = torch.cat([_rounding_error(w, scales[i : i + per_chunk], mins[i : i + per_chunk], maxq, col_weight)
                      for i in range(0, f.shape[0], per_chunk)])
    best = errs.argmin(dim=0, keepdim=True)  # the first (widest) of equally good grids
    return scales.gather(0, best)[0], mins.gather(0, best)[0]


# from 5 bits up the grid is fine enough that clipping almost never wins: the search (the
# converter's hottest loop) is skipped there
CLIP_MAX_BITS = 4
# range fractions clip_search tries after the full range
CLIP_FACTORS = tuple(1.0 - 0.025 * i for i in range(1, 17))  # 0.975 .. 0.6
_CLIP_TRIAL_ELEMENTS = 2**23


def _rounding_error(
    w: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, maxq: int, col_weight: torch.Tensor | None
) -> torch.Tensor:
    """Per grid and row, the (column-weighted) squared error of w [..., N, G] rounded to the grids
    (scale, mn) [F, ..., N]: [F, ..., N]."""
    # in place on one temporary: this is the converter's hottest loop
    e = (w - mn[..., None]).div_(scale[..., None]).round_().clamp_(0, maxq)
    e.mul_(scale[..., None]).add_(mn[..., None]).sub_(w).square_()
    return (e.mul_(col_weight) if col_weight is not None else e).sum(-1)


def quantize_values(w: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer values [N, G] (int32, in [0, 2^bits)) nearest to w [N, G] (or [N]) on the grid
    q * scale + min of each row."""
    maxq = (1 << bits) - 1
    if w.dim() == 1:
        return torch.clamp(torch.round((w.float() - mn) / scale), 0, maxq).to(torch.int32)
    return torch.clamp(torch.round((w.float() - mn[:, None]) / scale[:, None]), 0, maxq).to(torch.int32)


def dequantize_values(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """float32 q * scale + min, q of shape [N] or [N, G]."""
    if q.dim() == 1:
        return q.float() * scale + mn
    return q.float() * scale[:, None] + mn[:, None]


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, symmetric: bool = False) -> QuantWeight:
    """Round-to-nearest quantization of w [N, K] (K a multiple of 32) into one slice."""
    check_bits(bits)
    if w.dim() != 2:
        raise QuantizationError(f"expected a weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % BLOCK_K:
        raise QuantizationError(f"K = {k} is not a multiple of {BLOCK_K}; pad the weight first")
    check_group_size(group_size, k)
    num_groups = math.ceil(k / group_size)
    q = torch.empty(n, k, dtype=torch.int32, device=w.device)
    scales = torch.empty(num_groups, n, dtype=torch.float16, device=w.device)
    mins = torch.empty_like(scales)
    for g in range(num_groups):
        cols = slice(g * group_size, min((g + 1) * group_size, k))
        scale, mn = group_params(w[:, cols], bits, symmetric)
        q[:, cols] = quantize_values(w[:, cols], scale, mn, bits)
        scales[g], mins[g] = scale.half(), mn.half()
    return QuantWeight(n, k, [QuantSlice.from_values(0, bits, group_size, q, scales, mins)], None)
