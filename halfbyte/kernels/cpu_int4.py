"""4-bit matmul on the CPU through torch's packed int4 kernel (the x86 "tinygemm" port).

Why: CPU decode streams every weight once per token and is bound by memory bandwidth; reading
4-bit weights instead of a dequantized fp32 copy moves ~7x fewer bytes. torch's kernel takes
bf16 activations (its AVX512-BF16 path; its fp32 path is ~50x slower) and computes
    W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]
which is the halfbyte format's q * s + m with scale = s and zero = m + 8 s, held in bf16.
So the result differs from the fp32 reference (quant_matmul.quant_matmul_ref) by bf16 rounding of
x, of the scales and of the output. Groups of 32, 64, 128 or 256 along K.

The kernel computes row by row: its time grows linearly with the rows (a 512-token prefill ran
at ~150 GFLOP/s on 2 cores). From DENSE_ROWS rows on, the weight is dequantized to a bf16 W^T
for the call (the same formula, from the same bf16 scale and zero; ~0.5 ns per weight) and
multiplied by torch's dense bf16 matmul (AMX / AVX512-BF16 via oneDNN): 7x faster at 512 rows
(BENCHMARKS.md, CPU prefill)."""

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
    qweight: torch.Tensor  # the halfbyte layout [K / 8, N] int32 it came from (shared, not a copy)
    scale_f32: torch.Tensor  # [K / group, 1, N]: the bf16 scale and zero - 8 scale in fp32, for dequantize_t
    offset_f32: torch.Tensor


DENSE_ROWS = 64  # from this many rows on: dequantize + dense matmul (the measured crossover, 2 cores)


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
    scale, offset = sz[..., 0].float(), sz[..., 1].float() - 8.0 * sz[..., 0].float()  # exact in fp32
    return CpuInt4Weight(packed, sz, group_size, qweight, scale[:, None].contiguous(), offset[:, None].contiguous())


def dequantize_t(w: CpuInt4Weight) -> torch.Tensor:
    """The weight as bf16 W^T [K, N]: (q - 8) * scale + zero from the int4 kernel's bf16 scale and
    zero, computed in fp32 and rounded once. Word (r, n) of the halfbyte layout holds
    k = 8r .. 8r + 7 in its nibbles, little-endian, so byte c of it holds k = 8r + 2c (low
    nibble) and 8r + 2c + 1 (high)."""
    kw, n = w.qweight.shape
    by = w.qweight.view(torch.uint8).view(kw, n, 4).transpose(1, 2).contiguous()  # [K/8, 4, N]
    q = torch.empty(kw, 4, 2, n, dtype=torch.uint8)
    torch.bitwise_and(by, 15, out=q[:, :, 0])
    torch.bitwise_right_shift(by, 4, out=q[:, :, 1])
    q_groups = q.view(-1, w.group_size, n).float()  # [G, group, N]
    return torch.addcmul(w.offset_f32, q_groups, w.scale_f32).to(torch.bfloat16).view(kw * 8, n)


def int4_matmul_cpu(x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    """x [M, K] (any float dtype) -> bf16 [M, N]."""
    xb = x.to(torch.bfloat16).contiguous()
    if x.shape[0] >= DENSE_ROWS:
        return torch.mm(xb, dequantize_t(w))
    return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.packed, w.group_size, w.scales_and_zeros)
