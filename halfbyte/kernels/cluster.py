"""Split-K combine through a Hopper thread-block cluster: the K splits of one output tile run as
the CTAs of one cluster and sum their fp32 partials in rank 0's shared memory (distributed
shared memory), instead of through global partials, a fence and a counter atomic.

Why: the counter combine (quant_gemv._write_out) costs each split-K GEMV ~3 serial L2 round
trips at its end, 1.3-1.6 us of 14-16 us on 8B down and 70B o at one row (H100, `bench/gemv.py
--diag`, BENCHMARKS.md). With it, 70B o at one row runs a 2-way split of 32 x 128 words in 14.6 us
against the counter table's 16.4 (82% of the copy bandwidth, H100, 2026-12-08); where the tuned
split is wider it loses (8B down 14.7 -> 14.8, 16 rows 8B o 10.1 -> 12.5), so gemv_w4 uses it only
for the shapes its Hopper table names, or when asked (cluster=True, HALFBYTE_SPLITK_CLUSTER=1).

How: Triton 3.6 compiles cluster layouts (num_ctas) for whole-cluster programs and cannot reduce
across CTAs, so the kernel is compiled as usual (one CTA a program) and only its launch is made a
cluster launch (shared_memory.launch_with_shared): the grid's x holds SPLIT_K consecutive programs
per output tile (`split_ids`), the cluster's rank is the split. The tail of the dynamic shared
memory (added at launch, found from %dynamic_smem_size, never Triton's scratch) holds rank 0's
buffer for the other splits' partials, then an mbarrier. Each sender stages its partial in its own
shared memory and sends every 16 bytes once by st.async, which counts them on rank 0's mbarrier
(complete_tx); rank 0 waits for (SPLIT_K - 1) tiles' bytes and sums, the senders exit at once.
Staging because Triton's layouts give several threads copies of an element and the byte count
must be exact. (Remote stores and a second cluster barrier instead were 14-150% slower, H100: the
barrier's release arrive compiles to MEMBAR.ALL.GPU.) PTX only (sm_90+): the interpreter has no
clusters; the GPU tests check it against the counter combine (bit-identical: the same fp32 sums in
the same order)."""

from __future__ import annotations

import functools
import os

import torch

from halfbyte.kernels.shared_memory import shared_tail
from halfbyte.kernels.triton_utils import HAS_TRITON, tl, triton

MAX_CLUSTER = 8  # the portable cluster size; 16 needs a non-portable opt-in per kernel
MBARRIER_BYTES = 16  # the tail's last bytes: rank 0's mbarrier


def cluster_wanted(device: torch.device, split_k: int, cluster: bool | None = None, tile_elems: int = 4) -> bool:
    """Whether a split-K launch combines through a cluster: asked for (None:
    HALFBYTE_SPLITK_CLUSTER=1, off by default), on sm_90+, 2-8 splits, a tile of tile_elems fp32
    in whole 16-byte sends (a multiple of 4)."""
    if cluster is None:
        cluster = os.environ.get("HALFBYTE_SPLITK_CLUSTER", "0") == "1"
    if not cluster or not 2 <= split_k <= MAX_CLUSTER or tile_elems % 4 or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return has_clusters(device)


