"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfbyte.kernels.dispatch import use_triton
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


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
        n_cols, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_sync(PDL)
        # one program per row; the row fits in registers (hidden sizes up to 16k)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        # arithmetic in fp32, rounded to the activation dtype where the reference rounds
        dtype = x_ptr.dtype.element_ty
        xf = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            summed = (xf + r).to(dtype)
            tl.store(res_out_ptr + row * n_cols + cols, summed, mask=mask)
            xf = summed.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        normed = (xf * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = x.contiguous()
    n_cols = x.shape[-1]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    rows = x.numel() // n_cols
    block = next_power_of_2(n_cols)
    _rms_norm_kernel[(rows,)](
        x, residual.contiguous() if residual is not None else x, weight, out,
        res_out if res_out is not None else out, n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)), **pdl_args(x.device),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)[0]
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        out, summed = rms_norm_triton(x, weight, eps, residual)
        assert summed is not None
        return out, summed
    return add_rms_norm_ref(x, residual, weight, eps)
