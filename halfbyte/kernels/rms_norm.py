"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfbyte.kernels import gemv_w4_i8
from halfbyte.kernels.dispatch import use_triton
from halfbyte.kernels.gemv_w4_i8 import XPlanes
from halfbyte.kernels.triton_utils import HAS_TRITON, next_power_of_2, pdl_args, pdl_sync, tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), in fp32, cast back to x's dtype before the weight as Llama does."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # the same arithmetic in one fused op: a decode step on the CPU is op-count bound here
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's two outputs."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


# one row writing planes is split into column chunks over several SMs
CHUNK_FEW_ROWS = 512

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, planes_ptr, x_scales_ptr, row_sums_ptr,
        n_cols, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, PLANES_GROUP: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (row, c) writes columns c*CHUNK .. of the row. Each reads the whole row for the
        rms (from L2 after the first): one program per row would leave a decode step's one row
        on one SM, latency bound."""
        pdl_sync(PDL)
        row = tl.program_id(0).to(tl.int64)
        # arithmetic in fp32, rounded to the activation dtype where the reference rounds
        dtype = x_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        xf = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            xf = (xf + r).to(dtype).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        if CHUNK < BLOCK:  # this program's columns, again (from L1/L2); one chunk keeps the row it has
            cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
            mask = cols < n_cols
            xf = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                xf = (xf + r).to(dtype).to(tl.float32)
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + row * n_cols + cols, xf.to(dtype), mask=mask)
        normed = (xf * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = (normed * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n_cols + cols, out, mask=mask)
        if PLANES_GROUP > 0:  # one row: the output's int8 planes for gemv_w4_i8, from the rounded output
            NG: tl.constexpr = CHUNK // PLANES_GROUP
            ROWS: tl.constexpr = PLANES_GROUP // 8
            gemv_w4_i8.store_planes(tl.reshape(out.to(tl.float32), [NG, ROWS, 8]), tl.program_id(1) * NG,
                                    n_cols // PLANES_GROUP, planes_ptr, x_scales_ptr, row_sums_ptr, NG, ROWS)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    planes_group: int | None = None, chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, XPlanes | None]:
    """(out, x + residual or None, out's int8 planes in groups of planes_group or None): one launch.
    chunk: columns per program (a power of two; default: the whole row, 512 where the planes are
    written: one row on one SM is latency bound. The plain norm's default stays until measured)."""
    x = x.contiguous()
    n_cols = x.shape[-1]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    rows = x.numel() // n_cols
    block = next_power_of_2(n_cols)
    chunk = min(block, chunk or (CHUNK_FEW_ROWS if planes_group is not None else block))
    planes = None
    if planes_group is not None:
        assert gemv_w4_i8.supports(x.view(rows, n_cols), 4, planes_group), (x.shape, x.dtype, planes_group)
        chunk = max(chunk, planes_group)
        planes = gemv_w4_i8.empty_planes(n_cols, planes_group, x.device)
    _rms_norm_kernel[(rows, triton.cdiv(n_cols, chunk))](
        x, residual.contiguous() if residual is not None else x, weight, out,
        res_out if res_out is not None else out,
        *((planes.planes, planes.scales, planes.row_sums) if planes is not None else (out, out, out)),
        n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, CHUNK=chunk, PLANES_GROUP=planes_group or 0,
        num_warps=min(16, max(4 if chunk < block else 1, chunk // 256)), **pdl_args(x.device),
    )
    return out, res_out, planes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)[0]
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        out, summed, _ = rms_norm_triton(x, weight, eps, residual)
        assert summed is not None
        return out, summed
    return add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_planes(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, planes_group: int
) -> tuple[torch.Tensor, torch.Tensor, XPlanes]:
    """(rms_norm(x + residual), x + residual, the output's int8 planes for gemv_w4_i8) in one
    launch, for one fp16 row on the GPU; residual None: no add, x is passed through."""
    out, summed, planes = rms_norm_triton(x, weight, eps, residual, planes_group)
    assert planes is not None
    return out, summed if summed is not None else x, planes
