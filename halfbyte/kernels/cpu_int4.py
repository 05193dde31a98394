"""4-bit matmul on the CPU through torch's packed int4 kernel (the x86 "tinygemm" port).

Why: CPU decode streams every weight once per token and is bound by memory bandwidth; reading
4-bit weights instead of a dequantized fp32 copy moves ~7x fewer bytes. torch's kernel takes
bf16 activations (its AVX512-BF16 path; its fp32 path is ~50x slower) and computes
    W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]
which is the halfbyte format's q * s + m with scale = s and zero = m + 8 s, held in bf16.
So the result differs from the fp32 reference (quant_matmul.quant_matmul_ref) by bf16 rounding of
x, of the scales and of the output. Groups of 32, 64, 128 or 256 along K."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halfbyte.quant.packing import unpack

GROUP_SIZES = (32, 64, 128, 256)


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass
class CpuInt4Weight:
    packed: torch.Tensor  # torch's int4 layout for [N, K]
    scales_and_zeros: torch.Tensor  # bf16 [K / group, N, 2]
    group_size: int


def supports(bits: int, group_size: int, k: int, n: int) -> bool:
    return available() and bits == 4 and group_size in GROUP_SIZES and k % group_size == 0 and n % 16 == 0


def pack_for_cpu(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int, k: int
) -> CpuInt4Weight:
    """halfbyte 4-bit tensors (docs/format.md) -> torch's int4 CPU layout."""
    q = unpack(qweight, 4, k)  # int32 [N, K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    s = scales.float()
    sz = torch.stack([s, mins.float() + 8.0 * s], dim=-1).to(torch.bfloat16).contiguous()  # [G, N, 2]
    return CpuInt4Weight(packed, sz, group_size)


def int4_matmul_cpu(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    """x [M, K] (any float dtype) -> bf16 [M, N]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16).contiguous(), w.packed, w.group_size, w.scales_and_zeros
    )
