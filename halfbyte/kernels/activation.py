"""SwiGLU's gate: silu(gate) * up on the fused gate/up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfbyte.kernels import gemv_w4_i8
from halfbyte.kernels.dispatch import use_triton
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton

BLOCK = 1024  # columns per program


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, then up) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(gu_ptr, out_ptr, planes_ptr, x_scales_ptr, row_sums_ptr, inter,
                             BLOCK: tl.constexpr, PLANES_GROUP: tl.constexpr, PDL: tl.constexpr):
        pdl_sync(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        # fp32 arithmetic; silu(gate) rounded to the activation dtype first, as the reference does
        dtype = out_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (act * up).to(dtype)
        tl.store(out_ptr + row * inter + cols, out, mask=mask)
        if PLANES_GROUP > 0:  # one row: the output's int8 planes for the down projection's gemv_w4_i8
            NG: tl.constexpr = BLOCK // PLANES_GROUP
            ROWS: tl.constexpr = PLANES_GROUP // 8
            gemv_w4_i8.store_planes(tl.reshape(out.to(tl.float32), [NG, ROWS, 8]), tl.program_id(1) * NG,
                                    inter // PLANES_GROUP, planes_ptr, x_scales_ptr, row_sums_ptr, NG, ROWS)


def silu_and_mul_triton(
    gate_up: torch.Tensor, planes_group: int | None = None
) -> tuple[torch.Tensor, gemv_w4_i8.XPlanes | None]:
    """(silu(gate) * up, and for one row with planes_group its int8 planes, or None): one launch."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * inter)
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    planes = None
    if planes_group is not None:
        assert rows == 1 and BLOCK % planes_group == 0, (gate_up.shape, planes_group)
        assert gemv_w4_i8.supports(out.view(1, inter), 4, planes_group), (gate_up.shape, gate_up.dtype, planes_group)
        planes = gemv_w4_i8.empty_planes(inter, planes_group, gate_up.device)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, BLOCK))](
        gate_up, out, *((planes.planes, planes.scales, planes.row_sums) if planes is not None else (out, out, out)),
        inter, BLOCK=BLOCK, PLANES_GROUP=planes_group or 0, num_warps=4, **pdl_args(gate_up.device),
    )
    return out, planes


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        return silu_and_mul_triton(gate_up)[0]
    return silu_and_mul_ref(gate_up)


def silu_and_mul_planes(gate_up: torch.Tensor, planes_group: int) -> tuple[torch.Tensor, gemv_w4_i8.XPlanes]:
    """(silu_and_mul(gate_up), its int8 planes in groups of planes_group) for one row, one launch
    (Triton only: the planes exist for gemv_w4_i8)."""
    out, planes = silu_and_mul_triton(gate_up, planes_group)
    assert planes is not None
    return out, planes
