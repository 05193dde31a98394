"""The split-K combine through a thread-block cluster (halfbyte/kernels/cluster.py).

On the GPU (sm_90+): gemv_w4 and gemm_w4 with the cluster combine against the counter combine
(bit-identical: the same fp32 partials summed in the same order), against the reference, with
gemv_w4's staged sub-tiles beside it in shared memory, and replayed from a CUDA graph. On the
CPU: the cluster kernels compile for sm_90 (ptxas accepts the PTX) and carry a cluster barrier,
st.async and an mbarrier instead of the counter atomics, the launch helper's argument order, and
the mode's guards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from halfbyte.kernels import cluster, gemm_w4, gemv_w4
from halfbyte.kernels.quant_matmul import quant_matmul_ref
from tests.kernel_testing import DEVICE, rel_err
from tests.test_kernels_quant_matmul import random_packed

HOPPER = DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="thread-block clusters need an sm_90+ GPU")


def _poisoned_next(n: int, m: int = 1) -> None:
    torch.empty(m, n, dtype=torch.float16, device=DEVICE).fill_(float("nan"))  # the allocator's next block


def _check_cluster_against_counter(matmul, n: int, k: int, m: int, seed: int, **kw) -> None:  # type: ignore[no-untyped-def]
    """matmul (gemv_w4 / gemm_w4) on fresh random [m, k] x [k, n] 4-bit g128: with the cluster
    combine within 1e-3 of the reference and bit-identical to the counter combine, the outputs'
    memory poisoned before each call."""
    group = 128
    qweight, scales, mins = random_packed(n, k, 4, group, seed=seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half().to(DEVICE)
    ref = quant_matmul_ref(x, qweight, scales, mins, 4, group)
    _poisoned_next(n, m)
    counter = matmul(x, qweight, scales, mins, group, cluster=False, **kw)
    _poisoned_next(n, m)
    clustered = matmul(x, qweight, scales, mins, group, cluster=True, **kw)
    assert rel_err(clustered, ref) <= 1e-3
    assert torch.equal(clustered, counter)


@needs_hopper
@pytest.mark.parametrize("split_k", [2, 3, 4, 8])
@pytest.mark.parametrize("pairs", [False, True])
def test_gemv_w4_cluster_combine(split_k: int, pairs: bool) -> None:
    # N 1000: the last column block partly past N
    _check_cluster_against_counter(gemv_w4.gemv_w4, 1000, 4096, 1, split_k, split_k=split_k, block_n=64, block_kw=16,
                                   pair_rows=pairs)


@needs_hopper
@pytest.mark.parametrize("m,split_k", [(2, 2), (5, 3), (16, 4), (16, 8)])
def test_gemm_w4_cluster_combine(m: int, split_k: int) -> None:
    _check_cluster_against_counter(gemm_w4.gemm_w4, 200, 4096, m, m, split_k=split_k, block_n=64, block_kw=16)


@needs_hopper
@pytest.mark.parametrize("stages", [2, 4])
def test_staged_tiles_with_the_cluster_combine(stages: int) -> None:
    """gemv_w4's staged one-tile path (its sub-tiles in shared memory before the partials' buffer)
    with the cluster combine, against the same staged path with the counter combine."""
    _check_cluster_against_counter(gemv_w4.gemv_w4, 1000, 4096, 1, stages, split_k=2, block_n=32, block_kw=256,
                                   pair_rows=True, one_tile=True, stages=stages)


@needs_hopper
def test_cluster_combine_in_a_cuda_graph() -> None:
    """Decode replays its GEMVs from CUDA graphs: the cluster launch must capture and replay
    (the mbarrier set up again each replay)."""
    n, k, group = 512, 2048, 128
    qweight, scales, mins = random_packed(n, k, 4, group, seed=7)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(7)).half().to(DEVICE)
    kw = dict(split_k=4, block_n=64, block_kw=16, cluster=True)
    gemv_w4.gemv_w4(x, qweight, scales, mins, group, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_w4.gemv_w4(x, qweight, scales, mins, group, **kw)
    for seed in (8, 9):
        x.copy_(torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).half())
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, gemv_w4.gemv_w4(x, qweight, scales, mins, group, split_k=4, block_n=64, block_kw=16,
                                                cluster=False))


# Run without Triton's interpreter (conftest turns it on for the CPU): the kernels as the GPU compiles them.
_OFFLINE = r"""
import inspect, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from halfbyte.kernels import gemm_w4, gemv_w4, shared_memory

def compile90(fn, sig, consts, warps, stages):
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))

