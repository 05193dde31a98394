"""2-bit weight-streaming GEMV for one fp16 row (batch-1 decode of the ~2.5 bpw mixes), dequantizing
with fp16x2 bit tricks, as gemv_w4 does for 4 bits.

Why a separate kernel: the generic kernel (quant_gemv.py) spends ~5 instructions per weight
(shift, mask, or, subtract, FMA) and loads x once per value; at 2 bits a word holds 16 weights,
so a 70B 2-bit matrix costs it about twice as much issue time as its bytes take to stream (2026-12,
offline count, not yet timed). Here one `lop3` per two values makes fp16 1024 + 4^j q of a pair
(q_j, q_j+8) that sit at the same place in the word's two halves, one f16x2 op makes them q - 2
exactly, and one f16x2 FMA multiplies them by x's pair (x_j, x_j+8): ~2.1 instructions per weight,
the 16 products of a word summed in fp16 (8 per half, |q - 2| <= 2) before fp32.

Meaning, per output n (docs/format.md, bits = 2: word r holds k = 16r .. 16r+15, value j in
bits 2j, 2j+1):
    y[n] = sum_g  s[g, n] * sum_{k in g} (q[n, k] - 2) * x[k]  +  (m[g, n] + 2 s[g, n]) * sum_{k in g} x[k]
which equals x @ dequant(W)^T. Groups hold whole words (16 values). USE_ASM=False (Triton's
interpreter, CI) computes the same sums with plain shifts; the GPU tests check the PTX path.
The reference is quant_matmul.quant_matmul_ref. Opt-in (HALFBYTE_GEMV_W2=1) until timed."""

from __future__ import annotations

import os

import torch

from halfbyte.kernels.quant_gemv import _write_out, split_k_launch
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton

VALS = 16  # 2-bit values per 32-bit word


def _dot_asm() -> str:
    """PTX for $0 (fp32) = the sum over one word's ($1) 16 values of (q - 2) times x, x's pairs
    (x_j, x_j+8) for j = 0..7 in $2..$9. Pair j comes from bits 2j of each half (j < 4: the word;
    j >= 4: the word >> 8), masked into fp16 1024 + 4^(j%4) q, then scaled back to q - 2."""
    # (mask, multiplier, addend) per j % 4: (1024 + 4^i q) * 4^-i - (1024 * 4^-i + 2) = q - 2, exact
    steps = [("0x00030003", None, "0x64026402"),  # - 1026
             ("0x000c000c", "0x34003400", "0xdc08dc08"),  # * 1/4 - 258
             ("0x00300030", "0x2c002c00", "0xd420d420"),  # * 1/16 - 66
             ("0x00c000c0", "0x24002400", "0xcc80cc80")]  # * 1/64 - 18
    # f16x2 operands must be registers: the six constants first
    consts = {"a0": steps[0][2], "m1": steps[1][1], "a1": steps[1][2], "m2": steps[2][1], "a2": steps[2][2],
              "m3": steps[3][1], "a3": steps[3][2]}
    lines = ["{", " .reg .b32 hi8, q, acc, " + ", ".join(consts) + ";", " .reg .b16 lo, hi;", " .reg .f32 f0, f1;"]
    lines += [f" mov.b32 {r}, {v};" for r, v in consts.items()]
    lines.append(" shr.u32 hi8, $1, 8;")
    for j in range(8):
        i = j % 4
        src = "$1" if j < 4 else "hi8"
        lines.append(f" lop3.b32 q, {src}, {steps[i][0]}, 0x64006400, 0xea;")
        lines.append(" sub.f16x2 q, q, a0;" if i == 0 else f" fma.rn.f16x2 q, q, m{i}, a{i};")
        lines.append(f" mul.rn.f16x2 acc, q, ${2 + j};" if j == 0 else f" fma.rn.f16x2 acc, q, ${2 + j}, acc;")
    lines += [" mov.b32 {lo, hi}, acc;", " cvt.f32.f16 f0, lo;", " cvt.f32.f16 f1, hi;", " add.f32 $0, f0, f1;", "}"]
    return "\n".join(lines)


_DOT_ASM = _dot_asm()

