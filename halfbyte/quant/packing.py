"""Bit packing of quantized values into halfbyte's int32 layout (docs/format.md).

K is cut into blocks of 32 consecutive k. The 32 values of one (block, column n) form a
little-endian bitstream of 32 * bits bits, i.e. exactly `bits` int32 words: value i occupies
stream bits [i * bits, i * bits + bits), word w holds stream bits [32 w, 32 w + 32). Row
(block * bits + w) of the packed tensor holds word w of that block for every column, so a
kernel reading along N makes coalesced loads for every bit width, and 4 bits is the GPTQ layout.
"""

from __future__ import annotations

import torch

from halfbyte.errors import QuantizationError

SUPPORTED_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
BLOCK_K = 32  # values per bitstream; a block of one column fills exactly `bits` words
_U32 = 0xFFFFFFFF

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def check_bits(bits: int, where: str = "") -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        at = f"{where}: " if where else ""
        raise QuantizationError(f"{at}unsupported bits {bits!r}; expected one of {SUPPORTED_BITS}")


def packed_rows(k: int, bits: int) -> int:
    """Rows of the packed tensor for K = k (k a multiple of 32)."""
    return k // BLOCK_K * bits


def _word_positions(bits: int) -> list[tuple[int, int, int, int]]:
    """For each value i of a block: (i, word, shift, spill) where spill > 0 is how many of its
    high bits continue at the bottom of the next word."""
    out = []
    for i in range(BLOCK_K):
        word, shift = divmod(i * bits, 32)
        out.append((i, word, shift, max(0, shift + bits - 32)))
    return out


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int values q [N, K] in [0, 2^bits) -> int32 qweight [K/32 * bits, N]."""
    check_bits(bits)
    if q.dim() != 2:
        raise QuantizationError(f"pack expects q of shape [N, K], got {tuple(q.shape)}")
    if q.dtype not in _INT_DTYPES:
        raise QuantizationError(f"pack expects an integer tensor, got {q.dtype}")
    n, k = q.shape
    if k % BLOCK_K != 0:
        raise QuantizationError(f"K = {k} is not a multiple of {BLOCK_K}; pad K before packing")
    if q.numel() > 0:
        lo, hi = int(q.min()), int(q.max())
        if lo < 0 or hi >= (1 << bits):
            raise QuantizationError(f"values in [{lo}, {hi}] do not fit {bits} bits [0, {(1 << bits) - 1}]")

    # int64 holds any 32-bit word unsigned, so shifts never touch a sign bit
    values = q.to(torch.int64).t().reshape(k // BLOCK_K, BLOCK_K, n)  # [blocks, 32, N]
    words = torch.zeros(k // BLOCK_K, bits, n, dtype=torch.int64, device=q.device)
    for i, word, shift, spill in _word_positions(bits):
        v = values[:, i]
        words[:, word] |= (v << shift) & _U32
        if spill:
            words[:, word + 1] |= v >> (bits - spill)
    # reinterpret the unsigned 32-bit words as int32 (two's complement)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.reshape(k // BLOCK_K * bits, n).to(torch.int32).contiguous()


def unpack(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """int32 qweight [K/32 * bits, N] -> int32 values [N, K] in [0, 2^bits)."""
    check_bits(bits)
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise QuantizationError(
            f"qweight must be int32 [K/32*bits, N], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if k % BLOCK_K != 0:
        raise QuantizationError(f"K = {k} is not a multiple of {BLOCK_K}")
    if qweight.shape[0] != packed_rows(k, bits):
        raise QuantizationError(
            f"qweight has {qweight.shape[0]} rows; {bits}-bit K = {k} needs {packed_rows(k, bits)}"
        )
    n = qweight.shape[1]
    words = qweight.to(torch.int64).reshape(k // BLOCK_K, bits, n) & _U32  # unsigned view
    mask = (1 << bits) - 1
    values = torch.empty(k // BLOCK_K, BLOCK_K, n, dtype=torch.int64, device=qweight.device)
    for i, word, shift, spill in _word_positions(bits):
        v = words[:, word] >> shift
        if spill:
            v = v | (words[:, word + 1] << (bits - spill))
        values[:, i] = v & mask
    return values.reshape(k, n).t().to(torch.int32).contiguous()
