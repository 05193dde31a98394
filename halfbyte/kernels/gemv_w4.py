"""4-bit weight-streaming GEMV for one fp16 row (batch-1 decode), dequantizing with fp16x2 bit tricks.

Why a separate kernel: at 4 bits the generic kernel (quant_gemv.py) spends ~5 integer/float
instructions per weight (shift, mask, or, subtract, FMA), more than the SMs issue while the
weights stream at full memory bandwidth. Here one `lop3` turns two nibbles of a word into two
fp16 values 1024 + q (or 1024 + 16q) at once, one f16x2 op makes them q - 8 exactly, and
(M = 1) f16x2 FMAs multiply them by x pairs: about 1.6 instructions per weight.

Meaning, per output n (the format of docs/format.md, bits = 4):
    y[n] = sum_g  s[g, n] * sum_{k in g} (q[n, k] - 8) * x[k]  +  (m[g, n] + 8 s[g, n]) * sum_{k in g} x[k]
which equals x @ dequant(W)^T. Centring q on 8 keeps the fp16 partial sums small; the 8
products of one word are summed in fp16 (4 per half) before fp32 (measured rel. error ~3e-4 vs
2e-4 for the fp16 output rounding alone). Several rows: gemm_w4.py (tensor cores).

The kernel is instruction-bound on large matrices (Nsight Compute: ~1 instruction per cycle per
scheduler; ~30 SASS instructions per word, bench/kernel_sass.py). pair_rows loads the even and odd
word rows of a tile as two tiles of one layout, so each thread holds both words of a column and
sums their 16 products in one f16x2 accumulator: one fp32 conversion, scale FMA and min FMA per
two words (~25 instructions per word; 70B gate_up 82.7 -> 67.5 us on the H200).

A word holds k = 8r .. 8r+7; value j sits in bits 4j..4j+3. The f16x2 trick pairs values
(0, 4), (1, 5), (2, 6), (3, 7): the x pairs are built the same way. Triton's interpreter (CI)
cannot run PTX, so USE_ASM=False computes the same sums with plain shifts; the GPU tests check
the PTX path. The reference is quant_matmul.quant_matmul_ref."""

from __future__ import annotations

import os

import torch

from halfbyte.kernels.cluster import cluster_wanted, has_clusters, partial_bytes, split_ids
from halfbyte.kernels.quant_gemv import _write_out, split_k_launch
from halfbyte.kernels.shared_memory import (commit_copies, copy_rows_async, launch_with_shared, load_shared, shared_tail,
                                            wait_copies)
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton

# q - 8 for the 8 nibbles of a word as 4 half2 registers: pairs (0,4) (1,5) (2,6) (3,7).
# BOTTOM nibbles (bits 0-3 of each half) -> 1024 + q, minus 1032; TOP (bits 4-7) -> 1024 + 16q,
# times 1/16 minus 72. lop3 0xea = (a & b) | c.
_DEQUANT_CONSTS = """
    mov.b32 m1032, 0x64086408;
    mov.b32 inv16, 0x2c002c00;
    mov.b32 m72, 0xd480d480;"""
_DEQUANT_WORD = """
    shr.u32 top, {w}, 8;
    lop3.b32 q04, {w}, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 q15, {w}, 0x00f000f0, 0x64006400, 0xea;
    lop3.b32 q26, top, 0x000f000f, 0x64006400, 0xea;
    lop3.b32 q37, top, 0x00f000f0, 0x64006400, 0xea;
    sub.f16x2 q04, q04, m1032;
    fma.rn.f16x2 q15, q15, inv16, m72;
    sub.f16x2 q26, q26, m1032;
    fma.rn.f16x2 q37, q37, inv16, m72;"""
_DEQUANT_PTX = _DEQUANT_CONSTS + _DEQUANT_WORD + "\n"


def _dot_asm(words: int) -> str:
    """PTX for $0 (fp32) = the sum over `words` words ($1 ..) of their 8 values (q - 8) times x,
    the x pairs of word i in the four operands after the words: all products in one f16x2
    accumulator, converted to fp32 once. The words of one call share a group (and its scale)."""
    lines = ["{", " .reg .b32 m1032, inv16, m72, top, q04, q15, q26, q37, acc;", " .reg .b16 lo, hi;",
             " .reg .f32 f0, f1;", _DEQUANT_CONSTS]
    for i in range(words):
        lines.append(_DEQUANT_WORD.format(w=f"${1 + i}"))
        for j, q in enumerate(("q04", "q15", "q26", "q37")):
            x = f"${1 + words + 4 * i + j}"
            lines.append(f"    mul.rn.f16x2 acc, {q}, {x};" if i == j == 0 else f"    fma.rn.f16x2 acc, {q}, {x}, acc;")
    lines += ["    mov.b32 {lo, hi}, acc;", "    cvt.f32.f16 f0, lo;", "    cvt.f32.f16 f1, hi;", "    add.f32 $0, f0, f1;", "}"]
    return "\n".join(lines)


_DOT8_ASM = _dot_asm(1)
# two words of one column (rows 2i and 2i + 1 share a group: groups are multiples of 16 values)
_DOT16_ASM = _dot_asm(2)

