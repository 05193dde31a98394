"""4-bit matmul for 2-64 fp16 rows (batched decode) on tensor cores: y = x @ dequant(W)^T.

Why not gemv_w4's multi-row kernel: it multiplied the centred integers (q - 8) and applied the
scales after each tile, which needs a second fp32 accumulator and x's per-group sums, and it
gathered x with a stride of 8 elements (a word holds k = 8r .. 8r+7; value j of every word of a
tile is one dot operand). At 64 rows that kernel ran at 1/6-1/9 of the bandwidth limit
(BENCHMARKS.md). Here:
- x is permuted once per call into plane-major tiles, so each dot operand is a contiguous load:
  xp[m, t*T + j*KW + r] = x[m, t*T + 8r + j], T = 8 * KW (KW words of K per tile; T divides K);
- the unpack PTX finishes the dequantization in fp16x2: w = (q - 8) * s + (m + 8 s), one FMA per
  two weights, and the eight value planes go straight into the single fp32 accumulator.

Meaning (docs/format.md, bits = 4): W[n, k] = q * s[k // G, n] + m[k // G, n]. The fp16 weight
rounds once (as every fp16-dequantizing kernel does); the sums are fp32. A tile may span groups
(each word row loads its own scales). The interpreter (CI) runs the same arithmetic without PTX (USE_ASM=False).
The reference is quant_matmul.quant_matmul_ref."""

from __future__ import annotations

import os

import torch

from halfbyte.kernels.gemv_w4 import _DEQUANT_PTX, _use_asm
from halfbyte.kernels.cluster import cluster_wanted, partial_bytes, split_ids
from halfbyte.kernels.quant_gemv import _write_out, split_k_launch
from halfbyte.kernels.shared_memory import launch_with_shared
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton

# _DEQUANT_PTX leaves q - 8 for the value pairs (0,4) (1,5) (2,6) (3,7) in q04..q37; one f16x2
# FMA each makes them weights. $8 = the word, $9 = (s, s), $10 = (m + 8s, m + 8s) as half2.
_UNPACK8_DEQ_ASM = (
    "{\n .reg .b32 m1032, inv16, m72, top, q04, q15, q26, q37;\n"
    + _DEQUANT_PTX.format(w="$8")
    + """
    fma.rn.f16x2 q04, q04, $9, $10;
    fma.rn.f16x2 q15, q15, $9, $10;
    fma.rn.f16x2 q26, q26, $9, $10;
    fma.rn.f16x2 q37, q37, $9, $10;
    mov.b32 {$0, $4}, q04;
    mov.b32 {$1, $5}, q15;
    mov.b32 {$2, $6}, q26;
    mov.b32 {$3, $7}, q37;
}"""
)