if HAS_TRITON:

    DOT_ASM = tl.constexpr(_DOT_ASM)
    _VALS = tl.constexpr(VALS)  # jit functions read module globals only as constexprs

    @triton.jit
    def _two_pairs(xw, i: tl.constexpr, row_ok):
        """From x (2i, 2i+1) and (2i+8, 2i+9) of each row (int32 half2 at xw + i, xw + 4 + i): the
        pairs (x_2i, x_2i+8) and (x_2i+1, x_2i+9)."""
        a = tl.load(xw + i, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
        b = tl.load(xw + 4 + i, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
        even = ((a & 0xFFFF) | (b << 16)).to(tl.int32, bitcast=True)
        odd = ((a >> 16) | (b & 0xFFFF0000)).to(tl.int32, bitcast=True)
        return even, odd

    @triton.jit
    def _w2_tile(acc, words, x_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                 GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
        """acc [KW, N] fp32 += one tile's contribution: words [KW, N] hold k = k0 .. k0 + 16 KW."""
        w_row = k0 // _VALS + tl.arange(0, BLOCK_KW)
        row_ok = w_row * _VALS < k_end
        xt = tl.load(x_ptr + (w_row * _VALS)[:, None] + tl.arange(0, _VALS)[None, :], mask=row_ok[:, None], other=0.0)
        xs = tl.sum(xt.to(tl.float32), axis=1)  # [KW]
        shape: tl.constexpr = [BLOCK_KW, BLOCK_N]
        if USE_ASM:  # [KW, N] fp32: sum over each word's 16 values of (q - 2) * x
            xw = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + w_row * 8
            p0, p1 = _two_pairs(xw, 0, row_ok)
            p2, p3 = _two_pairs(xw, 1, row_ok)
            p4, p5 = _two_pairs(xw, 2, row_ok)
            p6, p7 = _two_pairs(xw, 3, row_ok)
            dots = tl.inline_asm_elementwise(
                DOT_ASM, "=r,r,r,r,r,r,r,r,r,r",
                [words, tl.broadcast_to(p0[:, None], shape), tl.broadcast_to(p1[:, None], shape),
                 tl.broadcast_to(p2[:, None], shape), tl.broadcast_to(p3[:, None], shape),
                 tl.broadcast_to(p4[:, None], shape), tl.broadcast_to(p5[:, None], shape),
                 tl.broadcast_to(p6[:, None], shape), tl.broadcast_to(p7[:, None], shape)],
                dtype=tl.float32, is_pure=True, pack=1,
            )
        else:
            uw = words.to(tl.uint32, bitcast=True)
            dots = tl.zeros(shape, dtype=tl.float32)
            for j in tl.static_range(_VALS):
                xj = tl.load(x_ptr + w_row * _VALS + j, mask=row_ok, other=0.0).to(tl.float32)
                dots += (((uw >> (2 * j)) & 3).to(tl.float32) - 2.0) * xj[:, None]
        mask = row_ok[:, None] & n_mask[None, :]
        offs = ((w_row * _VALS) // GROUP * N)[:, None] + rn[None, :]
        s = tl.load(scales_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(mins_ptr + offs, mask=mask, other=0.0).to(tl.float32) + 2.0 * s
        return acc + dots * s + xs[:, None] * m

    @triton.jit
    def _load_tile(qw_ptr, k0, k_end, N, rn, n_mask, BLOCK_KW: tl.constexpr):
        """BLOCK_KW word rows from k0; rows at or past k_end (and columns past N) read 0, no traffic."""
        w_row = k0 // _VALS + tl.arange(0, BLOCK_KW)
        mask = (w_row * _VALS < k_end)[:, None] & n_mask[None, :]
        return tl.load(qw_ptr + (w_row * N)[:, None] + rn[None, :], mask=mask, other=0)

    @triton.jit
    def _gemv_w2_kernel(
        x_ptr, qw_ptr, scales_ptr, mins_ptr, out_ptr, partial_ptr, counter_ptr, N, K, k_per_split,
        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_ASM: tl.constexpr, PDL: tl.constexpr,
    ):
        BLOCK_K: tl.constexpr = BLOCK_KW * _VALS
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        # weights never change: the first tile is requested before waiting for the previous kernel
        words = _load_tile(qw_ptr, k_start, k_end, N, rn, n_mask, BLOCK_KW)
        pdl_sync(PDL)
        acc = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc = _w2_tile(acc, words, x_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                           GROUP, BLOCK_KW, BLOCK_N, USE_ASM)
            words = _load_tile(qw_ptr, k0 + BLOCK_K, k_end, N, rn, n_mask, BLOCK_KW)  # past k_end: no traffic
        total = tl.sum(acc, axis=0)[None, :]
        _write_out(total, out_ptr, partial_ptr, counter_ptr, tl.arange(0, 1), rn, 1, N, pid_n, pid_k, SPLIT_K)


def enabled() -> bool:
    """HALFBYTE_GEMV_W2=1: quant_matmul sends one-row 2-bit calls here (opt-in until timed)."""
    return os.environ.get("HALFBYTE_GEMV_W2", "0") == "1"


def supports(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """One fp16 row (4-byte aligned: x is read as half2 pairs), 2 bits, K in whole words, groups
    of whole words."""
    m, k = x.shape
    return (bits == 2 and x.dtype == torch.float16 and m == 1 and k % VALS == 0 and group_size % VALS == 0
            and x.data_ptr() % 4 == 0)


def gemv_w2(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
    split_k: int | None = None, block_n: int = 128, block_kw: int = 16, num_warps: int = 4, num_stages: int = 2,
) -> torch.Tensor:
    """x [1, K] fp16 -> [1, N] fp16 (split_k None: about two waves of programs)."""
    k = x.shape[1]
    assert supports(x, 2, group_size), (x.shape, x.dtype, group_size)
    n = qweight.shape[1]
    assert qweight.shape[0] * VALS == k and (k // VALS) * n < 2**31, (qweight.shape, k)
    x = x.contiguous()
    col_blocks = triton.cdiv(n, block_n)
    split_k, k_per_split, out, partial, counters = split_k_launch(x, n, block_kw * VALS, col_blocks, split_k)
    _gemv_w2_kernel[(col_blocks, split_k)](
        x, qweight, scales, mins, out, partial, counters, n, k, k_per_split,
        GROUP=group_size, BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=split_k,
        USE_ASM=os.environ.get("TRITON_INTERPRET", "0") != "1",
        num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device),
    )
    return out