def has_clusters(device: torch.device) -> bool:
    """Whether device is a GPU with thread-block clusters (Hopper, sm_90+)."""
    return device.type == "cuda" and _has_clusters(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_clusters(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def partial_bytes(split_k: int, block_m: int, block_n: int) -> int:
    """The tail a cluster launch adds: rank 0's buffer for the other splits' fp32 partials of one
    [block_m, block_n] tile, then the mbarrier."""
    return (split_k - 1) * block_m * block_n * 4 + MBARRIER_BYTES


if HAS_TRITON:

    @triton.jit
    def split_ids(CLUSTER: tl.constexpr, SPLIT_K: tl.constexpr):
        """(pid_n, pid_k) of a split-K launch: grid (tiles, splits) or, CLUSTER, (tiles x splits)
        with the splits of a tile consecutive (one cluster). CLUSTER also has rank 0's thread 0 set
        up the mbarrier (count 1: its own arrive) and every thread arrive at the cluster barrier's
        first phase, which cluster_combine waits on before touching another CTA."""
        if CLUSTER:
            p = tl.program_id(0)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 t, r, a; mov.u32 t, %tid.x; mov.u32 r, %cluster_ctarank; or.b32 t, t, r;"
                " setp.eq.u32 p, t, 0; mov.u32 a, global_smem; mov.u32 t, %dynamic_smem_size; add.u32 a, a, t;"
                " sub.u32 a, a, 16; @p mbarrier.init.shared::cta.b64 [a], 1; fence.mbarrier_init.release.cluster;"
                " barrier.cluster.arrive.relaxed; mov.u32 $0, 0; }", "=r,r", [p],
                dtype=tl.int32, is_pure=False, pack=1)
            return p // SPLIT_K, p % SPLIT_K
        else:
            return tl.program_id(0), tl.program_id(1)

    @triton.jit
    def _wait_acquire(dummy):
        """Wait for the cluster barrier's phase this thread arrived at."""
        tl.inline_asm_elementwise("barrier.cluster.wait.acquire;\nmov.u32 $0, 0;", "=r,r", [dummy],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _send_async(base, to, SLOT: tl.constexpr, MBAR: tl.constexpr):
        """SLOT bytes at shared base (this CTA) to base + to in rank 0 by st.async, 16 bytes per
        thread and step, each counted on rank 0's mbarrier at base + MBAR."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 i, step, src, dst, bar, d0, d1, d2, d3;"
            " mov.u32 i, %tid.x; shl.b32 i, i, 4; mov.u32 step, %ntid.x; shl.b32 step, step, 4;"
            " add.u32 bar, $1, $4; mapa.shared::cluster.u32 bar, bar, 0;"
            " SEND: setp.ge.u32 p, i, $3; @p bra SENT;"
            " add.u32 src, $1, i; ld.shared.v4.b32 {d0, d1, d2, d3}, [src];"
            " add.u32 dst, src, $2; mapa.shared::cluster.u32 dst, dst, 0;"
            " st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [dst], {d0, d1, d2, d3}, [bar];"
            " add.u32 i, i, step; bra SEND; SENT: mov.u32 $0, 0; }",
            "=r,r,r,r,r", [base, to, base * 0 + SLOT, base * 0 + MBAR], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _wait_bytes(bar, BYTES: tl.constexpr):
        """Rank 0: thread 0 arrives at the mbarrier at shared bar expecting BYTES; every thread
        waits for its phase 0 (the arrive and all the bytes), acquiring what they wrote."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;"
            " @p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$1], $2;"
            " WAIT: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 q, [$1], 0; @!q bra WAIT;"
            " mov.u32 $0, 0; }", "=r,r,r", [bar, bar * 0 + BYTES], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def cluster_combine(acc, out_ptr, offs, mask, pid_k, SPLIT_K: tl.constexpr):
        """Sum acc [BM, BN] fp32 over the SPLIT_K CTAs of this cluster (rank = pid_k) and store it
        at out_ptr + offs (mask) from rank 0. Every thread of every CTA gets here once."""
        BM: tl.constexpr = acc.shape[0]
        BN: tl.constexpr = acc.shape[1]
        SLOT: tl.constexpr = BM * BN * 4
        elem = (tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]) * 4
        # the last bytes of the dynamic shared memory: the partials, then the mbarrier
        base = shared_tail((SPLIT_K - 1) * SLOT + 16, pid_k)
        _wait_acquire(pid_k)  # phase 0 (arrived in split_ids): every CTA started, the mbarrier is set
        if pid_k > 0:  # staged in our own first slot (copies of an element write the same value)
            tl.inline_asm_elementwise("st.shared.f32 [$1], $2;\nmov.u32 $0, 0;", "=r,r,f", [base + elem, acc],
                                      dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()
            _send_async(base, (pid_k - 1) * SLOT, SLOT, (SPLIT_K - 1) * SLOT)
        else:
            _wait_bytes(base + (SPLIT_K - 1) * SLOT, (SPLIT_K - 1) * SLOT)
            total = acc
            for s in tl.static_range(1, SPLIT_K):
                total += tl.inline_asm_elementwise("ld.shared.f32 $0, [$1];", "=f,r", [base + (s - 1) * SLOT + elem],
                                                   dtype=tl.float32, is_pure=False, pack=1)
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    split_ids = cluster_combine = None
