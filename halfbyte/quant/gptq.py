"""GPTQ (Frantar et al., 2022): quantize W column by column, pushing each column's rounding
error onto the columns not yet quantized through the inverse Hessian of the layer's inputs.

Pure tensor math in float32 on w's device; the caller collects the Hessian with
HessianAccumulator from calibration activations.
"""

from __future__ import annotations

import math

import torch

from halfbyte.errors import QuantizationError
from halfbyte.quant.packing import BLOCK_K, check_bits
from halfbyte.quant.qtensor import QuantSlice, QuantWeight
from halfbyte.quant.rtn import check_group_size, dequantize_values, group_params, quantize_values
from halfbyte.quant.scale_codes import grid_steps, snap
from halfbyte.quant.table_codes import TableCodes, choose, fit_tables

_DAMP_RETRIES = 4  # each retry multiplies the damping by 10


class HessianAccumulator:
    """H = 2 X^T X / n over every row x of every batch, kept as a running mean so that it never
    grows with the token count (large sums of squares lose precision in float32)."""

    def __init__(self, in_features: int, device: torch.device | str | None = None) -> None:
        self.in_features = in_features
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)  # [K, K]
        self.num_samples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """x [..., K]: every leading index is one sample (token)."""
        if x.shape[-1] != self.in_features:
            raise QuantizationError(f"Hessian expects {self.in_features} features, got {x.shape[-1]}")
        x = x.reshape(-1, self.in_features).to(device=self.hessian.device, dtype=torch.float32)
        n = x.shape[0]
        if n == 0:
            return
        total = self.num_samples + n
        self.hessian *= self.num_samples / total
        x = x * math.sqrt(2.0 / total)
        self.hessian.addmm_(x.t(), x)
        self.num_samples = total


class CrossAccumulator:
    """D = 2 (X_f - X)^T X / n: how the float model's inputs X_f differ from the quantized
    model's X, against X (asymmetric_target); a running mean like HessianAccumulator."""

    def __init__(self, in_features: int) -> None:
        self.cross = torch.zeros(in_features, in_features, dtype=torch.float32)
        self.num_samples = 0

    def add_batch(self, x_float: torch.Tensor, x: torch.Tensor) -> None:
        if x_float.shape != x.shape or x.shape[-1] != self.cross.shape[0]:
            raise QuantizationError(f"cross term expects two inputs of {self.cross.shape[0]} features, "
                                    f"got {tuple(x_float.shape)} and {tuple(x.shape)}")
        x = x.reshape(-1, x.shape[-1]).float()
        delta = x_float.reshape(-1, x.shape[-1]).float() - x
        total = self.num_samples + x.shape[0]
        self.cross *= self.num_samples / total
        self.cross.addmm_(delta.t(), x, alpha=2.0 / total)
        self.num_samples = total


def asymmetric_target(w: torch.Tensor, h: torch.Tensor, d: torch.Tensor, damp: float) -> torch.Tensor:
    """The weight W' that GPTQ should quantize when the inputs it will see (X, the quantized
    model's, Hessian H = 2 X^T X / n) differ from the float model's (X_f): the least-squares fit
    of the float layer's output, argmin ||X_f W^T - X W'^T||, is W' = W + W D H^-1 with
    D = 2 (X_f - X)^T X / n. Since the fit's residual is orthogonal to X, ||X_f W^T - X Q^T||^2
    = const + ||X (W' - Q)^T||^2: GPTQ on (W', H) minimises the error against the float model's
    output, so each layer also corrects what the layers before it lost (the asymmetric
    calibration of GPTAQ, Li et al. 2025). Only the correction is damped, so W' = W when X = X_f."""
    k = h.shape[0]
    reg = h.double() + damp * float(torch.diag(h).mean()) * torch.eye(k, dtype=torch.float64, device=h.device)
    correction = torch.linalg.solve(reg, (w.double() @ d.double()).t()).t()  # (W D) H^-1, H symmetric
    return (w.double() + correction).to(w.dtype)


