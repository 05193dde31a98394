"""Weight-streaming quantized matmul for 1-16 rows (decode): y = x @ dequant(W)^T.

Reads each packed word once per call whatever M is: for M = 1 the dot product is an in-thread
reduction (no tensor cores needed), for M in 2..16 the dequantized fp16 tile goes through tl.dot.
K is split across programs to fill the GPU; the last program of each column block sums the
fp32 partials (a per-block counter, no second launch) and writes the output in x's dtype.

Layout and meaning: docs/format.md; the reference is quant_matmul.quant_matmul_ref."""

from __future__ import annotations

import torch

from halfbyte.kernels.cluster import cluster_combine
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton

_counters: dict[torch.device, torch.Tensor] = {}


def _counter_buffer(device: torch.device, size: int) -> torch.Tensor:
    """Zeroed int32 counters, reset by the kernels themselves after use."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < size:
        buf = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


if HAS_TRITON:

    @triton.jit
    def _unpack_tile(qw_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask,
                     BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_KW: tl.constexpr):
        # -> q as fp32 [BLOCK_KW, VALS, BLOCK_N], scales and mins fp32 [BLOCK_KW, BLOCK_N]
        VALS: tl.constexpr = 32 // BITS
        rw = tl.arange(0, BLOCK_KW)
        w_row = k0 // VALS + rw
        w_mask = (w_row * VALS < k_end)[:, None] & n_mask[None, :]
        words = tl.load(qw_ptr + w_row[:, None].to(tl.int64) * N + rn[None, :], mask=w_mask, other=0).to(tl.uint32)
        shifts = (tl.arange(0, VALS) * BITS).to(tl.uint32)
        q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
        # int -> float without a conversion instruction: 2^23 + q carries q in its mantissa
        qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        g = (k0 + rw * VALS) // GROUP
        s = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=w_mask, other=0.0).to(tl.float32)
        m = tl.load(mins_ptr + g[:, None] * N + rn[None, :], mask=w_mask, other=0.0).to(tl.float32)
        return qf, s, m

    @triton.jit
    def _write_out(acc, out_ptr, partial_ptr, counter_ptr, rm, rn, M, N, pid_n, pid_k, SPLIT_K: tl.constexpr,
                   COMBINE: tl.constexpr = True, CLUSTER: tl.constexpr = False):
        """acc to out, or with SPLIT_K > 1 to this split's partial, the last split of a column
        block summing them into out. COMBINE=False stops at the partial (a timing diagnostic).
        CLUSTER (a cluster launch, cluster.py): the splits sum in rank 0's shared memory instead."""
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        offs = rm[:, None] * N + rn[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        elif CLUSTER and COMBINE:
            cluster_combine(acc, out_ptr, offs, mask, pid_k, SPLIT_K)
        else:
            tl.store(partial_ptr + pid_k * M * N + offs, acc, mask=mask)
            if COMBINE:
                # the scalar atomic runs on one thread: a CTA barrier first, so every warp's partial
                # is written before the count (seen on the H200 as garbage sums at 512-wide tiles);
                # acq_rel: our partial is visible before the count, others' before we read them
                tl.debug_barrier()
                done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
                if done == SPLIT_K - 1:
                    total = tl.zeros_like(acc)
                    for s in range(SPLIT_K):
                        total += tl.load(partial_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
                    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(counter_ptr + pid_n, 0)

    @triton.jit
    def _gemv_kernel(
        x_ptr, qw_ptr, scales_ptr, mins_ptr, out_ptr, partial_ptr, counter_ptr,
        M, N, K, k_per_split,
        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_KW: tl.constexpr, SPLIT_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_sync(PDL)
        VALS: tl.constexpr = 32 // BITS
        BLOCK_K: tl.constexpr = BLOCK_KW * VALS
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        n_mask = rn < N
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        if BLOCK_M == 1 and UNROLL:
            # values of a word extracted one shift at a time on 2-D [words, N] tiles: the word
            # and its values never leave the thread that loaded it
            rw = tl.arange(0, BLOCK_KW)
            acc1 = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                w_row = k0 // VALS + rw
                w_mask = (w_row * VALS < k_end)[:, None] & n_mask[None, :]
                words = tl.load(qw_ptr + w_row[:, None].to(tl.int64) * N + rn[None, :], mask=w_mask, other=0)
                words = words.to(tl.uint32)
                dot = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
                xsum = tl.zeros([BLOCK_KW], dtype=tl.float32)
                for j in tl.static_range(VALS):
                    kj = k0 + rw * VALS + j
                    xj = tl.load(x_ptr + kj, mask=kj < k_end, other=0.0).to(tl.float32)
                    qj = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x4B000000
                    dot += (qj.to(tl.float32, bitcast=True) - 8388608.0) * xj[:, None]
                    xsum += xj
                g = (k0 + rw * VALS) // GROUP
                s = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=w_mask, other=0.0).to(tl.float32)
                m = tl.load(mins_ptr + g[:, None] * N + rn[None, :], mask=w_mask, other=0.0).to(tl.float32)
                acc1 += dot * s + xsum[:, None] * m
            acc = tl.sum(acc1, axis=0)[None, :]
        elif BLOCK_M == 1:
            # the values of one word sit in one thread: sum them there, scale once per word
            acc1 = tl.zeros([BLOCK_KW, BLOCK_N], dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                qf, s, m = _unpack_tile(qw_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask, BITS, GROUP, BLOCK_KW)
                kk = k0 + tl.arange(0, BLOCK_KW)[:, None] * VALS + tl.arange(0, VALS)[None, :]
                x = tl.load(x_ptr + kk, mask=kk < k_end, other=0.0).to(tl.float32)
                acc1 += tl.sum(qf * x[:, :, None], axis=1) * s + tl.sum(x, axis=1)[:, None] * m
            acc = tl.sum(acc1, axis=0)[None, :]
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                qf, s, m = _unpack_tile(qw_ptr, scales_ptr, mins_ptr, k0, k_end, N, rn, n_mask, BITS, GROUP, BLOCK_KW)
                w = (qf * s[:, None, :] + m[:, None, :]).to(x_ptr.dtype.element_ty)
                w = tl.reshape(w, [BLOCK_K, BLOCK_N])
                kk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm < M)[:, None] & (kk < k_end)[None, :], other=0.0)
                acc += tl.dot(x, w)
        _write_out(acc, out_ptr, partial_ptr, counter_ptr, rm, rn, M, N, pid_n, pid_k, SPLIT_K)


def split_k_launch(
    x: torch.Tensor, n: int, block_k: int, col_blocks: int, split_k: int | None
) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K split for a weight-streaming launch (default: about two waves of programs on 132 SMs),
    each split a whole number of tiles: (split_k, k_per_split, out, fp32 partials, counters)."""
    m, k = x.shape
    if split_k is None:
        split_k = max(1, min(triton.cdiv(k, block_k), 264 // col_blocks, 16))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    return split_k, k_per_split, out, partial, _counter_buffer(x.device, col_blocks)


def gemv_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int,
    split_k: int | None = None, block_n: int | None = None, block_kw: int | None = None,
    num_warps: int = 4, num_stages: int | None = None, unroll: bool | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] -> [M, N] in x's dtype; bits in (2, 4, 8)."""
    m, k = x.shape
    assert m <= 16 and 32 % bits == 0
    x = x.contiguous()
    n = qweight.shape[1]
    # defaults: the H200 sweep's winners (BENCHMARKS.md, bench/gemv.py --sweep)
    if m > 1:  # the tl.dot tile must fit shared memory
        block_n, block_kw, num_stages = block_n or 128, block_kw or 8, num_stages or 4
    else:
        unroll = True if unroll is None else unroll
        wide = k >= 8192 and 8192 <= n < 16384  # 70B-sized qkv/o/down: wide tiles, no split
        block_n = block_n or (512 if wide else 128 if n >= 16384 else 256)
        block_kw = block_kw or (8 if wide else 16)
        num_stages = num_stages or 2
        if split_k is None and n >= 16384:  # gate_up-sized: more, shorter K runs in flight
            split_k = 8
    col_blocks = triton.cdiv(n, block_n)
    split_k, k_per_split, out, partial, counters = split_k_launch(x, n, block_kw * (32 // bits), col_blocks, split_k)
    block_m = 1 if m == 1 else 16
    _gemv_kernel[(col_blocks, split_k)](
        x, qweight, scales, mins, out, partial, counters, m, n, k, k_per_split,
        BITS=bits, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=split_k,
        UNROLL=bool(unroll), num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device),
    )
    return out
