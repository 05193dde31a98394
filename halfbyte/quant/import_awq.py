"""AWQ checkpoints in the GEMM layout (AutoAWQ `version: "gemm"`) -> QuantWeight.

Per linear layer (K = in_features, N = out_features, G = K / group_size):

- `qweight` int32 [K, N / 8]: packed along N. Word c of row k holds the 4-bit values of columns
  8c .. 8c+7, but interleaved: nibble i (bits 4i .. 4i+3) holds column 8c + ORDER[i] with
  ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (the order AutoAWQ's GEMM kernel dequantizes in).
- `qzeros` int32 [G, N / 8]: zero points packed the same way, stored as they are (no -1).
- `scales` float16 [G, N].

`W[n, k] = (q[n, k] - z[g, n]) * s[g, n]`, g = k // group_size. Stored in min form exactly as
for GPTQ (see import_gptq: `mins = fp16(-z s)`, error <= 2^-11 |z s| per weight). AWQ's
activation-aware scaling is already folded into the weights and the previous layer, so nothing
else is needed at inference.
"""

from __future__ import annotations

import torch

from halfbyte.errors import QuantizationError
from halfbyte.quant.import_gptq import zero_point_to_quant_weight
from halfbyte.quant.packing import BLOCK_K
from halfbyte.quant.qtensor import QuantWeight

AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column 8c + AWQ_ORDER[i]
AWQ_BITS = 4


def unpack_awq(packed: torch.Tensor, n: int, where: str, what: str = "qweight") -> torch.Tensor:
    """int32 [R, N/8] in AWQ's interleaved nibble order -> int32 values [R, N]."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] * 8 != n:
        raise QuantizationError(
            f"{where}: {what} must be int32 [rows, {n // 8 if n % 8 == 0 else n / 8}] for N = {n}, "
            f"got {packed.dtype} {list(packed.shape)}"
        )
    words = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(packed.shape[0], packed.shape[1], 8, dtype=torch.int32)
    for i, col in enumerate(AWQ_ORDER):
        out[:, :, col] = ((words >> (4 * i)) & 0xF).to(torch.int32)
    return out.reshape(packed.shape[0], n)


def awq_to_quant_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bits: int = AWQ_BITS,
    where: str = "awq",
) -> QuantWeight:
    """One AWQ GEMM linear layer -> QuantWeight (bits 4 only; group_size -1 means one group)."""
    if bits != AWQ_BITS:
        raise QuantizationError(f"{where}: unsupported AWQ bits {bits!r}; the GEMM layout is 4-bit only")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise QuantizationError(f"{where}: qweight must be int32 [K, N/8], got {qweight.dtype} {list(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % BLOCK_K:
        raise QuantizationError(f"{where}: in_features {k} is not a multiple of {BLOCK_K}")
    if scales.dim() != 2 or scales.shape[1] != n:
        raise QuantizationError(f"{where}: scales must be [groups, {n}], got {list(scales.shape)}")
    q = unpack_awq(qweight, n, where).t().contiguous()  # [N, K]
    zeros = unpack_awq(qzeros, n, where, "qzeros").to(torch.int64)  # [G, N]
    return zero_point_to_quant_weight(q, None, zeros, scales, bits, group_size, None, where)


def awq_min_rounding(qzeros: torch.Tensor, scales: torch.Tensor) -> float:
    """max |fp16(-z s) - (-z s)|: the largest difference from AWQ's (q - z) * s but one fp32 rounding."""
    z = unpack_awq(qzeros, scales.shape[1], "awq", "qzeros").to(torch.float32)
    exact = -z * scales.to(torch.float16).float()
    return float((exact.half().float() - exact).abs().max()) if exact.numel() else 0.0
