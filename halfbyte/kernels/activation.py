"""SwiGLU's gate: silu(gate) * up on the fused gate/up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfbyte.kernels.dispatch import use_triton
from halfbyte.kernels.split_sum import SplitSum, resolve
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, then up) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, out_ptr, inter, split_stride, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_sync(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        if SPLITS > 1:  # gate_up is a GEMV's fp32 split-K partials (split_sum.py): their sums, rounded once
            for s in tl.static_range(1, SPLITS):
                gate += tl.load(gu_ptr + s * split_stride + row * 2 * inter + cols, mask=mask, other=0.0)
                up += tl.load(gu_ptr + s * split_stride + row * 2 * inter + inter + cols, mask=mask, other=0.0)
            gate = gate.to(dtype).to(tl.float32)
            up = up.to(dtype).to(tl.float32)
        # fp32 arithmetic; silu(gate) rounded to the activation dtype first, as the reference does
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor | SplitSum) -> torch.Tensor:
    splits, dtype = (gate_up.partials.shape[0], gate_up.dtype) if isinstance(gate_up, SplitSum) else (1, gate_up.dtype)
    data = (gate_up.partials if isinstance(gate_up, SplitSum) else gate_up).contiguous()
    inter = data.shape[-1] // 2
    shape = gate_up.shape
    rows = shape.numel() // (2 * inter)
    out = torch.empty(*shape[:-1], inter, dtype=dtype, device=data.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](data, out, inter, shape.numel(), SPLITS=splits, BLOCK=block,
                                                           num_warps=4, **pdl_args(data.device))
    return out


def silu_and_mul(gate_up: torch.Tensor | SplitSum) -> torch.Tensor:
    """gate_up may be a GEMV's split-K partials (split_sum.py), summed here."""
    if use_triton(gate_up.partials if isinstance(gate_up, SplitSum) else gate_up):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(resolve(gate_up))
