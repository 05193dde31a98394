"""4-bit matmul for 1-16 fp16 rows on tensor cores, from weights repacked into mma.sync's order.

Why: gemv_w4 (fp16x2 FMAs) spends ~25 SASS instructions per 32-bit word (8 weights): the
dequantize-and-dot core is ~13, the rest rebuilds x's half2 pairs, converts partial sums to
fp32 and applies scales per word (BENCHMARKS.md). Here the weight is the A operand of
`mma.sync.m16n8k16` straight from the registers that unpacked it, x is the B operand loaded as it
lies in memory, and the tensor core accumulates in fp32: per word one shift, four lop3, four
centring ops, four scale FMAs and one mma. Up to 8 rows of x ride in one mma's 8 columns, 16 in
two, so 16 rows cost little more than one.

The layout (`repack`, done once at load on CUDA): qweight int32 [N, K/8], row n's words in
blocks of 16 per 128 k. Word w = 16 b + 4 t + i of row n holds, in nibble s = j + 4 h (bits
4s..4s+3), the value of k = 128 b + 32 t + 8 i + 2 j + h. So the four words of lane-chunk t are
one 16-byte load, one lop3 turns nibbles (j, j + 4) into the half2 (k, k + 1) of x's pair
k = 128 b + 32 t + 8 i + 2 j, and a word's four x pairs (j = 0..3) are 16 contiguous bytes of x. In the mma, lane 4 g + t holds rows n_a = n0 + p and n_b = n_a + P (p with
p % 8 = g) as the fragment's rows g and g + 8, and its k pairs as the fragment's columns
(2t, 2t+1) and (2t+8, 2t+9): any assignment of k to mma columns works as long as A and B agree.

Meaning (docs/format.md, bits = 4): W[n, k] = q s + m; each weight is rounded once to fp16 as
(q - 8) s + (m + 8 s) (as gemm_w4 does), the sums are fp32. The interpreter (CI) runs the same
layout, scales and split-K with plain arithmetic (USE_ASM=False); the GPU tests check the PTX.
The reference is quant_matmul.quant_matmul_ref on the original layout."""

from __future__ import annotations

import torch

from halfbyte.kernels.quant_gemv import _counter_buffer
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton
from halfbyte.quant.packing import pack, unpack

MAX_ROWS = 16
BLOCK_K = 128  # k per loop step: 16 words of a row, 4 lane-chunks x 4 words


