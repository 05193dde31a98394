"""Split-K combine through a Hopper thread-block cluster: the K splits of one output tile run as
the CTAs of one cluster and sum their fp32 partials in rank 0's shared memory (distributed
shared memory), instead of through global partials, a fence and a counter atomic.

Why: the counter combine (quant_gemv._write_out) costs each split-K GEMV ~3 serial L2 round
trips at its end, 1.3-1.6 us of 14-16 us on 8B down and 70B o at one row and 1.7-5.7 us at 16
rows (H100, `bench/gemv.py --diag`, BENCHMARKS.md). Here a split's partial goes to rank 0 by
remote shared-memory stores and one cluster barrier; rank 0 adds them in its own shared memory.

How: Triton 3.6 compiles cluster layouts (num_ctas) for whole-cluster programs and cannot reduce
across CTAs, so the kernel is compiled as usual (one CTA a program) and only its launch is made a
cluster launch (shared_memory.launch_with_shared): the grid's x holds SPLIT_K consecutive programs per output
tile (`split_ids`), the cluster's rank is the split. The partials' buffer is the last
(SPLIT_K - 1) * tile bytes of the dynamic shared memory, added to the kernel's own at launch and
found from %dynamic_smem_size, so it never overlaps Triton's scratch. PTX only (sm_90+): the
interpreter has no clusters; the GPU tests check it against the counter combine (bit-identical:
the same fp32 sums in the same order)."""

from __future__ import annotations

import functools
import os

import torch

from halfbyte.kernels.shared_memory import shared_tail
from halfbyte.kernels.triton_utils import HAS_TRITON, tl, triton

MAX_CLUSTER = 8  # the portable cluster size; 16 needs a non-portable opt-in per kernel


def cluster_wanted(device: torch.device, split_k: int, cluster: bool | None = None) -> bool:
    """Whether a split-K launch combines through a cluster: asked for (None:
    HALFBYTE_SPLITK_CLUSTER=1, an experiment, off by default), on sm_90+, 2-8 splits."""
    if cluster is None:
        cluster = os.environ.get("HALFBYTE_SPLITK_CLUSTER", "0") == "1"
    if not cluster or not 2 <= split_k <= MAX_CLUSTER or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return device.type == "cuda" and _has_clusters(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_clusters(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def partial_bytes(split_k: int, block_m: int, block_n: int) -> int:
    """Rank 0's buffer for the other splits' fp32 partials of one [block_m, block_n] tile."""
    return (split_k - 1) * block_m * block_n * 4


if HAS_TRITON:

    @triton.jit
    def split_ids(CLUSTER: tl.constexpr, SPLIT_K: tl.constexpr):
        """(pid_n, pid_k) of a split-K launch: grid (tiles, splits) or, CLUSTER, (tiles x splits)
        with the splits of a tile consecutive (one cluster). CLUSTER also arrives at the cluster
        barrier's first phase, which cluster_combine waits on before touching another CTA."""
        if CLUSTER:
            p = tl.program_id(0)
            tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed;\nmov.u32 $0, 0;", "=r,r", [p],
                                      dtype=tl.int32, is_pure=False, pack=1)
            return p // SPLIT_K, p % SPLIT_K
        else:
            return tl.program_id(0), tl.program_id(1)

    @triton.jit
    def _arrive_release(dummy):
        """Arrive at the cluster barrier, this thread's shared-memory writes visible to its waiters."""
        tl.inline_asm_elementwise("barrier.cluster.arrive.release;\nmov.u32 $0, 0;", "=r,r", [dummy],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _wait_acquire(dummy):
        """Wait for the cluster barrier's phase this thread arrived at."""
        tl.inline_asm_elementwise("barrier.cluster.wait.acquire;\nmov.u32 $0, 0;", "=r,r", [dummy],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def cluster_combine(acc, out_ptr, offs, mask, pid_k, SPLIT_K: tl.constexpr):
        """Sum acc [BM, BN] fp32 over the SPLIT_K CTAs of this cluster (rank = pid_k) and store it
        at out_ptr + offs (mask) from rank 0. Every thread of every CTA gets here once."""
        BM: tl.constexpr = acc.shape[0]
        BN: tl.constexpr = acc.shape[1]
        SLOT: tl.constexpr = BM * BN * 4
        elem = (tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]) * 4
        base = shared_tail((SPLIT_K - 1) * SLOT, pid_k)  # the last bytes of the dynamic shared memory
        _wait_acquire(pid_k)  # phase 0 (arrived in split_ids): every CTA has started
        if pid_k > 0:
            addr = base + (pid_k - 1) * SLOT + elem
            tl.inline_asm_elementwise(
                "{ .reg .u32 r; mapa.shared::cluster.u32 r, $1, 0; st.shared::cluster.f32 [r], $2; mov.u32 $0, 0; }",
                "=r,r,f", [addr, acc], dtype=tl.int32, is_pure=False, pack=1)
            _arrive_release(pid_k)  # phase 1: our partial is in rank 0; exiting is allowed
        else:
            _arrive_release(pid_k)
            _wait_acquire(pid_k)  # phase 1 done: every partial is in our shared memory
            total = acc
            for s in tl.static_range(1, SPLIT_K):
                total += tl.inline_asm_elementwise("ld.shared.f32 $0, [$1];", "=f,r", [base + (s - 1) * SLOT + elem],
                                                   dtype=tl.float32, is_pure=False, pack=1)
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    split_ids = cluster_combine = None