def _inverse_cholesky_upper(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, with U^T U = H^-1; retries
    with 10x more damping when H is not positive definite."""
    k = h.shape[0]
    mean_diag = float(torch.diag(h).mean())
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    for attempt in range(_DAMP_RETRIES + 1):
        d = damp * 10**attempt
        lower, info = torch.linalg.cholesky_ex(h + d * mean_diag * eye)
        if int(info) != 0:
            continue
        hinv = torch.cholesky_inverse(lower)
        upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
        if int(info) == 0 and bool(torch.isfinite(upper).all()):
            return upper
    raise QuantizationError(
        f"Hessian is not positive definite even with damping {damp * 10**_DAMP_RETRIES:g}; "
        "calibrate with more (or more varied) tokens"
    )


def activation_order(energy: torch.Tensor, block: int = 1) -> torch.Tensor:
    """Act-order: columns by descending input energy [K]. block > 1 moves whole blocks of that
    many columns by their summed energy, so groups of that size stay together (a weight already
    on a group grid keeps it exactly in whichever slice its group lands)."""
    if block == 1:
        return torch.argsort(energy, descending=True, stable=True)
    k = energy.shape[0]
    if k % block:
        raise QuantizationError(f"act-order by blocks of {block} needs K divisible by it, got K = {k}")
    order = torch.argsort(energy.view(-1, block).sum(1), descending=True, stable=True)
    return (order[:, None] * block + torch.arange(block)).reshape(-1)


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    *,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    symmetric: bool = False,
    clip_search: bool = False,
    scale_codes: bool | tuple[int, int] = False,
    order_block: int = 1,
) -> tuple[QuantWeight, float]:
    """Quantize w [N, K] given H [K, K] = 2 X^T X / n.

    Returns the QuantWeight (perm set when act_order) and the proxy loss
    0.5 * sum_n (w_n - wq_n) H (w_n - wq_n)^T with the undamped H as given, which for H from
    HessianAccumulator equals ||X W^T - X Wq^T||_F^2 / n: the mean over tokens of the squared
    output error summed over output features. clip_search: rtn.group_params's search for a
    clipped grid per group (asymmetric only). scale_codes: store scales and mins as 8-bit codes
    (scale_codes.py); each group's grid is snapped to the nearest coded one before its columns
    are quantized, so GPTQ compensates the snapping too; (scale_bits, min_bits): table codes
    (table_codes.py), tables fitted to the weight's min-max grids, each group's grid chosen
    among the coded ones by its rounding error (weighted by the input energies). order_block:
    act-order moves blocks of this many columns (activation_order).
    """
    check_bits(bits)
    if w.dim() != 2:
        raise QuantizationError(f"expected a weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % BLOCK_K:
        raise QuantizationError(f"K = {k} is not a multiple of {BLOCK_K}; pad the weight first")
    check_group_size(group_size, k)
    if tuple(hessian.shape) != (k, k):
        raise QuantizationError(f"Hessian must be [{k}, {k}], got {list(hessian.shape)}")
    if block_size <= 0:
        raise QuantizationError(f"block_size must be positive, got {block_size}")
    if not bool(torch.isfinite(w).all()) or not bool(torch.isfinite(hessian).all()):
        raise QuantizationError("weight or Hessian contains NaN or infinity")

    h_orig = hessian.to(device=w.device, dtype=torch.float32)
    h = h_orig.clone()
    weight = w.float().clone()  # [N, K]; becomes the error-updated weight, in stored order

    # A dead input (never nonzero in calibration) never affects the output: zero its weights so
    # they do not widen their group's range, and give it a unit diagonal so H stays invertible.
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0

    perm: torch.Tensor | None = None
    if act_order:
        # Columns with the largest input energy first, while most columns can absorb their error
        perm = activation_order(torch.diag(h), order_block)
        weight = weight[:, perm]
        h = h[perm][:, perm]

    hinv = _inverse_cholesky_upper(h, damp)  # [K, K] upper
    hdiag = torch.diag(h)  # [K] input energies, stored order
    table = isinstance(scale_codes, tuple)
    codes = grid_steps(weight, bits, group_size) if scale_codes and not table else None
    if table:
        base, scale_table, min_table = fit_tables(weight, bits, group_size, *scale_codes)  # type: ignore[misc]
        g_count = math.ceil(k / group_size)
        scale_index = torch.empty(g_count, n, dtype=torch.uint8)
        min_index = torch.empty(g_count, n, dtype=torch.uint8)

    num_groups = math.ceil(k / group_size)
    q = torch.empty(n, k, dtype=torch.int32, device=w.device)
    scales = torch.empty(num_groups, n, dtype=torch.float32, device=w.device)
    mins = torch.empty_like(scales)
    scale = mn = torch.empty(0)

    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        block = weight[:, b0:b1].clone()  # [N, B], updated column by column
        err = torch.empty_like(block)  # [N, B] scaled errors, applied lazily to columns >= b1
        hinv_block = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                # group params from the columns as updated so far (inside and beyond this block)
                g_end = min(col + group_size, k)
                cols = block[:, i : min(g_end, b1) - b0]
                if g_end > b1:
                    cols = torch.cat([cols, weight[:, b1:g_end]], dim=1)
                if table:
                    scale, mn, si, mi = choose(cols, base, scale_table, min_table, (1 << bits) - 1, hdiag[col:g_end])
                    scale_index[col // group_size], min_index[col // group_size] = si.to(torch.uint8), mi.to(torch.uint8)
                else:
                    scale, mn = group_params(cols, bits, symmetric, clip_search, hdiag[col:g_end] if clip_search else None)
                if codes is not None:
                    scale, mn = snap(scale, mn, codes)
                scales[col // group_size], mins[col // group_size] = scale, mn
            wcol = block[:, i]
            qcol = quantize_values(wcol, scale, mn, bits)
            q[:, col] = qcol
            e = (wcol - dequantize_values(qcol, scale, mn)) / hinv_block[i, i]
            block[:, i:] -= e[:, None] * hinv_block[i, i:][None, :]
            err[:, i] = e
        weight[:, b1:] -= err @ hinv[b0:b1, b1:]

    all_codes = TableCodes(scale_codes[0], scale_codes[1], base, scale_table, min_table, scale_index, min_index) if table else codes  # type: ignore[index]
    slice_ = QuantSlice.from_values(0, bits, group_size, q, scales.half(), mins.half(), all_codes)
    qw = QuantWeight(n, k, [slice_], perm.to(torch.int32) if perm is not None else None)

    delta = w.float() - qw.dequantize()  # [N, K] in original order, like h_orig
    loss = 0.5 * float(((delta @ h_orig) * delta).sum())
    return qw, loss
