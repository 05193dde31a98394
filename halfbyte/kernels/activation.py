"""SwiGLU's gate: silu(gate) * up on the fused gate/up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfbyte.kernels.dispatch import use_triton
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, then up) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_sync(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        # fp32 arithmetic; silu(gate) rounded to the activation dtype first, as the reference does
        dtype = out_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * inter)
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4, **pdl_args(gate_up.device))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)