use = sys.argv[1] != "counter"
stages = 4 if sys.argv[1] == "staged" else 1
ptrs = {"qw_ptr": "*i32", "scales_ptr": "*fp16", "mins_ptr": "*fp16", "out_ptr": "*fp16", "partial_ptr": "*fp32",
        "counter_ptr": "*i32"}
gemv = compile90(gemv_w4._gemv_w4_m1_kernel, {"x_ptr": "*fp16", **ptrs, "N": "i32", "K": "i32", "k_per_split": "i32"},
                 dict(GROUP=128, BLOCK_N=64, BLOCK_KW=32, SPLIT_K=8, PAIR_ROWS=True, USE_ASM=True, PDL=False, DIAG=0, ONE_TILE=stages > 1,
                      EARLY_SCALES=False, CLUSTER=use, STAGES=stages), 4, 2)
gemm = compile90(gemm_w4._gemm_w4_kernel, {"xp_ptr": "*fp16", **ptrs, "M": "i32", "N": "i32", "K": "i32",
                 "k_per_split": "i32"}, dict(GROUP=128, BLOCK_M=16, BLOCK_N=64, BLOCK_KW=16, SPLIT_K=4, USE_ASM=True,
                 X_SPLIT=True, PDL=False, DIAG=0, CLUSTER=use), 4, 3)
fn = gemv_w4._gemv_w4_m1_kernel
consts = dict(GROUP=128, BLOCK_N=64, BLOCK_KW=16, SPLIT_K=4, PAIR_ROWS=False, USE_ASM=True, PDL=False, DIAG=0,
              CLUSTER=True, num_warps=4)
values = shared_memory.bound_values(fn, tuple(range(10)), consts)
try:
    shared_memory.bound_values(fn, tuple(range(10)), {"BLOCK_N": 64})
    missing = ""
except TypeError as e:
    missing = str(e)
print(json.dumps({"ptx": [gemv.asm["ptx"], gemm.asm["ptx"]], "names": [p.name for p in fn.params],
                  "values": values, "missing": missing}))
"""


def _offline(variant: str) -> dict:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _OFFLINE, variant], capture_output=True, text=True,
                         env=env, cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("variant", ["counter", "cluster", "staged"])
def test_kernels_compile_for_sm90(variant: str) -> None:
    """Offline (no GPU needed; ptxas must accept the PTX): with CLUSTER the combine is a cluster
    barrier, st.async counted on an mbarrier and local loads, with no counter atomics left; without
    it, the counter combine; "staged" adds gemv_w4's cp.async sub-tiles (STAGES=4: four groups, waits
    from 3 down to 0). Also launch_with_shared's arguments: every parameter in kernel order,
    defaults filled in, a missing one named."""
    got = _offline(variant)
    use_cluster = variant != "counter"
    for ptx in got["ptx"]:
        assert ("barrier.cluster.wait" in ptx) == use_cluster
        assert ("st.async" in ptx) == ("mbarrier.try_wait" in ptx) == use_cluster
        assert ("atom." in ptx) == (not use_cluster)
    gemv_ptx = got["ptx"][0]
    assert gemv_ptx.count("cp.async.commit_group") == (4 if variant == "staged" else 0)
    assert all((f"cp.async.wait_group {n};" in gemv_ptx) == (variant == "staged") for n in range(4))
    values = dict(zip(got["names"], got["values"]))
    assert len(got["values"]) == len(got["names"]) and got["values"][:10] == list(range(10))
    assert values["ONE_TILE"] is False and values["CLUSTER"] is True  # a default; a given constexpr
    assert "missing argument 'GROUP'" in got["missing"]


def test_cluster_mode_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert not cluster.cluster_wanted(cpu, 4, True)  # no GPU
    monkeypatch.setenv("HALFBYTE_SPLITK_CLUSTER", "1")
    assert not cluster.cluster_wanted(cpu, 4)
    if HOPPER:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert cluster.cluster_wanted(DEVICE, 4) and cluster.cluster_wanted(DEVICE, 8, True, 64)
        assert not cluster.cluster_wanted(DEVICE, 4, True, 6)  # 16-byte sends need a tile of 4k fp32
        assert not cluster.cluster_wanted(DEVICE, 1, True)  # nothing to combine
        assert not cluster.cluster_wanted(DEVICE, 9, True)  # past the portable cluster size
        assert not cluster.cluster_wanted(DEVICE, 4, False)
    assert cluster.partial_bytes(8, 1, 64) == 7 * 64 * 4 + 16  # the partials, then the mbarrier
