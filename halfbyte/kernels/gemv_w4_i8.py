"""4-bit GEMV for one row with x as two int8 planes: integer dot products (dp4a) instead of fp16x2.

Why: gemv_w4 is issue-bound on the mid-sized shapes (~25 SASS instructions per 32-bit word of 8
weights; BENCHMARKS.md). With x as integers, a word's 8 products are two `dp4a` per plane: the
nibbles need one AND (even values) and a shift + AND (odd values), no conversion to fp16 at all,
and the sums stay exact integers until one fp32 conversion per two words. About 8.5 instructions
per word in the core instead of ~16.

x's planes (quantize_x, once per x, shared by every program): per group of G values (the weight
group), a power-of-two scale sx >= max|x| / 63, then per value
    a = round(x / sx) in [-63, 63],   b = round((x / sx - a) * 254) in [-127, 127],
so x ~= sx / 254 * (254 a + b) to ~15 bits (fp16 x has 11): the error is below the fp16 output's
rounding. a's range is 63 (not 127) so that 254 * sum(q a) + sum(q b) over two words stays below
2^22 and becomes fp32 by the magic-number trick (integer add, exact float subtract).

A word holds k = 8r .. 8r+7, value j in bits 4j..4j+3; `w & 0x0f0f0f0f` has values 0, 2, 4, 6 as
bytes, `(w >> 4) & 0x0f0f0f0f` values 1, 3, 5, 7. So each word row of x is 4 int32: a of the even
values, a of the odd, b of the even, b of the odd (byte i = value 2i or 2i + 1).

Meaning, per output n (format: docs/format.md; w = s q + m):
    y[n] = sum_g  s[g, n] * sx_g / 254 * sum_{k in g} q[n, k] (254 a_k + b_k)  +  m[g, n] * sum_{k in g} xd_k
with xd the dequantized x, i.e. exactly dequant(W) @ xd in exact integers and fp32. The reference
is quant_matmul_ref applied to dequantize_x(quantize_x(x)); against plain x the difference is
x's quantization (~1e-5 relative)."""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import torch

from halfbyte.kernels.gemv_w4 import _load_rows, _use_asm, pair_asm
from halfbyte.kernels.quant_gemv import _write_out, split_k_launch
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton

A_MAX = 63
B_SCALE = 254
_MAGIC = 0x4B400000  # float bits of 1.5 * 2^23: + i (|i| < 2^22) is the float 1.5 * 2^23 + i
_MAGIC_F = f"0f{_MAGIC:08X}"
# fp32 constants both sides multiply by (a product rounds the same in torch and Triton; a quotient may not)
_INV_A_MAX = struct.unpack("<f", struct.pack("<f", 1.0 / A_MAX))[0]
_INV_B = struct.unpack("<f", struct.pack("<f", 1.0 / B_SCALE))[0]


class XPlanes(NamedTuple):
    """x [1, K] quantized for gemv_w4_i8: planes int32 [K/8, 4], scales fp32 [K/G] (powers of
    two), row_sums fp32 [K/8] (sum of the 8 dequantized values of each word row)."""

    planes: torch.Tensor
    scales: torch.Tensor
    row_sums: torch.Tensor
    group_size: int