if HAS_TRITON:

    # jit functions read module globals only as constexprs
    DOT8_ASM = tl.constexpr(_DOT8_ASM)
    DOT16_ASM = tl.constexpr(_DOT16_ASM)

    @triton.jit
    def _nibble(uw, j: tl.constexpr):
        """Value j of each word as q - 8 in fp16 (exact): the plain-Triton twin of the PTX unpack."""
        return (((uw >> (4 * j)) & 15).to(tl.float32) - 8.0).to(tl.float16)

    @triton.jit
    def _x_pairs(x_ptr, w_row, row_ok):
        """fp16 x of words w_row as int32 half2 pairs (x0,x4) (x1,x5) (x2,x6) (x3,x7), and their fp32 sum."""
        xw = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_row * 4
        x01 = tl.load(xw, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
        x23 = tl.load(xw + 1, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
        x45 = tl.load(xw + 2, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
        x67 = tl.load(xw + 3, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
        lo = 0xFFFF
        hi = 0xFFFF0000
        p04 = ((x01 & lo) | (x45 << 16)).to(tl.int32, bitcast=True)
        p15 = ((x01 >> 16) | (x45 & hi)).to(tl.int32, bitcast=True)
        p26 = ((x23 & lo) | (x67 << 16)).to(tl.int32, bitcast=True)
        p37 = ((x23 >> 16) | (x67 & hi)).to(tl.int32, bitcast=True)
        xt = tl.load(x_ptr + (w_row * 8)[:, None] + tl.arange(0, 8)[None, :], mask=row_ok[:, None], other=0.0)
        xs = tl.sum(xt.to(tl.float32), axis=1)
        return p04, p15, p26, p37, xs

    @triton.jit
    def _one_group_scales(scales_ptr, mins_ptr, k0, N, rn, n_mask, GROUP: tl.constexpr, WIDEN: tl.constexpr):
        """Scales and mins [N] of the group holding k0: as loaded (fp16), or WIDEN: fp32 s and
        m + 8 s, each converted as it is loaded (the order the default path compiles best in)."""
        g = k0 // GROUP
        s = tl.load(scales_ptr + g * N + rn, mask=n_mask, other=0.0)
        if WIDEN:
            s = s.to(tl.float32)
        m = tl.load(mins_ptr + g * N + rn, mask=n_mask, other=0.0)
        if WIDEN:
            m = m.to(tl.float32) + 8.0 * s
        return s, m

    @triton.jit
    def _widen(s16, m16):
        """fp16 scales and mins -> fp32 s and m + 8 s."""
        s = s16.to(tl.float32)
        return s, m16.to(tl.float32) + 8.0 * s

    @triton.jit
    def _add_one_group(acc, dots, xs, s, m8):
        """acc + dots * s + xs * (m + 8 s) for a tile inside one group (s, m8 [N] from _one_group_scales)."""
        return acc + dots * s[None, :] + xs[:, None] * m8[None, :]

    @triton.jit
    def _group_scales(scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp16 scales and mins of a tile of whole groups, one row per group: [BLOCK_K / GROUP, N]."""
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        mask = (g * GROUP < k_end)[:, None] & n_mask[None, :]
        offs = (g * N)[:, None] + rn[None, :]
        return tl.load(scales_ptr + offs, mask=mask, other=0.0), tl.load(mins_ptr + offs, mask=mask, other=0.0)

    @triton.jit
    def _scaled_by_group(dots, xs, s16, m16, NG: tl.constexpr, BLOCK_N: tl.constexpr):
        """[NG, N] fp32: each group's sum of dots [rows, N] times its scale, plus its sum of xs
        [rows] times its m + 8 s; the rows of a group are consecutive."""
        R: tl.constexpr = dots.shape[0] // NG
        d = tl.sum(tl.reshape(dots, [NG, R, BLOCK_N]), axis=1)
        xg = tl.sum(tl.reshape(xs, [NG, R]), axis=1)
        s, m8 = _widen(s16, m16)
        return d * s + xg[:, None] * m8

    @triton.jit
    def _add_scaled(acc, dots, xs, w_row, row_ok, scales_ptr, mins_ptr, k0, N, rn, n_mask,
                    GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc + dots * s + xs * (m + 8 s): dots [rows, N] sums of (q - 8) x of word rows w_row (of
        their group), xs [rows] their sums of x."""
        if GROUP % BLOCK_K == 0:  # the whole tile is in one group: one scale row
            s, m8 = _one_group_scales(scales_ptr, mins_ptr, k0, N, rn, n_mask, GROUP, True)
            return _add_one_group(acc, dots, xs, s, m8)
        else:
            mask = row_ok[:, None] & n_mask[None, :]
            offs = ((w_row * 8) // GROUP * N)[:, None] + rn[None, :]
            s = tl.load(scales_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(mins_ptr + offs, mask=mask, other=0.0).to(tl.float32) + 8.0 * s
            return acc + dots * s + xs[:, None] * m

    @triton.jit
    def _add_preloaded(acc, dots, xs, s16, m16, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """_add_scaled with the fp16 scales and mins from _early_scales: [N] for a tile in one group;
        else [groups, N], and acc is still zero (one tile): the result is then [groups, N]."""
        if GROUP % BLOCK_K == 0:
            s, m8 = _widen(s16, m16)
            return _add_one_group(acc, dots, xs, s, m8)
        else:
            return _scaled_by_group(dots, xs, s16, m16, BLOCK_K // GROUP, BLOCK_N)

    @triton.jit
    def _m1_tile(acc, words, x_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                 GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
                 s16=None, m16=None):
        """acc [KW, N] fp32 += one tile's contribution: words [KW, N] hold k = k0 .. k0 + 8 KW.
        s16 / m16: the tile's _early_scales if already loaded (else loaded here, after the dots)."""
        BLOCK_K: tl.constexpr = BLOCK_KW * 8
        w_row = k0 // 8 + tl.arange(0, BLOCK_KW)
        row_ok = w_row * 8 < k_end
        p04, p15, p26, p37, xs = _x_pairs(x_ptr, w_row, row_ok)
        if USE_ASM:  # [KW, N] fp32: sum over each word's 8 values of (q - 8) * x
            dots = tl.inline_asm_elementwise(
                DOT8_ASM, "=r,r,r,r,r,r",
                [words, tl.broadcast_to(p04[:, None], [BLOCK_KW, BLOCK_N]),
                 tl.broadcast_to(p15[:, None], [BLOCK_KW, BLOCK_N]),
                 tl.broadcast_to(p26[:, None], [BLOCK_KW, BLOCK_N]),
                 tl.broadcast_to(p37[:, None], [BLOCK_KW, BLOCK_N])],
                dtype=tl.float32, is_pure=True, pack=1,
            )
        else:
            uw = words.to(tl.uint32, bitcast=True)
            dots = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_ptr + w_row * 8 + j, mask=row_ok, other=0.0).to(tl.float32)
                dots += _nibble(uw, j).to(tl.float32) * xj[:, None]
        if s16 is None:
            out = _add_scaled(acc, dots, xs, w_row, row_ok, scales_ptr, mins_ptr, k0, N, rn, n_mask, GROUP, BLOCK_K)
        else:
            out = _add_preloaded(acc, dots, xs, s16, m16, GROUP, BLOCK_K, BLOCK_N)
        return out

    @triton.jit
    def pair_asm(ASM: tl.constexpr, we, wo, e0, e1, e2, e3, o0, o1, o2, o3):
        """fp32 [KW/2, N] = ASM per element on an even and an odd word row (we, wo) and their
        rows' four 32-bit x operands each (e*, o* [KW/2], broadcast along N). gemv_w4_i8 shares it."""
        shape: tl.constexpr = we.shape
        return tl.inline_asm_elementwise(
            ASM, "=r,r,r,r,r,r,r,r,r,r,r",
            [we, wo, tl.broadcast_to(e0[:, None], shape), tl.broadcast_to(e1[:, None], shape),
             tl.broadcast_to(e2[:, None], shape), tl.broadcast_to(e3[:, None], shape),
             tl.broadcast_to(o0[:, None], shape), tl.broadcast_to(o1[:, None], shape),
             tl.broadcast_to(o2[:, None], shape), tl.broadcast_to(o3[:, None], shape)],
            dtype=tl.float32, is_pure=True, pack=1,
        )

    @triton.jit
    def _pair_x(x_ptr, row_e, k_end):
        """x of even word rows row_e and the odd rows after them as half2 pairs, and each row's x sum:
        (e04, e15, e26, e37, o04, o15, o26, o37, xs_e, xs_o)."""
        ok_e = row_e * 8 < k_end
        ok_o = row_e * 8 + 8 < k_end
        e04, e15, e26, e37, xs_e = _x_pairs(x_ptr, row_e, ok_e)
        o04, o15, o26, o37, xs_o = _x_pairs(x_ptr, row_e + 1, ok_o)
        return (e04, e15, e26, e37, o04, o15, o26, o37, xs_e, xs_o)

    @triton.jit
    def _pair_dots(we, wo, xp, x_ptr, row_e, k_end, HALF: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
        """[HALF, N] fp32: per column, the sum over an even and an odd word of (q - 8) x (xp: _pair_x)."""
        e04, e15, e26, e37, o04, o15, o26, o37, _, _ = xp
        if USE_ASM:
            dots = pair_asm(DOT16_ASM, we, wo, e04, e15, e26, e37, o04, o15, o26, o37)
        else:
            ue = we.to(tl.uint32, bitcast=True)
            uo = wo.to(tl.uint32, bitcast=True)
            dots = tl.zeros([HALF, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(8):
                xe = tl.load(x_ptr + row_e * 8 + j, mask=row_e * 8 < k_end, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + row_e * 8 + 8 + j, mask=row_e * 8 + 8 < k_end, other=0.0).to(tl.float32)
                dots += _nibble(ue, j).to(tl.float32) * xe[:, None] + _nibble(uo, j).to(tl.float32) * xo[:, None]
        return dots

    @triton.jit
    def _m1_tile_pairs(acc, we, wo, x_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                       GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
                       s16=None, m16=None):
        """acc [KW/2, N] fp32 += one tile's contribution, its even word rows in we, odd in wo: one
        fp32 conversion, scale FMA and min FMA per two words instead of per word."""
        HALF: tl.constexpr = BLOCK_KW // 2
        row_e = k0 // 8 + 2 * tl.arange(0, HALF)
        xp = _pair_x(x_ptr, row_e, k_end)
        dots = _pair_dots(we, wo, xp, x_ptr, row_e, k_end, HALF, BLOCK_N, USE_ASM)
        if s16 is None:
            out = _add_scaled(acc, dots, xp[8] + xp[9], row_e, row_e * 8 < k_end, scales_ptr, mins_ptr, k0, N, rn,
                              n_mask, GROUP, BLOCK_KW * 8)
        else:
            out = _add_preloaded(acc, dots, xp[8] + xp[9], s16, m16, GROUP, BLOCK_KW * 8, BLOCK_N)
        return out

    @triton.jit
    def _load_rows(qw_ptr, w_row, k_end, N, rn, n_mask):
        """Words of rows w_row x columns rn; rows at or past k_end (and columns past N) read 0, no traffic."""
        mask = (w_row * 8 < k_end)[:, None] & n_mask[None, :]
        return tl.load(qw_ptr + (w_row * N)[:, None] + rn[None, :], mask=mask, other=0)

    @triton.jit
    def _load_words(qw_ptr, k0, k_end, N, rn, n_mask, BLOCK_KW: tl.constexpr):
        """The tile of BLOCK_KW word rows from k0."""
        return _load_rows(qw_ptr, k0 // 8 + tl.arange(0, BLOCK_KW), k_end, N, rn, n_mask)

    @triton.jit
    def _early_scales(scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
        """A one-tile split's fp16 scales and mins in their compact form: [N] for a tile inside one
        group, else [groups, N] (the tile then holds whole groups: gemv_w4 checks)."""
        if GROUP % BLOCK_K == 0:
            return _one_group_scales(scales_ptr, mins_ptr, k0, N, rn, n_mask, GROUP, False)
        else:
            return _group_scales(scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask, GROUP, BLOCK_K)

    @triton.jit
    def _staged_scales(scales_ptr, mins_ptr, k0, w_row, k_end, N, rn, n_mask, GROUP: tl.constexpr, SUB_K: tl.constexpr):
        """fp16 scales and mins of the sub-tile at k0, its even rows w_row (a pair shares its group):
        one row [N] for a sub-tile inside one group (one past K reads the last group's: its dots are
        zero), else per row [rows, N] (the rows of a group read one row, L1-hot)."""
        if GROUP % SUB_K == 0:
            return _one_group_scales(scales_ptr, mins_ptr, tl.minimum(k0, k_end - 1), N, rn, n_mask, GROUP, False)
        else:
            mask = (w_row * 8 < k_end)[:, None] & n_mask[None, :]
            offs = ((w_row * 8) // GROUP * N)[:, None] + rn[None, :]
            return tl.load(scales_ptr + offs, mask=mask, other=0.0), tl.load(mins_ptr + offs, mask=mask, other=0.0)

    @triton.jit
    def _staged_tile(x_ptr, qw_ptr, scales_ptr, mins_ptr, k_start, k_end, N, rn, n_mask, pid_n,
                     GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                     USE_ASM: tl.constexpr, PDL: tl.constexpr, FROM_END: tl.constexpr):
        """acc [BLOCK_KW / STAGES / 2, N] of a one-tile split with paired rows, its tile as STAGES (2
        or 4) sub-tiles copied by cp.async into shared memory, one group each, with their scales,
        before the PDL wait; then each sub-tile's arithmetic as soon as its words landed. Why: ptxas
        puts all of a one-tile program's weight loads on one scoreboard, so its first dot waits for
        every word of the tile (offline SASS, 8B o 32 x 512): loads and arithmetic add up instead of
        overlapping. What a sub-tile needs besides its words is requested ahead (scales before the
        wait, x one sub-tile ahead): a request inside a sub-tile's block would be one more round trip
        in series. (A first sub-tile loaded into registers was requested after the copies: ptxas
        sinks such loads below them.) The interpreter loads the sub-tiles plainly."""
        tl.static_assert(STAGES == 2 or STAGES == 4, "staged one-tile GEMV: 2 or 4 sub-tiles")
        SKW: tl.constexpr = BLOCK_KW // STAGES
        HALF: tl.constexpr = SKW // 2
        SUB_K: tl.constexpr = SKW * 8
        SLOT: tl.constexpr = HALF * BLOCK_N * 4
        even = 2 * tl.arange(0, HALF)
        row0 = k_start // 8
        row_bytes = tl.arange(0, HALF) * (BLOCK_N * 4)
        if USE_ASM:
            base = shared_tail(FROM_END, pid_n)
            for h in tl.static_range(STAGES):
                for p in tl.static_range(2):  # even, odd rows
                    w_row = row0 + h * SKW + even + p
                    copy_rows_async(qw_ptr, w_row, w_row * 8 < k_end, N, pid_n * BLOCK_N, BLOCK_N,
                                    base + (2 * h + p) * SLOT + row_bytes)
                commit_copies(pid_n)
        sc0 = _staged_scales(scales_ptr, mins_ptr, k_start + 0 * SUB_K, row0 + even, k_end, N, rn, n_mask, GROUP, SUB_K)
        sc1 = _staged_scales(scales_ptr, mins_ptr, k_start + 1 * SUB_K, row0 + SKW + even, k_end, N, rn, n_mask, GROUP, SUB_K)
        sc2, sc3 = sc0, sc1
        if STAGES == 4:
            sc2 = _staged_scales(scales_ptr, mins_ptr, k_start + 2 * SUB_K, row0 + 2 * SKW + even, k_end, N, rn, n_mask, GROUP, SUB_K)
            sc3 = _staged_scales(scales_ptr, mins_ptr, k_start + 3 * SUB_K, row0 + 3 * SKW + even, k_end, N, rn, n_mask, GROUP, SUB_K)
        pdl_sync(PDL)
        xp = _pair_x(x_ptr, row0 + even, k_end)
        acc = tl.zeros([HALF, BLOCK_N], dtype=tl.float32)
        for h in tl.static_range(STAGES):
            sc = sc0 if h == 0 else sc1 if h == 1 else sc2 if h == 2 else sc3
            xq = xp
            if h + 1 < STAGES:  # the next sub-tile's x, requested before this one's arithmetic
                xq = _pair_x(x_ptr, row0 + (h + 1) * SKW + even, k_end)
            if USE_ASM:
                acc = wait_copies(STAGES - 1 - h, acc)
                elem = row_bytes[:, None] + (tl.arange(0, BLOCK_N) * 4)[None, :]
                we = load_shared(base + 2 * h * SLOT + elem)
                wo = load_shared(base + (2 * h + 1) * SLOT + elem)
            else:
                we = _load_rows(qw_ptr, row0 + h * SKW + even, k_end, N, rn, n_mask)
                wo = _load_rows(qw_ptr, row0 + h * SKW + even + 1, k_end, N, rn, n_mask)
            # each sub-tile's arithmetic in a block of its own: ptxas moves a cp.async wait up past
            # arithmetic in its block, not past a branch (offline SASS); past K it adds nothing
            if k_start + h * SUB_K < k_end:
                dots = _pair_dots(we, wo, xp, x_ptr, row0 + h * SKW + even, k_end, HALF, BLOCK_N, USE_ASM)
                s16, m16 = sc
                s, m8 = _widen(s16, m16)
                if GROUP % SUB_K == 0:
                    acc = _add_one_group(acc, dots, xp[8] + xp[9], s, m8)
                else:
                    acc = acc + dots * s + (xp[8] + xp[9])[:, None] * m8
            xp = xq
        return acc

    @triton.jit
    def _gemv_w4_m1_kernel(
        x_ptr, qw_ptr, scales_ptr, mins_ptr, out_ptr, partial_ptr, counter_ptr,
        N, K, k_per_split,
        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SPLIT_K: tl.constexpr,
        PAIR_ROWS: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr, DIAG: tl.constexpr,
        ONE_TILE: tl.constexpr = False, EARLY_SCALES: tl.constexpr = False, CLUSTER: tl.constexpr = False,
        STAGES: tl.constexpr = 1,
    ):
        BLOCK_K: tl.constexpr = BLOCK_KW * 8
        pid_n, pid_k = split_ids(CLUSTER, SPLIT_K)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        # The weights never change, so the first tile is read before waiting for the previous
        # kernel (PDL): its DRAM round trip overlaps that kernel's tail. Small matrices (8B qkv,
        # o) are one or two tiles per program, so most of their bytes move during the wait.
        # EARLY_SCALES (with ONE_TILE; HALFBYTE_GEMV_EARLY_SCALES=1, an experiment): the tile's scales
        # and mins are requested there too; otherwise ptxas issues them after the dots (offline SASS),
        # one more round trip per program after its words arrived.
        # ONE_TILE (k_per_split == BLOCK_K): no loop, so no registers hold a next tile in flight. Kept
        # as its own branch: the loop with its next-tile load switched off instead still keeps the tile
        # live (offline sm_90: 32 x 512 paired 128 -> 174 registers, 8 x 512 x 4 warps 78 -> 168).
        # STAGES > 1 (with ONE_TILE and PAIR_ROWS; the Hopper table, HALFBYTE_GEMV_STAGES): _staged_tile.
        if STAGES > 1:
            # the sub-tiles' buffer (_staged_bytes) before cluster_combine's partials, at the end
            FROM_END: tl.constexpr = (2 * STAGES * (BLOCK_KW // STAGES // 2) * BLOCK_N * 4
                                      + ((SPLIT_K - 1) * BLOCK_N * 4 + 16 if CLUSTER else 0))  # cluster.partial_bytes
            acc = _staged_tile(x_ptr, qw_ptr, scales_ptr, mins_ptr, k_start, k_end, N, rn, n_mask, pid_n, GROUP, BLOCK_KW,
                               BLOCK_N, STAGES, USE_ASM, PDL, FROM_END)
            seen = tl.zeros_like(acc).to(tl.int32)
        elif PAIR_ROWS:  # even and odd word rows as two tiles of one layout: a thread holds both
            even = 2 * tl.arange(0, BLOCK_KW // 2)
            we = _load_rows(qw_ptr, k_start // 8 + even, k_end, N, rn, n_mask)
            wo = _load_rows(qw_ptr, k_start // 8 + even + 1, k_end, N, rn, n_mask)
            s16, m16 = None, None  # the tile's scales: loaded after its dots unless EARLY_SCALES
            if ONE_TILE and EARLY_SCALES:
                s16, m16 = _early_scales(scales_ptr, mins_ptr, k_start, k_end, N, rn, n_mask, GROUP, BLOCK_K)
            pdl_sync(PDL)
            acc = tl.zeros([BLOCK_KW // 2, BLOCK_N], dtype=tl.float32)
            seen = tl.zeros([BLOCK_KW // 2, BLOCK_N], dtype=tl.int32)
            if ONE_TILE:
                if DIAG == 2:
                    seen ^= we ^ wo
                else:
                    acc = _m1_tile_pairs(acc, we, wo, x_ptr, scales_ptr, mins_ptr, k_start, k_end, N, rn, n_mask,
                                         GROUP, BLOCK_KW, BLOCK_N, USE_ASM, s16, m16)
            else:
                for k0 in range(k_start, k_end, BLOCK_K):
                    if DIAG == 2:  # loads only
                        seen ^= we ^ wo
                    else:
                        acc = _m1_tile_pairs(acc, we, wo, x_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                                             GROUP, BLOCK_KW, BLOCK_N, USE_ASM)
                    we = _load_rows(qw_ptr, (k0 + BLOCK_K) // 8 + even, k_end, N, rn, n_mask)
                    wo = _load_rows(qw_ptr, (k0 + BLOCK_K) // 8 + even + 1, k_end, N, rn, n_mask)
        else:
            words = _load_words(qw_ptr, k_start, k_end, N, rn, n_mask, BLOCK_KW)
            s16, m16 = None, None  # the tile's scales: loaded after its dots unless EARLY_SCALES
            if ONE_TILE and EARLY_SCALES:
                s16, m16 = _early_scales(scales_ptr, mins_ptr, k_start, k_end, N, rn, n_mask, GROUP, BLOCK_K)
            pdl_sync(PDL)
            acc = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
            seen = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.int32)
            if ONE_TILE:
                if DIAG == 2:
                    seen ^= words
                else:
                    acc = _m1_tile(acc, words, x_ptr, scales_ptr, mins_ptr, k_start, k_end, N, rn, n_mask,
                                   GROUP, BLOCK_KW, BLOCK_N, USE_ASM, s16, m16)
            else:
                for k0 in range(k_start, k_end, BLOCK_K):
                    if DIAG == 2:  # loads only
                        seen ^= words
                    else:
                        acc = _m1_tile(acc, words, x_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                                       GROUP, BLOCK_KW, BLOCK_N, USE_ASM)
                    # the next tile (past k_end fully masked: no traffic), requested after this one's
                    # reduction in program order; loading it at the top of the loop instead ran 70B qkv
                    # in 21.7 us instead of 16.2 (H200, BENCHMARKS.md)
                    words = _load_words(qw_ptr, k0 + BLOCK_K, k_end, N, rn, n_mask, BLOCK_KW)
        if DIAG == 2:
            acc += seen.to(tl.float32)
        total = tl.sum(acc, axis=0)[None, :]
        _write_out(total, out_ptr, partial_ptr, counter_ptr, tl.arange(0, 1), rn, 1, N, pid_n, pid_k, SPLIT_K, DIAG == 0,
                   CLUSTER)


# (N, K) -> (block_n, block_kw, split_k or None for about two waves, stages, warps, pair_rows):
# the H200 sweep's winners for Llama-3 8B / 70B shapes (bench/gemv.py --sweep, --sweep-b1, --pairs
# with PDL on; BENCHMARKS.md). Calls on different machines differ by up to ~15% for the same
# config, so only same-call comparisons count. Paired rows won, in one call, on 8B gate_up 26.4 ->
# 23.5 us, 8B down 14.6 -> 13.2, 70B o 15.4 -> 14.6, gate_up 82.7 -> 67.5, down 42.0 -> 37.0, and
# lost 0.3-0.9 us on the three others. 70B o and down win with split 8 (the table had None):
# 21.1 -> 14.5 and 41.5 -> 36.9 us in one later call.
_M1_TUNED: dict[tuple[int, int], tuple[int, int, int | None, int, int, bool]] = {
    (6144, 4096): (16, 256, 1, 2, 8, False),  # 8B qkv: no split (H100 8.4 -> 7.4 us; was 256 x 16, split 16)
    (4096, 4096): (32, 512, 1, 2, 8, True),  # 8B o: no split, one tile (H100 7.2 -> 5.7 us; was 64 x 64, split 16)
    (28672, 4096): (256, 16, 8, 4, 4, True),  # 8B gate_up
    (4096, 14336): (64, 64, 8, 2, 8, True),  # 8B down
    (10240, 8192): (512, 16, None, 2, 4, False),  # 70B qkv
    (8192, 8192): (64, 32, 8, 2, 4, True),  # 70B o
    (57344, 8192): (64, 64, None, 2, 8, True),  # 70B gate_up
    (8192, 28672): (64, 64, 8, 2, 8, True),  # 70B down
    # One rank's shards at tensor_parallel_size 2. 70B: judged by the shard's decode step on one
    # GPU (bench/tensor_parallel.py --shard-of 2; the chained bench's winners made the step 9.9 ms,
    # the whole model's configs 8.3, these two changes from those 8.2 each; 2026-12-05).
    (5120, 8192): (256, 16, None, 2, 4, False),  # 70B qkv / 2
    (8192, 4096): (64, 32, 8, 2, 4, True),  # 70B o / 2
    (28672, 8192): (64, 64, None, 2, 8, True),  # 70B gate_up / 2
    (8192, 14336): (64, 64, 4, 2, 8, True),  # 70B down / 2
    # 8B: the chained bench's winners (bench/gemv.py --shapes 8b.tp2.* --sweep-b1, us against the
    # untuned default), not yet judged in a decode step
    (3072, 4096): (64, 8, 16, 2, 4, False),  # 8B qkv / 2: 6.5 -> 6.3
    (4096, 2048): (256, 16, 16, 2, 4, False),  # 8B o / 2: 5.7 -> 4.7
    (14336, 4096): (64, 16, 8, 2, 4, False),  # 8B gate_up / 2: 20.2 -> 13.6
    (4096, 7168): (128, 32, 16, 2, 4, False),  # 8B down / 2: 10.2 -> 9.6
    # a 4-bit Llama-3 LM head (convert --head-bits 4): bench/gemv.py --sweep-b1 --pairs, H100, 134 -> 112 us
    (128256, 4096): (64, 32, 8, 2, 4, True),  # 8B head
}
# Hopper (sm_90+, compiled, not interpreted): entries that use its cluster launch or the staged
# one-tile path and beat the plain table there (H100, 2026-12-08, bench/gemv.py --stages /
# --sweep-cluster): the table's fields, then gemv_w4's stages and cluster (None: as without the entry).
# HALFBYTE_GEMV_HOPPER=0 keeps the plain table (A/B runs).
_M1_TUNED_HOPPER: dict[tuple[int, int], tuple[tuple[int, int, int | None, int, int, bool], int, bool | None]] = {
    (4096, 4096): ((16, 512, 1, 2, 8, True), 2, None),  # 8B o: tile in 2 staged sub-tiles, 5.86 -> 5.08 us
    (8192, 8192): ((32, 128, 2, 2, 8, True), 1, True),  # 70B o: split 2 combined in a cluster, 16.37 -> 14.58 us
}
_HOPPER_ENV = os.environ.get("HALFBYTE_GEMV_HOPPER", "1") != "0"
# HALFBYTE_GEMV_PAIRS=0 / 1 forces pair_rows off / on for every shape (A/B runs)
_PAIRS_ENV = os.environ.get("HALFBYTE_GEMV_PAIRS")
_ONE_TILE_ENV = os.environ.get("HALFBYTE_GEMV_ONE_TILE", "0") == "1"
_EARLY_SCALES_ENV = os.environ.get("HALFBYTE_GEMV_EARLY_SCALES", "0") == "1"


_STAGES_ENV = int(os.environ.get("HALFBYTE_GEMV_STAGES", "1"))


def _staged_bytes(stages: int, block_kw: int, block_n: int) -> int:
    """Shared memory for a staged one-tile program's sub-tiles (even and odd rows): the whole tile."""
    return 2 * stages * (block_kw // stages // 2) * block_n * 4


def _use_asm() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1"



def supports(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether gemv_w4 handles this call: one fp16 row (4-byte aligned: x is read as half2
    pairs), 4 bits, K in whole words. Several rows go to gemm_w4 (tensor cores)."""
    m, k = x.shape
    return bits == 4 and x.dtype == torch.float16 and m == 1 and k % 8 == 0 and x.data_ptr() % 4 == 0


def gemv_w4(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
    split_k: int | None = None, block_n: int | None = None, block_kw: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, pair_rows: bool | None = None,
    one_tile: bool | None = None, early_scales: bool | None = None, cluster: bool | None = None,
    stages: int | None = None, _diag: int = 0,
) -> torch.Tensor:
    """x [1, K] fp16 -> [1, N] fp16. pair_rows: reduce two word rows per fp32 conversion (block_kw even).
    one_tile: each program's split is one tile, compiled without the loop (None: where the split is
    one tile and there is no split, or HALFBYTE_GEMV_ONE_TILE=1 for any one-tile split).
    early_scales: with one_tile, request the tile's scales and mins before the PDL wait, with its
    words, one row per group (None: HALFBYTE_GEMV_EARLY_SCALES=1; an experiment, not yet timed;
    ignored unless the tile lies inside one group or holds whole groups).
    cluster: combine the K splits in a thread-block cluster (cluster.py; None: the Hopper table's
    choice, else HALFBYTE_SPLITK_CLUSTER=1; sm_90+, 2-8 splits, else the counter combine).
    stages: a one-tile paired split's tile as 2 or 4 sub-tiles staged through shared memory by
    cp.async, each dotted as it lands (None: the Hopper table's choice, else HALFBYTE_GEMV_STAGES,
    default 1; faster only for some tiles, BENCHMARKS.md 2026-12-08; ignored unless one_tile and pair_rows, a sub-tile's word pairs a power of two and
    inside one group or whole groups, N a multiple of 4 and the words 16-byte aligned).
    _diag (bench/gemv.py --diag only; the output is then wrong): 1 skips the split-K combine, 2 also
    the arithmetic (the same loads, XORed): what the combine and the math cost."""
    k = x.shape[1]
    assert supports(x, 4, group_size), (x.shape, x.dtype, group_size)
    n = qweight.shape[1]
    assert (k // 8) * n < 2**31, "word offsets are int32"
    tuned = _M1_TUNED.get((n, k))
    hopper = _M1_TUNED_HOPPER.get((n, k)) if _HOPPER_ENV and _use_asm() and has_clusters(x.device) else None
    if hopper is not None and block_n is None and block_kw is None and split_k is None:
        tuned = hopper[0]
        stages = hopper[1] if stages is None else stages
        cluster = hopper[2] if cluster is None else cluster
    if tuned is None:  # untuned shapes. Large: the chained bench's best single config over the four
        # 70B tp2 shards (within 7% of each one's best there; the 70B shard's decode step 9.5-9.6 ms
        # with it for all four, 10.2-10.3 with the earlier default, 70B o's winner)
        tuned = (64, 16, 16, 2, 4, False) if n * k >= 32 * 2**20 else (128, 64, None, 4, 4, False)
    block_n = block_n or tuned[0]
    block_kw = block_kw or tuned[1]
    split_k = split_k if split_k is not None else tuned[2]
    num_stages = num_stages or tuned[3]
    num_warps = num_warps or tuned[4]
    if pair_rows is None:
        pair_rows = (tuned[5] if _PAIRS_ENV is None else _PAIRS_ENV == "1") and block_kw % 2 == 0
    if pair_rows and block_kw % 2:
        raise ValueError(f"gemv_w4: pair_rows needs an even block_kw, got {block_kw}")
    x = x.contiguous()
    col_blocks = triton.cdiv(n, block_n)
    split_k, k_per_split, out, partial, counters = split_k_launch(x, n, block_kw * 8, col_blocks, split_k)
    fits = k_per_split == 8 * block_kw
    if one_tile and not fits:
        raise ValueError(f"gemv_w4: one_tile needs a split of one tile, got {k_per_split} k per split, block_kw {block_kw}")
    if one_tile is None:  # without a split the one-tile kernel won (H100, 8B o 7.2 -> 5.7 us, BENCHMARKS.md)
        one_tile = fits and (split_k == 1 or _ONE_TILE_ENV)
    tile_k = 8 * block_kw  # early scales need the tile inside one group or made of whole groups
    early = one_tile and (_EARLY_SCALES_ENV if early_scales is None else early_scales)
    early = early and (group_size % tile_k == 0 or tile_k % group_size == 0)
    stages = _STAGES_ENV if stages is None else stages
    half = block_kw // max(stages, 1) // 2
    sub_k = 8 * block_kw // max(stages, 1)
    stages = stages if (stages in (2, 4) and one_tile and pair_rows and block_kw % (2 * stages) == 0
                        and half & (half - 1) == 0 and (group_size % sub_k == 0 or sub_k % group_size == 0)
                        and n % 4 == 0 and qweight.data_ptr() % 16 == 0 and _diag != 2) else 1
    args = (x, qweight, scales, mins, out, partial, counters, n, k, k_per_split)
    consts = dict(GROUP=group_size, BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=split_k, PAIR_ROWS=pair_rows,
                  USE_ASM=_use_asm(), DIAG=_diag, ONE_TILE=one_tile, EARLY_SCALES=early, STAGES=stages,
                  num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device))
    clustered = cluster_wanted(x.device, split_k, cluster, block_n)
    if clustered or (stages > 1 and _use_asm()):  # shared memory of our own (and a cluster launch)
        extra = (_staged_bytes(stages, block_kw, block_n) if stages > 1 else 0) + (
            partial_bytes(split_k, 1, block_n) if clustered else 0)
        launch_with_shared(_gemv_w4_m1_kernel, (col_blocks, 1 if clustered else split_k, 1), extra, *args,
                           cluster=split_k if clustered else 1, CLUSTER=clustered, **consts)
    else:
        _gemv_w4_m1_kernel[(col_blocks, split_k)](*args, **consts)
    return out

