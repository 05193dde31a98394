"""The CUDA 4-bit tensor-core matmul (kernels/w4_mma.py, cuda/w4_mma.cu) against its torch
reference. It runs only on a GPU where nvcc can build it; elsewhere these tests are skipped (not
run), and the plan arithmetic is checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels import w4_mma
from halfbyte.kernels.quant_matmul import quant_matmul_ref
from tests.kernel_testing import poison, rel_err
from tests.test_kernels_quant_matmul import random_packed

GPU = torch.cuda.is_available() and w4_mma.available(torch.device("cuda"))
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (compute capability >= 8.0) and nvcc")


@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (28672, 4096, 128), (4096, 14336, 128), (960, 576, 32),
                                       (576, 1536, 64), (192, 4160, 128)])
def test_plan_covers_k_in_whole_groups(n: int, k: int, group: int) -> None:
    split, k_per_warp = w4_mma.plan(n, k, group, sms=132)
    assert k_per_warp % max(group, w4_mma.STEP_K) == 0
    assert split * w4_mma.WARPS * k_per_warp >= k > (split - 1) * w4_mma.WARPS * k_per_warp
    assert (n // w4_mma.COLS) * split <= 2 * 4 * 132 or k_per_warp >= k  # at most ~two waves


def test_cpu_tensors_are_not_supported() -> None:
    x = torch.randn(1, 256).half()
    qweight, scales, mins = random_packed(64, 256, 4, 128, seed=0)
    assert not w4_mma.supports(x, 4, 128, qweight.cpu(), scales.cpu(), mins.cpu())


@needs_gpu
@pytest.mark.parametrize("depth", w4_mma.DEPTHS)
@pytest.mark.parametrize("m,n,k,group", [(1, 4096, 4096, 128), (1, 960, 576, 32), (1, 576, 1536, 64), (2, 192, 4160, 128),
                                         (5, 320, 2048, 64), (8, 1024, 1024, 128), (9, 128, 576, 32), (16, 6144, 4096, 128)])
def test_w4_mma(depth: int, m: int, n: int, k: int, group: int) -> None:
    qweight, scales, mins = random_packed(n, k, 4, group, seed=m * 131 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)).half().cuda()
    assert w4_mma.supports(x, 4, group, qweight, scales, mins)
    ref = quant_matmul_ref(x, qweight, scales, mins, 4, group)
    unit = max(group, w4_mma.STEP_K)
    for k_per_warp in (None, unit, 4 * unit):
        out = poison(torch.empty(m, n, dtype=torch.float16, device="cuda"))
        w4_mma.w4_mma(x, qweight, scales, mins, group, k_per_warp=k_per_warp, depth=depth, out=out)
        assert rel_err(out, ref) <= 1e-3, (k_per_warp, rel_err(out, ref))
    # the split-K counters reset themselves: a second call gives the same answer
    assert torch.equal(w4_mma.w4_mma(x, qweight, scales, mins, group, k_per_warp=unit, depth=depth),
                       w4_mma.w4_mma(x, qweight, scales, mins, group, k_per_warp=unit, depth=depth))


@needs_gpu
def test_large_activations() -> None:
    """The kernel sums 1032 x per value (the unbiased codes) before removing it per group: channels
    of x in the hundreds (as some models' MLP inputs have) must still come out within 1e-3."""
    m, n, k, group = 1, 2048, 4096, 128
    qweight, scales, mins = random_packed(n, k, 4, group, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randperm(k, generator=g)[:16]] *= 300.0
    x = x.half().cuda()
    ref = quant_matmul_ref(x, qweight, scales, mins, 4, group)
    assert rel_err(w4_mma.w4_mma(x, qweight, scales, mins, group), ref) <= 1e-3


@needs_gpu
def test_graphed_chain_with_pdl() -> None:
    """Chained calls (each one's output the next one's input) replayed from a CUDA graph, where
    programmatic dependent launch lets each kernel start before the previous one ends, equal
    the same chain run eagerly, bit for bit."""
    n = k = 1024
    weights = [random_packed(n, k, 4, 128, seed=s) for s in range(6)]
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(9)) * 0.1).half().cuda()

    def chain(v: torch.Tensor) -> torch.Tensor:
        for qw, s, mn in weights:
            v = w4_mma.w4_mma(v, qw, s, mn, 128) * 0.05
        return v

    eager = chain(x)
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(eager).all()
    assert torch.equal(static_out, eager)