def _pack_bytes(v: torch.Tensor) -> torch.Tensor:
    """int [..., 4] in [-128, 127] -> int32 [...] with v[..., i] as byte i."""
    b = (v.to(torch.int64) & 255) << (8 * torch.arange(4, device=v.device))
    packed = b.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize_x_ref(x: torch.Tensor, group_size: int) -> XPlanes:
    """The torch reference of quantize_x (fp32 throughout, the kernel's exact steps)."""
    m, k = x.shape
    assert m == 1 and k % group_size == 0 and group_size % 16 == 0, (x.shape, group_size)
    xg = x.float().reshape(k // group_size, group_size)
    t = xg.abs().amax(1) * torch.tensor(_INV_A_MAX, dtype=torch.float32)
    sx_bits = (t.view(torch.int32) + 0x7FFFFF) & 0x7F800000  # round up to a power of two
    sx = sx_bits.view(torch.float32)
    inv = (0x7F000000 - sx_bits).view(torch.float32)
    v = xg * inv[:, None]
    a = torch.floor(v + 0.5)
    b = torch.floor((v - a) * B_SCALE + 0.5)
    xd = (a * B_SCALE + b) * (sx * torch.tensor(_INV_B, dtype=torch.float32))[:, None]
    rows = k // 8
    a8, b8 = a.reshape(rows, 4, 2), b.reshape(rows, 4, 2)
    planes = torch.stack([_pack_bytes(a8[..., 0]), _pack_bytes(a8[..., 1]), _pack_bytes(b8[..., 0]),
                          _pack_bytes(b8[..., 1])], dim=1)
    return XPlanes(planes, sx, xd.reshape(rows, 8).sum(1), group_size)


def dequantize_x(xp: XPlanes) -> torch.Tensor:
    """The fp32 x [1, K] that the planes stand for."""
    p = xp.planes.to(torch.int64)
    byte = lambda w, i: ((w >> (8 * i)) & 255).to(torch.int64)  # noqa: E731
    signed = lambda v: torch.where(v >= 128, v - 256, v)  # noqa: E731
    rows = p.shape[0]
    a = torch.empty(rows, 8, dtype=torch.int64, device=p.device)
    b = torch.empty_like(a)
    for i in range(4):
        a[:, 2 * i], a[:, 2 * i + 1] = signed(byte(p[:, 0], i)), signed(byte(p[:, 1], i))
        b[:, 2 * i], b[:, 2 * i + 1] = signed(byte(p[:, 2], i)), signed(byte(p[:, 3], i))
    g = xp.group_size
    scale = (xp.scales * torch.tensor(_INV_B, dtype=torch.float32)).repeat_interleave(g)
    return ((a * B_SCALE + b).reshape(-1).float() * scale)[None, :]


# PTX: $0 (fp32) = 254 * sum(q a) + sum(q b) over two words ($1, $2) and their x planes ($3-$6 for
# $1, $7-$10 for $2). Exact: |254 sum(q a) + sum(q b)| <= 254 * 16 * 15 * 63 + 16 * 15 * 127 < 2^22.
_DOT16_I8_ASM = f"""{{
 .reg .b32 lo0, hi0, lo1, hi1, ia, ib, t;
 .reg .f32 f;
 and.b32 lo0, $1, 0x0f0f0f0f;
 shr.u32 hi0, $1, 4;
 and.b32 hi0, hi0, 0x0f0f0f0f;
 and.b32 lo1, $2, 0x0f0f0f0f;
 shr.u32 hi1, $2, 4;
 and.b32 hi1, hi1, 0x0f0f0f0f;
 dp4a.u32.s32 ia, lo0, $3, 0;
 dp4a.u32.s32 ia, hi0, $4, ia;
 dp4a.u32.s32 ia, lo1, $7, ia;
 dp4a.u32.s32 ia, hi1, $8, ia;
 dp4a.u32.s32 ib, lo0, $5, {_MAGIC};
 dp4a.u32.s32 ib, hi0, $6, ib;
 dp4a.u32.s32 ib, lo1, $9, ib;
 dp4a.u32.s32 ib, hi1, $10, ib;
 mad.lo.s32 t, ia, {B_SCALE}, ib;
 mov.b32 f, t;
 sub.f32 $0, f, {_MAGIC_F};
}}"""

if HAS_TRITON:
    # jit functions read module globals only as constexprs
    DOT16_I8_ASM = tl.constexpr(_DOT16_I8_ASM)
    INV_A_MAX = tl.constexpr(_INV_A_MAX)
    BS = tl.constexpr(B_SCALE)
    INV_B = tl.constexpr(_INV_B)
    LD_V4_ASM = tl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")

    @triton.jit
    def store_planes(x, first_group, n_groups, planes_ptr, scales_ptr, row_sums_ptr,
                     NG: tl.constexpr, ROWS: tl.constexpr):
        """x fp32 [NG, ROWS, 8] = groups first_group .. first_group + NG - 1 of x, quantized and stored
        as quantize_x_ref does, bit for bit (groups from n_groups on are not stored). Shared by
        quantize_x and the producers that write the planes beside their output (rms_norm)."""
        t = tl.max(tl.max(tl.abs(x), axis=2), axis=1) * INV_A_MAX
        sx_bits = (t.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000  # round up to a power of two
        sx = sx_bits.to(tl.float32, bitcast=True)
        inv = (0x7F000000 - sx_bits).to(tl.float32, bitcast=True)
        v = x * inv[:, None, None]
        a = tl.floor(v + 0.5)
        b = tl.floor((v - a) * BS + 0.5)
        xd = (a * BS + b) * (sx * INV_B)[:, None, None]
        groups = first_group + tl.arange(0, NG)
        ok = groups < n_groups
        rows = groups[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
        tl.store(row_sums_ptr + rows, tl.sum(xd, axis=2), mask=ok[:, None])
        shifts = (tl.arange(0, 4) * 8)[None, None, :]
        a_even, a_odd = tl.split(tl.reshape(a.to(tl.int32) & 255, [NG, ROWS, 4, 2]))
        b_even, b_odd = tl.split(tl.reshape(b.to(tl.int32) & 255, [NG, ROWS, 4, 2]))
        tl.store(planes_ptr + rows * 4, tl.sum(a_even << shifts, axis=2), mask=ok[:, None])
        tl.store(planes_ptr + rows * 4 + 1, tl.sum(a_odd << shifts, axis=2), mask=ok[:, None])
        tl.store(planes_ptr + rows * 4 + 2, tl.sum(b_even << shifts, axis=2), mask=ok[:, None])
        tl.store(planes_ptr + rows * 4 + 3, tl.sum(b_odd << shifts, axis=2), mask=ok[:, None])
        tl.store(scales_ptr + groups, sx, mask=ok)

    @triton.jit
    def _quantize_x_kernel(x_ptr, planes_ptr, scales_ptr, row_sums_ptr, GROUP: tl.constexpr, PDL: tl.constexpr):
        """One program per group of x."""
        pdl_sync(PDL)
        g = tl.program_id(0)
        ROWS: tl.constexpr = GROUP // 8
        offs = g * GROUP + tl.arange(0, ROWS)[:, None] * 8 + tl.arange(0, 8)[None, :]
        x = tl.load(x_ptr + offs[None, :, :]).to(tl.float32)
        store_planes(x, g, g + 1, planes_ptr, scales_ptr, row_sums_ptr, 1, ROWS)

    @triton.jit
    def _signed_byte(p, i: tl.constexpr):
        return (p << (24 - 8 * i)) >> 24

    @triton.jit
    def _dot16_plain(we, wo, e0, e1, e2, e3, o0, o1, o2, o3):
        """The PTX's sums with shifts and integer multiplies (Triton's interpreter runs no PTX)."""
        ia = tl.zeros(we.shape, dtype=tl.int32)
        ib = tl.zeros(we.shape, dtype=tl.int32)
        for i in tl.static_range(4):
            qe0 = (we >> (8 * i)) & 15
            qe1 = (we >> (8 * i + 4)) & 15
            qo0 = (wo >> (8 * i)) & 15
            qo1 = (wo >> (8 * i + 4)) & 15
            ia += qe0 * _signed_byte(e0, i)[:, None] + qe1 * _signed_byte(e1, i)[:, None]
            ia += qo0 * _signed_byte(o0, i)[:, None] + qo1 * _signed_byte(o1, i)[:, None]
            ib += qe0 * _signed_byte(e2, i)[:, None] + qe1 * _signed_byte(e3, i)[:, None]
            ib += qo0 * _signed_byte(o2, i)[:, None] + qo1 * _signed_byte(o3, i)[:, None]
        return (ia * BS + ib).to(tl.float32)

    @triton.jit
    def _row_planes(p, ok, USE_ASM: tl.constexpr):
        """The four int32 planes of the word rows at p; where not ok 0, or with USE_ASM whatever p
        holds (those rows meet zero weights)."""
        if USE_ASM:  # one 16-byte load per row
            return tl.inline_asm_elementwise(LD_V4_ASM, "=r,=r,=r,=r,l", [p], dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        else:
            return (tl.load(p, mask=ok, other=0), tl.load(p + 1, mask=ok, other=0), tl.load(p + 2, mask=ok, other=0),
                    tl.load(p + 3, mask=ok, other=0))

    @triton.jit
    def _pair_tile(acc, we, wo, planes_ptr, xs_ptr, xrow_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                   GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
        """acc [KW/2, N] += one tile: even word rows in we, odd in wo."""
        HALF: tl.constexpr = BLOCK_KW // 2
        row_e = k0 // 8 + 2 * tl.arange(0, HALF)
        # a pair never straddles k_end (K and k_per_split are multiples of 16), so one mask serves both rows
        ok = row_e * 8 < k_end
        pe = planes_ptr + tl.where(ok, row_e, 0) * 4  # rows past k_end read row 0's planes (in bounds)
        e0, e1, e2, e3 = _row_planes(pe, ok, USE_ASM)
        o0, o1, o2, o3 = _row_planes(pe + 4, ok, USE_ASM)
        rsum = tl.load(xrow_ptr + row_e, mask=ok, other=0.0) + tl.load(xrow_ptr + row_e + 1, mask=ok, other=0.0)
        if USE_ASM:
            dots = pair_asm(DOT16_I8_ASM, we, wo, e0, e1, e2, e3, o0, o1, o2, o3)
        else:
            dots = _dot16_plain(we, wo, e0, e1, e2, e3, o0, o1, o2, o3)
        if GROUP % (BLOCK_KW * 8) == 0:  # the tile is inside one group: one scale row
            g = k0 // GROUP
            sxg = tl.load(xs_ptr + g) * INV_B
            s = tl.load(scales_ptr + g * N + rn, mask=n_mask, other=0.0).to(tl.float32) * sxg
            m = tl.load(mins_ptr + g * N + rn, mask=n_mask, other=0.0).to(tl.float32)
            return acc + dots * s[None, :] + rsum[:, None] * m[None, :]
        else:  # a pair of rows is inside one group (GROUP % 16 == 0)
            g_row = (row_e * 8) // GROUP
            mask = ok[:, None] & n_mask[None, :]
            offs = (g_row * N)[:, None] + rn[None, :]
            sx_row = tl.load(xs_ptr + g_row, mask=ok, other=0.0) * INV_B
            s = tl.load(scales_ptr + offs, mask=mask, other=0.0).to(tl.float32) * sx_row[:, None]
            m = tl.load(mins_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            return acc + dots * s + rsum[:, None] * m

    @triton.jit
    def _gemv_w4_i8_kernel(
        planes_ptr, xs_ptr, xrow_ptr, qw_ptr, scales_ptr, mins_ptr, out_ptr, partial_ptr, counter_ptr,
        N, K, k_per_split,
        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_ASM: tl.constexpr, PDL: tl.constexpr,
    ):
        BLOCK_K: tl.constexpr = BLOCK_KW * 8
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        even = 2 * tl.arange(0, BLOCK_KW // 2)
        # the weights never change: the first tile is requested before waiting for x's producer
        we = _load_rows(qw_ptr, k_start // 8 + even, k_end, N, rn, n_mask)
        wo = _load_rows(qw_ptr, k_start // 8 + even + 1, k_end, N, rn, n_mask)
        pdl_sync(PDL)
        acc = tl.zeros([BLOCK_KW // 2, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc = _pair_tile(acc, we, wo, planes_ptr, xs_ptr, xrow_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                             GROUP, BLOCK_KW, BLOCK_N, USE_ASM)
            we = _load_rows(qw_ptr, (k0 + BLOCK_K) // 8 + even, k_end, N, rn, n_mask)
            wo = _load_rows(qw_ptr, (k0 + BLOCK_K) // 8 + even + 1, k_end, N, rn, n_mask)
        total = tl.sum(acc, axis=0)[None, :]
        _write_out(total, out_ptr, partial_ptr, counter_ptr, tl.arange(0, 1), rn, 1, N, pid_n, pid_k, SPLIT_K)


# (N, K) -> (block_n, block_kw, split_k or None for about two waves, warps): the shapes where
# gemv_w4_i8 beat gemv_w4 in one call (bench/gemv_i8.py, H100, thirteenth session, BENCHMARKS.md)
# and whose input a producer writes as planes (the RMSNorm before qkv and gate_up). 70B qkv lost
# there (19.3 vs 18.5 us); o and down have no producer of planes yet.
_TUNED: dict[tuple[int, int], tuple[int, int, int | None, int]] = {
    (6144, 4096): (16, 128, 1, 8),  # 8B qkv: 9.1 -> 8.4 us (split 16) -> 6.9 (no split; H100 8B decode +2-6%)
    (28672, 4096): (64, 64, None, 8),  # 8B gate_up: 28.8 -> 23.6 us
    (57344, 8192): (64, 32, None, 4),  # 70B gate_up: 88.0 -> 86.2 us
}
# The model uses this kernel for the shapes above (HALFBYTE_W4_I8=1, the default), for every shape
# it supports with =all (untuned ones take block 128 x 16, auto split, 4 warps), never with =0.
# In the 8B decode step (CUDA graph, the norm writing the planes in column chunks) it gained 363 ->
# 390 tokens/s on the H200 (sixteenth session); on H100s it measured +1.5% and -2% (fifteenth and
# sixteenth sessions, BENCHMARKS.md).
_ENV = os.environ.get("HALFBYTE_W4_I8", "1")


def config_for(n: int, k: int) -> dict[str, Any] | None:
    """The launch config the model uses for an [N, K] weight, or None where gemv_w4 is preferred."""
    tuned = _TUNED.get((n, k))
    if _ENV == "0" or (tuned is None and _ENV != "all"):
        return None
    block_n, block_kw, split_k, warps = tuned or (128, 16, None, 4)
    return dict(block_n=block_n, block_kw=block_kw, split_k=split_k, num_warps=warps)


def supports(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """One fp16 row, 4 bits, K in whole groups, groups of whole word pairs and a power of two (the
    producers write whole groups per program)."""
    m, k = x.shape
    return (bits == 4 and x.dtype == torch.float16 and m == 1 and group_size % 16 == 0 and k % group_size == 0
            and group_size & (group_size - 1) == 0)


def empty_planes(k: int, group_size: int, device: torch.device) -> XPlanes:
    """Uninitialised planes for x [1, K], for a kernel to write."""
    return XPlanes(torch.empty(k // 8, 4, dtype=torch.int32, device=device),
                   torch.empty(k // group_size, dtype=torch.float32, device=device),
                   torch.empty(k // 8, dtype=torch.float32, device=device), group_size)


def quantize_x(x: torch.Tensor, group_size: int) -> XPlanes:
    """x [1, K] fp16 -> its int8 planes (one launch, one program per group)."""
    k = x.shape[1]
    assert supports(x, 4, group_size), (x.shape, x.dtype, group_size)
    xp = empty_planes(k, group_size, x.device)
    _quantize_x_kernel[(k // group_size,)](x.contiguous(), xp.planes, xp.scales, xp.row_sums, GROUP=group_size,
                                          num_warps=1, **pdl_args(x.device))
    return xp


def gemv_w4_i8_planes(
    xp: XPlanes, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
    split_k: int | None = None, block_n: int = 128, block_kw: int = 16, num_warps: int = 4, num_stages: int = 2,
) -> torch.Tensor:
    """The GEMV on x's planes -> [1, N] fp16."""
    if block_kw % 2:
        raise ValueError(f"gemv_w4_i8: block_kw must be even, got {block_kw}")
    k = xp.planes.shape[0] * 8
    n = qweight.shape[1]
    assert qweight.shape[0] * 8 == k and (k // 8) * n < 2**31, (qweight.shape, k)
    col_blocks = triton.cdiv(n, block_n)
    shape_of_x = torch.empty_strided((1, k), (0, 0), dtype=torch.float16, device=qweight.device)  # one element
    split_k, k_per_split, out, partial, counters = split_k_launch(shape_of_x, n, block_kw * 8, col_blocks, split_k)
    _gemv_w4_i8_kernel[(col_blocks, split_k)](
        xp.planes, xp.scales, xp.row_sums, qweight, scales, mins, out, partial, counters, n, k, k_per_split,
        GROUP=xp.group_size, BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=split_k, USE_ASM=_use_asm(),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(qweight.device),
    )
    return out


def gemv_w4_i8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               **cfg: int) -> torch.Tensor:
    """x [1, K] fp16 -> [1, N] fp16: quantize_x, then the integer GEMV (two launches)."""
    return gemv_w4_i8_planes(quantize_x(x, group_size), qweight, scales, mins, **cfg)
