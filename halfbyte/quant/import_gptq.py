"""GPTQ checkpoints (AutoGPTQ / GPTQModel / transformers layout) -> QuantWeight, no float round-trip.

Per linear layer a GPTQ checkpoint stores (K = in_features, N = out_features, G = groups):

- `qweight` int32 [K * bits / 32, N]: the values of 32 consecutive k of one column form a
  little-endian bitstream of `bits` words (4 bits: word j holds k = 8j .. 8j+7 at bits 4i; 3 bits:
  values straddle words exactly as in docs/format.md). This *is* halfbyte's packing, for 2, 3, 4
  and 8 bits, so without act-order the words are kept as they are.
- `qzeros` int32 [G, N * bits / 32]: zero points packed the same way along N. The classic format
  ("gptq", v1) stores `z - 1` and readers add 1 after masking (so a zero point of 0 reads as
  2^bits: that is what the reference kernels compute, and what we reproduce); "gptq_v2" stores z.
- `scales` float16 [G, N];  `g_idx` int32 [K]: the group of each original column k.

The reference meaning is `W[n, k] = (q[n, k] - z[g, n]) * s[g, n]` with `g = g_idx[k]`. halfbyte
stores it in min form with `mins = fp16(-z * s)`: exact when `z * s` fits fp16 (z a power of two,
as in symmetric GPTQ), otherwise the min is rounded once, so every weight differs from the
reference by at most |fp16(z s) - z s| <= 2^-11 |z s| (half an ulp; below 2^-14 the absolute bound
2^-25 applies), plus one fp32 rounding of q s + min (<= 2^-24 |W|). In units of the
quantization step s that is at most z * 2^-11 <= 2^(bits - 11): 1/128 step at 4 bits.

Act-order (`desc_act`) checkpoints have a g_idx that is not sorted: halfbyte stores the columns
sorted by group (`perm = argsort(g_idx, stable)`), which makes every group contiguous, as the
format requires. Group sizes above 128 that are multiples of 32 are stored exactly by repeating
each scale and min over halfbyte groups of 128 (64, 32); -1 (one group) is per-channel.
"""

from __future__ import annotations

import math

import torch

from halfbyte.errors import QuantizationError
from halfbyte.quant.packing import BLOCK_K, pack, unpack
from halfbyte.quant.qtensor import ALLOWED_GROUP_SIZES, QuantSlice, QuantWeight

GPTQ_BITS: tuple[int, ...] = (2, 3, 4, 8)


def unpack_along_n(packed: torch.Tensor, bits: int, n: int, where: str) -> torch.Tensor:
    """int32 [R, ceil(n * bits / 32)] packed along the last dim (GPTQ qzeros) -> int32 [R, n]."""
    words_needed = math.ceil(n * bits / 32)
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != words_needed:
        raise QuantizationError(
            f"{where}: packed zeros must be int32 [groups, {words_needed}] for N = {n} at {bits} bits, "
            f"got {packed.dtype} {list(packed.shape)}"
        )
    # the same bitstream as along K: transpose, pad to whole 32-value blocks, reuse unpack
    padded_n = math.ceil(n / BLOCK_K) * BLOCK_K
    words = packed.t().contiguous()  # [words, R]
    pad_rows = padded_n // BLOCK_K * bits - words.shape[0]
    if pad_rows:
        words = torch.cat([words, words.new_zeros(pad_rows, words.shape[1])])
    return unpack(words, bits, padded_n)[:, :n].contiguous()  # [R, n]


def halfbyte_group_size(group_size: int, k: int, where: str) -> int:
    """The halfbyte group size that stores source groups of `group_size` exactly (each source group
    a whole number of halfbyte groups)."""
    if group_size == -1 or group_size >= k:
        return k  # one group: per-channel
    if group_size in ALLOWED_GROUP_SIZES:
        return group_size
    for g in sorted(ALLOWED_GROUP_SIZES, reverse=True):
        if group_size % g == 0:
            return g
    raise QuantizationError(
        f"{where}: group size {group_size} cannot be stored exactly "
        f"(halfbyte groups are {ALLOWED_GROUP_SIZES} or per-channel)"
    )