if HAS_TRITON:
    UNPACK8_DEQ_ASM = tl.constexpr(_UNPACK8_DEQ_ASM)

    @triton.jit
    def _half2(v):
        """fp16 [N] -> int32 [N] holding (v, v) as a half2."""
        b = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return b | (b << 16)

    @triton.jit
    def _plane(uw, j: tl.constexpr, s, m8):
        """Plain-Triton twin of the PTX: value j of each word, dequantized in fp16."""
        q = (((uw >> (4 * j)) & 15).to(tl.float32) - 8.0).to(tl.float16)
        return q * s + m8

    @triton.jit
    def _acc_plane(acc, w, xp_ptr, x_offs, x_mask, j: tl.constexpr, BLOCK_KW: tl.constexpr):
        xj = tl.load(xp_ptr + x_offs + j * BLOCK_KW, mask=x_mask, other=0.0)  # [BLOCK_M, KW]
        return tl.dot(xj, w, acc)  # x [BLOCK_M, KW] . W^T [KW, BLOCK_N]

    @triton.jit
    def _x_planes(x_ptr, rm, k0, K, x_mask, BLOCK_M: tl.constexpr, BLOCK_KW: tl.constexpr):
        """x's tile in its own order, one contiguous load, split in registers into the eight value
        planes (plane j: x[m, k0 + 8r + j]); no permuted copy of x in memory."""
        r8 = tl.arange(0, 8)
        rw = tl.arange(0, BLOCK_KW)
        offs = rm[:, None, None] * K + k0 + rw[None, :, None] * 8 + r8[None, None, :]
        x = tl.load(x_ptr + offs, mask=x_mask[:, :, None], other=0.0)  # [BLOCK_M, KW, 8]
        x = tl.reshape(x, [BLOCK_M, BLOCK_KW, 2, 2, 2])  # j = 4a + 2b + c
        c0, c1 = tl.split(x)
        c0b0, c0b1 = tl.split(c0)
        c1b0, c1b1 = tl.split(c1)
        x0, x4 = tl.split(c0b0)
        x2, x6 = tl.split(c0b1)
        x1, x5 = tl.split(c1b0)
        x3, x7 = tl.split(c1b1)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _gemm_w4_kernel(
        xp_ptr, qw_ptr, scales_ptr, mins_ptr, out_ptr, partial_ptr, counter_ptr,
        M, N, K, k_per_split,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
        SPLIT_K: tl.constexpr, USE_ASM: tl.constexpr, X_SPLIT: tl.constexpr, PDL: tl.constexpr,
        DIAG: tl.constexpr = 0, CLUSTER: tl.constexpr = False,
    ):
        pdl_sync(PDL)
        # out = x W^T, the weight tile as the dot's second operand: on sm_90 Triton 3.6 lowers it to
        # mma.sync with the words staged by cp.async and dequantized in the operand's registers.
        # The weight as first operand (wgmma from registers, x's planes through shared memory)
        # compiles too but ran 1.3-1.6x slower at 16 rows (H100, BENCHMARKS.md, eighteenth session).
        # DIAG (bench/gemv.py --diag, timing only): 1 no split-K combine, 2 also x's planes made in
        # registers instead of loaded, 3 dequantization without the dots, 4 the weight loads only.
        T: tl.constexpr = BLOCK_KW * 8
        pid_n, pid_k = split_ids(CLUSTER, SPLIT_K)
        pid_m = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rm < M
        rw = tl.arange(0, BLOCK_KW)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        seen = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.int32)  # DIAG 3 / 4 only
        wsum = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
        x_mask = m_mask[:, None]
        for k0 in range(k_start, k_end, T):  # k_per_split is a whole number of tiles; K too
            w_row = k0 // 8 + rw
            words = tl.load(qw_ptr + (w_row * N)[:, None] + rn[None, :], mask=n_mask[None, :], other=0)
            if GROUP % T == 0:  # one group per tile: one scale row
                offs = (k0 // GROUP) * N + rn[None, :]
                smask = n_mask[None, :]
            else:  # a word's 8 values share a group (GROUP % 8 == 0); its row picks it
                offs = ((w_row * 8) // GROUP * N)[:, None] + rn[None, :]
                smask = n_mask[None, :] & (rw >= 0)[:, None]
            s = tl.load(scales_ptr + offs, mask=smask, other=0.0)
            m8 = (tl.load(mins_ptr + offs, mask=smask, other=0.0).to(tl.float32) + 8.0 * s.to(tl.float32)).to(tl.float16)
            if DIAG == 4:
                seen ^= words
            elif USE_ASM:
                w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                    UNPACK8_DEQ_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                    [words, tl.broadcast_to(_half2(s), words.shape), tl.broadcast_to(_half2(m8), words.shape)],
                    dtype=(tl.float16,) * 8, is_pure=True, pack=1,
                )
            else:
                uw = words.to(tl.uint32, bitcast=True)
                w0, w1, w2, w3 = _plane(uw, 0, s, m8), _plane(uw, 1, s, m8), _plane(uw, 2, s, m8), _plane(uw, 3, s, m8)
                w4, w5, w6, w7 = _plane(uw, 4, s, m8), _plane(uw, 5, s, m8), _plane(uw, 6, s, m8), _plane(uw, 7, s, m8)
            if DIAG == 3:
                wsum += (w0 + w1 + w2 + w3).to(tl.float32) + (w4 + w5 + w6 + w7).to(tl.float32)
            elif DIAG == 2 or (DIAG < 2 and X_SPLIT):  # xp_ptr is x itself
                if DIAG == 2:  # one plane made in registers stands for all eight
                    xc = (tl.zeros([BLOCK_M, BLOCK_KW], dtype=tl.float32) + (k0 % 7)).to(tl.float16)
                    x0, x1, x2, x3, x4, x5, x6, x7 = xc, xc, xc, xc, xc, xc, xc, xc
                else:
                    x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(xp_ptr, rm, k0, K, x_mask, BLOCK_M, BLOCK_KW)
                acc = tl.dot(x0, w0, acc)
                acc = tl.dot(x1, w1, acc)
                acc = tl.dot(x2, w2, acc)
                acc = tl.dot(x3, w3, acc)
                acc = tl.dot(x4, w4, acc)
                acc = tl.dot(x5, w5, acc)
                acc = tl.dot(x6, w6, acc)
                acc = tl.dot(x7, w7, acc)
            elif DIAG < 2:
                x_offs = rm[:, None] * K + k0 + rw[None, :]
                acc = _acc_plane(acc, w0, xp_ptr, x_offs, x_mask, 0, BLOCK_KW)
                acc = _acc_plane(acc, w1, xp_ptr, x_offs, x_mask, 1, BLOCK_KW)
                acc = _acc_plane(acc, w2, xp_ptr, x_offs, x_mask, 2, BLOCK_KW)
                acc = _acc_plane(acc, w3, xp_ptr, x_offs, x_mask, 3, BLOCK_KW)
                acc = _acc_plane(acc, w4, xp_ptr, x_offs, x_mask, 4, BLOCK_KW)
                acc = _acc_plane(acc, w5, xp_ptr, x_offs, x_mask, 5, BLOCK_KW)
                acc = _acc_plane(acc, w6, xp_ptr, x_offs, x_mask, 6, BLOCK_KW)
                acc = _acc_plane(acc, w7, xp_ptr, x_offs, x_mask, 7, BLOCK_KW)
        if DIAG >= 3:
            acc += (tl.sum(wsum, axis=0) + tl.sum(seen, axis=0).to(tl.float32))[None, :]
        # one split-K counter per output tile
        _write_out(acc, out_ptr, partial_ptr, counter_ptr, rm, rn, M, N, pid_n + pid_m * tl.num_programs(0), pid_k, SPLIT_K,
                   DIAG == 0, CLUSTER)


def permute_x(x: torch.Tensor, block_kw: int) -> torch.Tensor:
    """x [M, K] -> plane-major tiles of 8 * block_kw columns (see the module docstring)."""
    m, k = x.shape
    return x.view(m, k // (8 * block_kw), block_kw, 8).transpose(2, 3).contiguous().view(m, k)


MAX_ROWS = 64
# x's value planes: a permuted copy first, or split in the kernel. Measured on the H200 (BENCHMARKS.md):
# the split loses at 64 rows on every shape (8B gate_up 74 -> 153 us) and wins at 16 rows only
# where (N, K) is listed here (8B o 12.5 -> 10.7 us, 70B qkv 29.6 -> 28.4 us, 70B o 24.7 -> 23.0).
X_SPLIT = os.environ.get("HALFBYTE_GEMM_X", "permute") == "split"
_SPLIT_AT_16_ROWS = {(4096, 4096), (10240, 8192), (8192, 8192)}

# (N, K) -> {rows bucket: (block_n, block_kw, warps, stages, split_k or None, block_m or None)}:
# the H200 sweep's winners (bench/gemv.py --sweep-rows, BENCHMARKS.md); rows 2-16 use the 16
# entry, 17-64 the 64 one. At 64 rows, two 32-row programs per weight tile won on every 8B shape.
_TUNED: dict[tuple[int, int], dict[int, tuple[int, int, int, int, int | None, int | None]]] = {
    (6144, 4096): {16: (64, 16, 4, 3, 4, None), 64: (256, 16, 4, 3, None, 32)},  # 8B qkv
    (4096, 4096): {16: (64, 16, 4, 3, None, None), 64: (64, 16, 4, 3, None, 32)},  # 8B o
    (28672, 4096): {16: (256, 16, 4, 3, None, None), 64: (256, 16, 4, 3, None, 32)},  # 8B gate_up
    (4096, 14336): {16: (64, 32, 4, 3, None, None), 64: (256, 16, 4, 3, None, 32)},  # 8B down
    (10240, 8192): {16: (256, 16, 4, 3, None, None), 64: (128, 16, 4, 3, None, None)},  # 70B qkv
    (57344, 8192): {16: (256, 16, 4, 3, 1, None), 64: (128, 16, 4, 3, 1, None)},  # 70B gate_up
    (8192, 28672): {16: (256, 16, 4, 3, None, None), 64: (128, 16, 4, 3, None, None)},  # 70B down
}


def x_split_default(n: int, k: int, rows: int) -> bool:
    """Whether gemm_w4 splits x in the kernel for this shape and rows bucket (16 or 64) by default."""
    if "HALFBYTE_GEMM_X" in os.environ:
        return X_SPLIT
    return rows == 16 and (n, k) in _SPLIT_AT_16_ROWS


def supports(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """4 bits, fp16, 2-64 rows, K a whole number of 128-k tiles (a dot plane needs K >= 16
    words), groups of whole words."""
    m, k = x.shape
    return bits == 4 and x.dtype == torch.float16 and 1 < m <= MAX_ROWS and k % 128 == 0 and group_size % 8 == 0


def gemm_w4(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
    split_k: int | None = None, block_n: int | None = None, block_kw: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, block_m: int | None = None,
    x_split: bool | None = None, cluster: bool | None = None, _diag: int = 0,
) -> torch.Tensor:
    """x [2 <= M <= 64, K] fp16 -> [M, N] fp16. block_m < M splits the rows over programs
    (more programs, each weight tile read once per row block, mostly from L2). x_split: split x's
    tiles into value planes in the kernel instead of permuting x first (one launch less per
    call; default X_SPLIT, HALFBYTE_GEMM_X=permute|split). cluster: combine the K splits in a
    thread-block cluster (cluster.py; None: HALFBYTE_SPLITK_CLUSTER=1, off by default). _diag: bench/gemv.py --diag only (the
    output is then wrong; see the kernel)."""
    m, k = x.shape
    if not supports(x, 4, group_size):
        raise ValueError(f"gemm_w4: unsupported x {tuple(x.shape)} {x.dtype} for 4-bit groups of {group_size}")
    n = qweight.shape[1]
    assert (k // 8) * n < 2**31, "word offsets are int32"
    rows = 16 if m <= 16 else 64
    tuned = _TUNED.get((n, k), {}).get(rows)
    if tuned is None:  # untuned shapes: what won most often
        tuned = (64 if n * k < 32 * 2**20 and rows == 16 else 128 if rows == 64 else 256, 16, 4, 3, None, None)
    block_n = block_n or tuned[0]
    block_kw = block_kw or (tuned[1] if k % (8 * tuned[1]) == 0 else 16)
    if k % (8 * block_kw):
        raise ValueError(f"gemm_w4: block_kw {block_kw} does not tile K = {k}")
    num_warps, num_stages = num_warps or tuned[2], num_stages or tuned[3]
    split_k = split_k if split_k is not None else tuned[4]
    x_split = x_split_default(n, k, rows) if x_split is None else x_split
    xp = x.contiguous() if x_split else permute_x(x.contiguous(), block_kw)
    block_m = block_m or tuned[5] or (16 if m <= 16 else 32 if m <= 32 else 64)
    row_blocks = triton.cdiv(m, block_m)
    col_blocks = triton.cdiv(n, block_n)
    split_k, k_per_split, out, partial, counters = split_k_launch(x, n, 8 * block_kw, col_blocks * row_blocks, split_k)
    args = (xp, qweight, scales, mins, out, partial, counters, m, n, k, k_per_split)
    consts = dict(GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=split_k,
                  USE_ASM=_use_asm(), X_SPLIT=x_split, DIAG=_diag, num_warps=num_warps, num_stages=num_stages,
                  **pdl_args(x.device))
    clustered = cluster_wanted(x.device, split_k, cluster, block_m * block_n)
    if clustered:
        launch_with_shared(_gemm_w4_kernel, (col_blocks, 1, row_blocks), partial_bytes(split_k, block_m, block_n), *args,
                           cluster=split_k, CLUSTER=clustered, **consts)
    else:
        _gemm_w4_kernel[(col_blocks, split_k, row_blocks)](*args, **consts)
    return out