def _k_order(k: int, device: torch.device) -> torch.Tensor:
    """perm [K]: nibble s of repacked word w holds k = perm[8 w + s]."""
    w = torch.arange(k // 8, device=device)[:, None]
    s = torch.arange(8, device=device)[None, :]
    b, t, i = w // 16, (w // 4) % 4, w % 4
    return (128 * b + 32 * t + 8 * i + 2 * (s % 4) + s // 4).reshape(-1)


def repack(qweight: torch.Tensor, k: int, chunk: int = 4096) -> torch.Tensor:
    """4-bit qweight int32 [K/8, N] (docs/format.md) -> the mma layout int32 [N, K/8] (module
    docstring). Column chunks bound the temporary memory on large matrices."""
    if k % BLOCK_K:
        raise ValueError(f"mma_w4.repack: K = {k} is not a multiple of {BLOCK_K}")
    n = qweight.shape[1]
    perm = _k_order(k, qweight.device)
    out = torch.empty(n, k // 8, dtype=torch.int32, device=qweight.device)
    for n0 in range(0, n, chunk):
        q = unpack(qweight[:, n0 : n0 + chunk], 4, k)  # [n, K]
        out[n0 : n0 + chunk] = pack(q[:, perm], 4).t()
    return out


def unrepack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of `repack` (tests, debugging)."""
    inv = torch.argsort(_k_order(k, packed.device))
    q = unpack(packed.t().contiguous(), 4, k)  # [N, K] in repacked order
    return pack(q[:, inv], 4)


def group_ok(group_size: int) -> bool:
    """Groups of 32 or 64, or whole 128-k blocks: a lane-chunk's four words share one scale."""
    return group_size in (32, 64) or group_size % BLOCK_K == 0


def supports(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """1-16 fp16 rows, 4 bits, K in whole 128-k blocks, groups of 32 or 64 or whole 128-k blocks
    (a lane-chunk's four words share one scale)."""
    m, k = x.shape
    return (bits == 4 and x.dtype == torch.float16 and 1 <= m <= MAX_ROWS and k % BLOCK_K == 0
            and group_ok(group_size) and x.data_ptr() % 16 == 0)


def _dequant_mma_asm(mt: int) -> str:
    """PTX: $0 .. $(4 mt - 1) = C after two m16n8k16 products per x tile; operands after the
    outputs: word a, word b, (s, s) and (m + 8 s, m + 8 s) half2 of rows a and b, then per x tile
    the four x half2 pairs and the four C inputs."""
    o = 4 * mt  # first input
    lines = ["{", " .reg .b32 m1032, inv16, m72, top, a0, a1, a2, a3, b0, b1, b2, b3;",
             " mov.b32 m1032, 0x64086408;", " mov.b32 inv16, 0x2c002c00;", " mov.b32 m72, 0xd480d480;"]
    for r, w, s, m in (("a", o, o + 2, o + 3), ("b", o + 1, o + 4, o + 5)):
        lines += [
            f" shr.u32 top, ${w}, 8;",
            f" lop3.b32 {r}0, ${w}, 0x000f000f, 0x64006400, 0xea;",
            f" lop3.b32 {r}1, ${w}, 0x00f000f0, 0x64006400, 0xea;",
            f" lop3.b32 {r}2, top, 0x000f000f, 0x64006400, 0xea;",
            f" lop3.b32 {r}3, top, 0x00f000f0, 0x64006400, 0xea;",
            f" sub.f16x2 {r}0, {r}0, m1032;", f" fma.rn.f16x2 {r}1, {r}1, inv16, m72;",
            f" sub.f16x2 {r}2, {r}2, m1032;", f" fma.rn.f16x2 {r}3, {r}3, inv16, m72;",
        ] + [f" fma.rn.f16x2 {r}{j}, {r}{j}, ${s}, ${m};" for j in range(4)]
    base = o + 6
    for tile in range(mt):
        x = base + 8 * tile
        c = [f"${x + 4 + j}" for j in range(4)]
        d = "{" + ", ".join(f"${4 * tile + j}" for j in range(4)) + "}"
        lines.append(f" mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d}, {{a0, b0, a1, b1}}, "
                     f"{{${x}, ${x + 1}}}, {{{', '.join(c)}}};")
        lines.append(f" mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d}, {{a2, b2, a3, b3}}, "
                     f"{{${x + 2}, ${x + 3}}}, {d};")
    lines.append("}")
    return "\n".join(lines)


# (s, s) and (m + 8 s, m + 8 s) as half2 from fp16 s and m
_SCALE_PAIRS_ASM = """{
 .reg .b32 mm, eight;
 mov.b32 eight, 0x48004800;
 mov.b32 $0, {$2, $2};
 mov.b32 mm, {$3, $3};
 fma.rn.f16x2 $1, $0, eight, mm;
}"""

if HAS_TRITON:
    MMA1_ASM = tl.constexpr(_dequant_mma_asm(1))
    MMA2_ASM = tl.constexpr(_dequant_mma_asm(2))
    SCALE_PAIRS_ASM = tl.constexpr(_SCALE_PAIRS_ASM)

    @triton.jit
    def _split4(v):
        """[P, 16] (word position 4 t + i) -> its four [P, 4] slices i = 0..3 (in-thread: no data moves)."""
        v = tl.reshape(v, [v.shape[0], 4, 2, 2])
        even, odd = tl.split(v)  # last dim: i % 2
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        return v0, v1, v2, v3

    @triton.jit
    def _opaque(v):
        """v unchanged, but with no contiguity the compiler could act on."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _scales(scales_ptr, mins_ptr, offs):
        """(s, s) and (m + 8 s, m + 8 s) half2 [P, 4] from offsets [4, P] with no known contiguity:
        Triton then lays the loads out dim 0 first (lane = t + 4 p, the mma's lanes), and the
        transpose to [P, 4] moves no data."""
        s = tl.permute(tl.load(scales_ptr + offs), (1, 0))
        m = tl.permute(tl.load(mins_ptr + offs), (1, 0))
        return _scale_pairs(s, m)

    @triton.jit
    def _scale_pairs(s, m):
        return tl.inline_asm_elementwise(SCALE_PAIRS_ASM, "=r,=r,h,h", [s, m], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)

    @triton.jit
    def _x_tile(xw_ptr, mt: tl.constexpr, p, c, k0, M, K):
        """x row mt * 8 + p % 8 for word positions i = 0..3: [P, 16] each, element 4 t + j the half2
        x[k0 + 32 t + 8 i + 2 j + (0, 1)]; a thread's four pairs of a word are one 16-byte load and
        land in the aligned register pairs the mma's B operand wants."""
        # rows past M read row M - 1 (no masks: masked loads cost zeroing instructions); their
        # products land in C columns that are never stored
        row = tl.minimum(mt * 8 + p % 8, M - 1)
        base = (row * (K // 2) + k0 // 2)[:, None] + (16 * (c // 4) + c % 4)[None, :]
        x0 = tl.load(xw_ptr + base)
        x1 = tl.load(xw_ptr + base + 4)
        x2 = tl.load(xw_ptr + base + 8)
        x3 = tl.load(xw_ptr + base + 12)
        return x0, x1, x2, x3

    @triton.jit
    def _mma_step(c0, c1, c2, c3, c4, c5, c6, c7, wa, wb, sa, ma, sb, mb, x0, x1, x2, x3, y0, y1, y2, y3,
                  MT: tl.constexpr):
        """One word position (i) of both rows: C += both products; x0..x3 the first x tile's pairs,
        y0..y3 the second's (MT == 2)."""
        if MT == 1:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                MMA1_ASM, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r,f,f,f,f",
                [wa, wb, sa, ma, sb, mb, x0, x1, x2, x3, c0, c1, c2, c3],
                dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        else:
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
                MMA2_ASM, "=f,=f,=f,=f,=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r,f,f,f,f,r,r,r,r,f,f,f,f",
                [wa, wb, sa, ma, sb, mb, x0, x1, x2, x3, c0, c1, c2, c3, y0, y1, y2, y3, c4, c5, c6, c7],
                dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        return c0, c1, c2, c3, c4, c5, c6, c7

    @triton.jit
    def _emit(v, offs, mask, out_ptr, partial_ptr, pid_k, MN, SPLIT_K: tl.constexpr):
        """Store v as the output, or with split-K as this split's fp32 partial."""
        if SPLIT_K == 1:
            tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(partial_ptr + pid_k * MN + offs, v, mask=mask)

    @triton.jit
    def _finish(offs, mask, out_ptr, partial_ptr, MN, SPLIT_K: tl.constexpr):
        """The last split of a column block: sum every split's partial in split order."""
        total = tl.load(partial_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLIT_K):
            total += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _plain_block(ya, yb, wa, wb, sa, ma, sb, mb, x_ptr, k0, M, K, c, MP: tl.constexpr):
        """Interpreter twin of the PTX: the same weights (fp16-rounded) times x, summed in fp32."""
        P: tl.constexpr = wa.shape[0]
        rm = tl.arange(0, MP)
        ua = wa.to(tl.uint32, bitcast=True)
        ub = wb.to(tl.uint32, bitcast=True)
        m8a = (ma.to(tl.float32) + 8.0 * sa.to(tl.float32)).to(tl.float16).to(tl.float32)
        m8b = (mb.to(tl.float32) + 8.0 * sb.to(tl.float32)).to(tl.float16).to(tl.float32)
        for s in tl.static_range(8):
            k = k0 + 32 * (c // 4) + 8 * (c % 4) + 2 * (s % 4) + s // 4  # [16]
            xs = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=(rm < M)[:, None], other=0.0).to(tl.float32)
            qa = (((ua >> (4 * s)) & 15).to(tl.float32) - 8.0)
            qb = (((ub >> (4 * s)) & 15).to(tl.float32) - 8.0)
            fa = (qa * sa.to(tl.float32) + m8a).to(tl.float16).to(tl.float32)
            fb = (qb * sb.to(tl.float32) + m8b).to(tl.float16).to(tl.float32)
            ya += tl.sum(fa[:, None, :] * xs[None, :, :], axis=2)
            yb += tl.sum(fb[:, None, :] * xs[None, :, :], axis=2)
        return ya, yb

    @triton.jit
    def _mma_w4_kernel(
        x_ptr, qw_ptr, scales_ptr, mins_ptr, out_ptr, partial_ptr, counter_ptr,
        M, N, K, k_per_split,
        GROUP: tl.constexpr, P: tl.constexpr, MT: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_ASM: tl.constexpr, PDL: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KW = tl.multiple_of(K // 8, 16)  # K is whole 128-k blocks
        p = tl.arange(0, P)
        c = tl.arange(0, 16)  # word position 4 t + i in a 128-k block
        t = tl.arange(0, 4)
        na = pid_n * 2 * P + p
        nb = na + P
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        # rows past N read row N - 1 (never stored): unmasked loads
        la = tl.minimum(na, N - 1)
        lb = tl.minimum(nb, N - 1)
        row_a = (la * KW)[:, None] + c[None, :]
        row_b = (lb * KW)[:, None] + c[None, :]
        # weights never change: the first block is requested before waiting for the previous
        # kernel (PDL), as gemv_w4 does
        wa = tl.load(qw_ptr + row_a + k_start // 8)
        wb = tl.load(qw_ptr + row_b + k_start // 8)
        pdl_sync(PDL)
        MN = M * N
        xw_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if USE_ASM:
            # a lane-chunk's group: k0 // GROUP + (32 t) // GROUP (GROUP divides 128 or 128 divides
            # GROUP). The offsets go through an opaque move so that the loads keep the mma's
            # [P, 4] layout (Triton would lay a load contiguous along n out along n, and convert)
            s_a = _opaque(((32 * t) // GROUP * N)[:, None] + la[None, :])  # [4, P]: see _scales
            s_b = _opaque(((32 * t) // GROUP * N)[:, None] + lb[None, :])
            c0 = tl.zeros([P, 4], dtype=tl.float32)
            c1 = c0
            c2 = c0
            c3 = c0
            c4 = c0
            c5 = c0
            c6 = c0
            c7 = c0
        else:
            MP: tl.constexpr = 8 * MT
            ya = tl.zeros([P, MP], dtype=tl.float32)
            yb = tl.zeros([P, MP], dtype=tl.float32)
        for k0 in range(k_start, k_end, 128):
            g_row = k0 // GROUP * N
            if USE_ASM:
                # one (s, m) per lane-chunk: its four words share the group
                sa, ma = _scales(scales_ptr, mins_ptr, g_row + s_a)
                sb, mb = _scales(scales_ptr, mins_ptr, g_row + s_b)
                wa0, wa1, wa2, wa3 = _split4(wa)
                wb0, wb1, wb2, wb3 = _split4(wb)
                # the four word positions by hand (one asm call each)
                xt0 = _x_tile(xw_ptr, 0, p, c, k0, M, K)
                if MT == 2:
                    xt1 = _x_tile(xw_ptr, 1, p, c, k0, M, K)
                else:
                    xt1 = xt0
                a0, a1, a2, a3 = _split4(xt0[0])
                b0, b1, b2, b3 = _split4(xt0[1])
                d0, d1, d2, d3 = _split4(xt0[2])
                e0, e1, e2, e3 = _split4(xt0[3])
                f0, f1, f2, f3 = _split4(xt1[0])
                g0, g1, g2, g3 = _split4(xt1[1])
                h0, h1, h2, h3 = _split4(xt1[2])
                j0, j1, j2, j3 = _split4(xt1[3])
                # word position i: x pairs a (tile 0) and f (tile 1, MT == 2) of word 0, b / g of word 1, ...
                c0, c1, c2, c3, c4, c5, c6, c7 = _mma_step(c0, c1, c2, c3, c4, c5, c6, c7, wa0, wb0, sa, ma, sb, mb,
                                                           a0, a1, a2, a3, f0, f1, f2, f3, MT)
                c0, c1, c2, c3, c4, c5, c6, c7 = _mma_step(c0, c1, c2, c3, c4, c5, c6, c7, wa1, wb1, sa, ma, sb, mb,
                                                           b0, b1, b2, b3, g0, g1, g2, g3, MT)
                c0, c1, c2, c3, c4, c5, c6, c7 = _mma_step(c0, c1, c2, c3, c4, c5, c6, c7, wa2, wb2, sa, ma, sb, mb,
                                                           d0, d1, d2, d3, h0, h1, h2, h3, MT)
                c0, c1, c2, c3, c4, c5, c6, c7 = _mma_step(c0, c1, c2, c3, c4, c5, c6, c7, wa3, wb3, sa, ma, sb, mb,
                                                           e0, e1, e2, e3, j0, j1, j2, j3, MT)
            else:
                g_off = g_row + ((32 * (c // 4)) // GROUP * N)[None, :]  # [1, 16]: each word's group
                sa3 = tl.load(scales_ptr + g_off + la[:, None])
                ma3 = tl.load(mins_ptr + g_off + la[:, None])
                sb3 = tl.load(scales_ptr + g_off + lb[:, None])
                mb3 = tl.load(mins_ptr + g_off + lb[:, None])
                ya, yb = _plain_block(ya, yb, wa, wb, sa3, ma3, sb3, mb3, x_ptr, k0, M, K, c, MP)
            # the next block (the last one again at the end: an unmasked load, L2-hot, unused)
            k_next = tl.multiple_of(tl.minimum(k0 + 128, k_end - 128) // 8, 16)
            wa = tl.load(qw_ptr + row_a + k_next)
            wb = tl.load(qw_ptr + row_b + k_next)
        if USE_ASM:
            # C fragment of lane (g, t): c0 / c1 = rows a, x rows 2t / 2t + 1 of the tile; c2 / c3 = row b
            m0 = 2 * t[None, :]
            n_a = na[:, None]
            n_b = nb[:, None]
            ok_na = (n_a < N)
            ok_nb = (n_b < N)
            _emit(c0, m0 * N + n_a, ok_na & (m0 < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
            _emit(c1, (m0 + 1) * N + n_a, ok_na & (m0 + 1 < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
            _emit(c2, m0 * N + n_b, ok_nb & (m0 < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
            _emit(c3, (m0 + 1) * N + n_b, ok_nb & (m0 + 1 < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
            if MT == 2:
                _emit(c4, (m0 + 8) * N + n_a, ok_na & (m0 + 8 < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
                _emit(c5, (m0 + 9) * N + n_a, ok_na & (m0 + 9 < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
                _emit(c6, (m0 + 8) * N + n_b, ok_nb & (m0 + 8 < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
                _emit(c7, (m0 + 9) * N + n_b, ok_nb & (m0 + 9 < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
        else:
            rm = tl.arange(0, 8 * MT)[None, :]
            _emit(ya, rm * N + na[:, None], (na[:, None] < N) & (rm < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
            _emit(yb, rm * N + nb[:, None], (nb[:, None] < N) & (rm < M), out_ptr, partial_ptr, pid_k, MN, SPLIT_K)
        if SPLIT_K > 1:
            # the scalar atomic runs on one thread: a CTA barrier first so every warp's partial is
            # written; acq_rel: ours visible before the count, the others' before we read them
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                rm = tl.arange(0, 16)[None, :]
                n_all = pid_n * 2 * P + tl.arange(0, 2 * P)[:, None]
                _finish(rm * N + n_all, (n_all < N) & (rm < M), out_ptr, partial_ptr, MN, SPLIT_K)
                tl.atomic_xchg(counter_ptr + pid_n, 0)


# (N, K) -> (warps, split_k): filled from the H200 sweep (bench/gemv.py --mma)
_TUNED: dict[tuple[int, int], tuple[int, int]] = {}


def _use_asm() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") != "1"


def mma_w4(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
    num_warps: int | None = None, split_k: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1 <= M <= 16, K] fp16, packed = repack(qweight) -> [M, N] fp16 (into `out` if given)."""
    m, k = x.shape
    if not supports(x, 4, group_size):
        raise ValueError(f"mma_w4: unsupported x {tuple(x.shape)} {x.dtype} for 4-bit groups of {group_size}")
    n = packed.shape[0]
    if packed.shape[1] * 8 != k:
        raise ValueError(f"mma_w4: packed weight {tuple(packed.shape)} does not match K = {k}")
    assert n * (k // 8) < 2**31, "word offsets are int32"
    tuned = _TUNED.get((n, k))
    warps = num_warps or (tuned[0] if tuned else 4)
    p = 8 * warps
    col_blocks = triton.cdiv(n, 2 * p)
    blocks = k // BLOCK_K
    if split_k is None:  # about four waves of 132 SMs unless tuned
        split_k = tuned[1] if tuned else max(1, min(blocks, 528 // col_blocks))
    k_per_split = triton.cdiv(blocks, split_k) * BLOCK_K
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = _counter_buffer(x.device, col_blocks)
    _mma_w4_kernel[(col_blocks, split_k)](
        x, packed, scales, mins, out, partial, counters, m, n, k, k_per_split,
        GROUP=group_size, P=p, MT=1 if m <= 8 else 2, SPLIT_K=split_k, USE_ASM=_use_asm(),
        num_warps=warps, **pdl_args(x.device),
    )
    return out


if HAS_TRITON:

    @triton.jit
    def _dequant_t_kernel(qw_ptr, scales_ptr, mins_ptr, out_ptr, N, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        """W^T [K, N] in out's dtype from the mma layout, one 128-k block x BLOCK_N rows a program."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * 128
        c = tl.arange(0, 16)
        ok = (rn < N)[:, None] & (c >= 0)[None, :]
        words = tl.load(qw_ptr + (rn * (K // 8))[:, None] + k0 // 8 + c[None, :], mask=ok, other=0).to(tl.uint32, bitcast=True)
        for s in tl.static_range(8):
            k = k0 + 32 * (c // 4) + 8 * (c % 4) + 2 * (s % 4) + s // 4  # [16]
            g = (k // GROUP * N)[None, :] + rn[:, None]
            sc = tl.load(scales_ptr + g, mask=ok, other=0.0).to(tl.float32)
            mn = tl.load(mins_ptr + g, mask=ok, other=0.0).to(tl.float32)
            w = ((words >> (4 * s)) & 15).to(tl.float32) * sc + mn
            tl.store(out_ptr + (k * N)[None, :] + rn[:, None], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_t(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in dtype from the mma layout (prefill: one dequantization, then a dense matmul)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    out = torch.empty(k, n, dtype=dtype, device=packed.device)
    block_n = 64
    _dequant_t_kernel[(triton.cdiv(n, block_n), k // BLOCK_K)](packed, scales, mins, out, n, k, GROUP=group_size,
                                                               BLOCK_N=block_n)
    return out


DENSE_ROWS = 64  # more rows: dequantize once + cuBLAS (as quant_matmul does for the original layout)


def matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
           group_size: int) -> torch.Tensor:
    """x [M, K] @ W^T for a weight held only in the mma layout, any M: 16-row chunks through
    mma_w4 up to DENSE_ROWS rows (the weight re-read per chunk, partly from L2), dequantize +
    torch.mm past that or for dtypes other than fp16."""
    m = x.shape[0]
    x = x.contiguous()
    if x.dtype == torch.float16 and m <= DENSE_ROWS:
        if m <= MAX_ROWS:
            return mma_w4(x, packed, scales, mins, group_size)
        return torch.cat([mma_w4(x[i : i + MAX_ROWS], packed, scales, mins, group_size)
                          for i in range(0, m, MAX_ROWS)])
    return torch.mm(x, dequantize_t(packed, scales, mins, group_size, x.dtype))