def zero_point_to_quant_weight(
    q: torch.Tensor | None,
    qweight: torch.Tensor | None,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None,
    where: str,
) -> QuantWeight:
    """Build a QuantWeight from `(q - z) * s` data in stored order.

    Either q (int [N, K], stored order) or an already halfbyte-packed qweight is given. zeros and
    scales are [G, N] with source groups of `group_size` (-1: one group) along stored K."""
    if qweight is not None:
        n, k = qweight.shape[1], qweight.shape[0] * 32 // bits
    else:
        assert q is not None
        n, k = q.shape
    if k % BLOCK_K:
        raise QuantizationError(f"{where}: in_features {k} is not a multiple of {BLOCK_K}")
    src_gs = k if group_size == -1 else group_size
    if src_gs <= 0:
        raise QuantizationError(f"{where}: bad group size {group_size}")
    num_src_groups = math.ceil(k / src_gs)
    for name, t in (("zeros", zeros), ("scales", scales)):
        if tuple(t.shape) != (num_src_groups, n):
            raise QuantizationError(
                f"{where}: {name} has shape {list(t.shape)}, expected [{num_src_groups}, {n}] "
                f"(K = {k}, group size {group_size}, N = {n})"
            )
    if not scales.dtype.is_floating_point:
        raise QuantizationError(f"{where}: scales must be floating point, got {scales.dtype}")
    s16 = scales.to(torch.float16)
    if not torch.equal(s16.float(), scales.float()):
        raise QuantizationError(f"{where}: scales are not representable in float16 ({scales.dtype})")
    if not bool(torch.isfinite(s16).all()):
        raise QuantizationError(f"{where}: scales hold inf or nan")
    # z * s is exact in fp32 (z has at most 9 significant bits, s 11); one rounding to fp16
    mins32 = -zeros.to(torch.float32) * s16.float()
    mins = mins32.to(torch.float16)
    if not bool(torch.isfinite(mins).all()):
        raise QuantizationError(f"{where}: a zero point times its scale overflows float16")

    gs = halfbyte_group_size(group_size, k, where)
    num_groups = math.ceil(k / gs)
    source_of = torch.arange(num_groups) * gs // src_gs  # halfbyte group -> source group
    s16, mins = s16[source_of].contiguous(), mins[source_of].contiguous()
    packed = qweight if qweight is not None else pack(q, bits)  # type: ignore[arg-type]
    return QuantWeight(n, k, [QuantSlice(0, k, bits, gs, packed, s16, mins)], perm)


def act_order_perm(g_idx: torch.Tensor, group_size: int, k: int, where: str) -> torch.Tensor | None:
    """The permutation that makes g_idx's groups contiguous (None when they already are), after
    checking that each group holds exactly `group_size` columns (the last may be short)."""
    if tuple(g_idx.shape) != (k,) or g_idx.dtype.is_floating_point:
        raise QuantizationError(f"{where}: g_idx must be an integer tensor [{k}], got {g_idx.dtype} {list(g_idx.shape)}")
    gs = k if group_size == -1 else group_size
    g_idx = g_idx.long()
    if gs >= k:
        if bool((g_idx != 0).any()):
            raise QuantizationError(f"{where}: g_idx names groups other than 0 for a single-group layer")
        return None  # one group: the order of the columns does not matter
    perm = torch.sort(g_idx, stable=True).indices
    expected = torch.arange(k) // gs
    if not torch.equal(g_idx[perm], expected):
        raise QuantizationError(
            f"{where}: g_idx does not split K = {k} into groups of {gs} columns; cannot store it as contiguous groups"
        )
    if torch.equal(perm, torch.arange(k)):
        return None
    return perm.to(torch.int32)


def gptq_to_quant_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    zero_offset: int = 1,
    where: str = "gptq",
) -> QuantWeight:
    """One GPTQ linear layer -> QuantWeight. zero_offset is added to the stored zero points: 1 for
    the classic ("gptq", v1) checkpoint format, 0 for "gptq_v2"."""
    if bits not in GPTQ_BITS:
        raise QuantizationError(f"{where}: unsupported GPTQ bits {bits!r}; expected one of {GPTQ_BITS}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise QuantizationError(f"{where}: qweight must be int32 [K*bits/32, N], got {qweight.dtype} {list(qweight.shape)}")
    if (qweight.shape[0] * 32) % bits:
        raise QuantizationError(f"{where}: qweight has {qweight.shape[0]} rows, not a whole number of {bits}-bit values")
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    if k % BLOCK_K:
        raise QuantizationError(f"{where}: in_features {k} is not a multiple of {BLOCK_K}")
    if scales.dim() != 2 or scales.shape[1] != n:
        raise QuantizationError(f"{where}: scales must be [groups, {n}], got {list(scales.shape)}")
    if group_size != -1 and group_size <= 0:
        raise QuantizationError(f"{where}: bad group size {group_size}")
    expect_groups = 1 if group_size == -1 else math.ceil(k / group_size)
    if scales.shape[0] != expect_groups:
        raise QuantizationError(
            f"{where}: scales has {scales.shape[0]} groups; K = {k} with group size {group_size} needs {expect_groups}"
        )
    zeros = unpack_along_n(qzeros, bits, n, where).to(torch.int64)
    if zeros.shape[0] != scales.shape[0]:
        raise QuantizationError(f"{where}: qzeros has {zeros.shape[0]} groups, scales {scales.shape[0]}")
    zeros = zeros + zero_offset  # no masking after the +1: that is what GPTQ's kernels compute
    perm = act_order_perm(g_idx, group_size, k, where) if g_idx is not None else None
    if perm is None:
        return zero_point_to_quant_weight(None, qweight.contiguous(), zeros, scales, bits, group_size, None, where)
    q = unpack(qweight.contiguous(), bits, k)[:, perm.long()]  # [N, K] in stored (group-sorted) order
    return zero_point_to_quant_weight(q, None, zeros, scales, bits, group_size, perm, where)


def max_min_rounding(qzeros: torch.Tensor, scales: torch.Tensor, bits: int, zero_offset: int = 1) -> float:
    """max |fp16(-z s) - (-z s)| over the groups: the largest difference between the imported
    weights and GPTQ's (q - z) * s, apart from one fp32 rounding."""
    z = unpack_along_n(qzeros, bits, scales.shape[1], "gptq").to(torch.float32) + zero_offset
    exact = -z * scales.to(torch.float16).float()
    return float((exact.half().float() - exact).abs().max()) if exact.numel() else 0.0
