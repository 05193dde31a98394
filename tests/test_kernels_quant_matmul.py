"""Quantized matmul (Triton) against its torch reference for every bit width, on random packed
words (any int32 pattern is a valid packing), random scales and mins."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels import gemv_w2, gemv_w4
from halfbyte.kernels.quant_gemv import gemv_triton
from halfbyte.kernels.quant_matmul import dequantize_ref, dequantize_t_triton, quant_matmul_ref, quant_matmul_triton
from tests.kernel_testing import DEVICE, rel_err


def random_packed(n: int, k: int, bits: int, group: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 32 * bits, n), generator=g, dtype=torch.int64).to(torch.int32)
    groups = -(-k // group)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.001).half()
    mins = (-torch.rand(groups, n, generator=g) * 0.1).half()
    return qweight.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m,n,k,group", [(1, 96, 576, 128), (3, 64, 256, 32), (16, 40, 1536, 64)])
def test_quant_matmul(bits: int, m: int, n: int, k: int, group: int) -> None:
    qweight, scales, mins = random_packed(n, k, bits, group, seed=bits * 1000 + m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(bits + k)).half().to(DEVICE)
    ref = quant_matmul_ref(x, qweight, scales, mins, bits, group)
    for split_k in (1, 3, None):
        out = quant_matmul_triton(x, qweight, scales, mins, bits, group, split_k=split_k)
        assert rel_err(out, ref) <= 1e-3, (split_k, rel_err(out, ref))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("m,n,k,group", [(1, 96, 576, 128), (1, 300, 1536, 32), (4, 64, 4096, 64), (16, 130, 576, 32)])
def test_gemv(bits: int, m: int, n: int, k: int, group: int) -> None:
    qweight, scales, mins = random_packed(n, k, bits, group, seed=bits * 7 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).half().to(DEVICE)
    ref = quant_matmul_ref(x, qweight, scales, mins, bits, group)
    configs = ((1, 64, 4), (3, 128, 8), (None, 256, 16)) if m == 1 else ((1, 64, 4), (3, 128, 8), (None, None, None))
    for split_k, block_n, block_kw in configs:
        out = gemv_triton(x, qweight, scales, mins, bits, group, split_k=split_k, block_n=block_n, block_kw=block_kw)
        assert out.dtype == x.dtype
        assert rel_err(out, ref) <= 1e-3, (split_k, block_n, rel_err(out, ref))
    if m == 1:  # the other single-row formulation (3-D tiles)
        out = gemv_triton(x, qweight, scales, mins, bits, group, split_k=3, block_n=128, block_kw=8, unroll=False)
        assert rel_err(out, ref) <= 1e-3
    # the split-K counters reset themselves: a second call gives the same answer
    again = gemv_triton(x, qweight, scales, mins, bits, group, split_k=3, block_n=128, block_kw=8)
    assert rel_err(again, ref) <= 1e-3


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_dequantize_t(bits: int) -> None:
    n, k, group = 72, 576, 64
    qweight, scales, mins = random_packed(n, k, bits, group, seed=bits)
    out = dequantize_t_triton(qweight, scales, mins, bits, group, k, torch.float16)
    assert rel_err(out.t(), dequantize_ref(qweight, scales, mins, bits, group, k)) <= 1e-3


@pytest.mark.parametrize("n,k,group", [(96, 576, 128), (300, 1536, 32), (64, 4096, 64)])
def test_gemv_w4(n: int, k: int, group: int) -> None:
    """The fp16x2 4-bit kernel for one row (on the GPU its PTX path) against the reference, poisoned outputs."""
    qweight, scales, mins = random_packed(n, k, 4, group, seed=n + 1)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k + 1)).half().to(DEVICE)
    assert gemv_w4.supports(x, 4, group)
    ref = quant_matmul_ref(x, qweight, scales, mins, 4, group)
    # pair_rows: two word rows per fp32 conversion (16 products summed in fp16)
    for split_k, block_n, block_kw, pairs in ((1, 64, 8, False), (3, 128, 16, False), (None, None, None, False),
                                              (1, 64, 8, True), (3, 32, 16, True), (None, 64, 32, True)):
        torch.empty(1, n, dtype=x.dtype, device=DEVICE).fill_(float("nan"))  # poison the allocator's next block
        out = gemv_w4.gemv_w4(x, qweight, scales, mins, group, split_k=split_k, block_n=block_n, block_kw=block_kw,
                              pair_rows=pairs)
        assert out.dtype == torch.float16 and out.shape == (1, n)
        assert rel_err(out, ref) <= 1e-3, (split_k, block_n, pairs, rel_err(out, ref))
    # one_tile: each split one tile (the last one partly past K where 128 does not divide it), no loop;
    # early_scales: the tile's scales requested before the PDL wait (tiles in one group and spanning several)
    for block_kw, pairs, early in ((8, False, False), (16, False, False), (16, True, False), (32, True, False),
                                   (8, False, True), (32, False, True), (16, True, True), (32, True, True)):
        torch.empty(1, n, dtype=x.dtype, device=DEVICE).fill_(float("nan"))  # poison the allocator's next block
        out = gemv_w4.gemv_w4(x, qweight, scales, mins, group, split_k=-(-k // (8 * block_kw)), block_n=64,
                              block_kw=block_kw, pair_rows=pairs, one_tile=True, early_scales=early)
        assert rel_err(out, ref) <= 1e-3, (block_kw, pairs, early, rel_err(out, ref))
    # stages: the one tile as sub-tiles, the later ones through shared memory by cp.async on the GPU
    # (plain loads in the interpreter), each dotted in turn; sub-tiles past K read as zeros
    for block_kw, stages in ((16, 2), (32, 2), (32, 4)):
        if n % 4:
            break
        torch.empty(1, n, dtype=x.dtype, device=DEVICE).fill_(float("nan"))  # poison the allocator's next block
        out = gemv_w4.gemv_w4(x, qweight, scales, mins, group, split_k=-(-k // (8 * block_kw)), block_n=64,
                              block_kw=block_kw, pair_rows=True, one_tile=True, stages=stages)
        assert rel_err(out, ref) <= 1e-3, (block_kw, stages, rel_err(out, ref))
    with pytest.raises(ValueError, match="even block_kw"):
        gemv_w4.gemv_w4(x, qweight, scales, mins, group, block_kw=3, pair_rows=True)
    with pytest.raises(ValueError, match="one_tile"):
        gemv_w4.gemv_w4(x, qweight, scales, mins, group, split_k=1, block_kw=8, one_tile=True)


@pytest.mark.parametrize("n,k,group", [(96, 576, 128), (300, 1536, 32), (64, 4096, 64), (40, 544, 32)])
def test_gemv_w2(n: int, k: int, group: int) -> None:
    """The fp16x2 2-bit kernel for one row (on the GPU its PTX path) against the reference, poisoned
    outputs: splits of whole tiles, of part tiles, none; last groups short of the group size."""
    qweight, scales, mins = random_packed(n, k, 2, group, seed=n + 2)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k + 2)).half().to(DEVICE)
    assert gemv_w2.supports(x, 2, group)
    ref = quant_matmul_ref(x, qweight, scales, mins, 2, group)
    for split_k, block_n, block_kw, warps in ((1, 64, 8, 4), (3, 128, 16, 4), (None, None, None, None),
                                              (2, 32, 4, 1), (5, 256, 32, 8)):
        torch.empty(1, n, dtype=x.dtype, device=DEVICE).fill_(float("nan"))  # poison the allocator's next block
        cfg = {} if block_n is None else dict(block_n=block_n, block_kw=block_kw, num_warps=warps)
        out = gemv_w2.gemv_w2(x, qweight, scales, mins, group, split_k=split_k, **cfg)
        assert out.dtype == torch.float16 and out.shape == (1, n)
        assert rel_err(out, ref) <= 1e-3, (split_k, block_n, rel_err(out, ref))
    # large activations: 16 products of |q - 2| <= 2 summed in fp16 stay finite and accurate
    big = x * 300
    assert rel_err(gemv_w2.gemv_w2(big, qweight, scales, mins, group), quant_matmul_ref(big, qweight, scales, mins, 2, group)) <= 1e-3


def test_gemv_w2_declines_what_it_cannot_do() -> None:
    x = torch.randn(1, 512).half()
    assert gemv_w2.supports(x, 2, 32)
    assert not gemv_w2.supports(x.float(), 2, 32)  # fp16 only
    assert not gemv_w2.supports(x, 4, 32)  # gemv_w4's
    assert not gemv_w2.supports(torch.randn(2, 512).half(), 2, 32)  # one row
    assert not gemv_w2.supports(torch.randn(1, 513).half()[:, 1:], 2, 32)  # misaligned view


def test_quant_matmul_sends_one_2_bit_row_to_gemv_w2_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from halfbyte.kernels import quant_matmul as qm

    calls: list[int] = []
    real = gemv_w2.gemv_w2
    monkeypatch.setattr(gemv_w2, "gemv_w2", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    qweight, scales, mins = random_packed(64, 512, 2, 32, seed=3)
    x = torch.randn(1, 512).half().to(DEVICE)
    ref = quant_matmul_ref(x, qweight, scales, mins, 2, 32)
    monkeypatch.setattr(qm, "use_triton", lambda t: True)  # the dispatch as on a GPU, in the interpreter here
    monkeypatch.setenv("HALFBYTE_GEMV_W2", "0")
    assert rel_err(qm.quant_matmul(x, qweight, scales, mins, 2, 32), ref) <= 1e-3 and calls == []
    monkeypatch.setenv("HALFBYTE_GEMV_W2", "1")
    assert rel_err(qm.quant_matmul(x, qweight, scales, mins, 2, 32), ref) <= 1e-3 and calls == [1]


def test_gemv_w4_declines_what_it_cannot_do() -> None:
    x = torch.randn(1, 576).half()
    assert not gemv_w4.supports(x.float(), 4, 128)  # fp16 only
    assert not gemv_w4.supports(x, 3, 128)
    assert not gemv_w4.supports(torch.randn(2, 576).half(), 4, 64)  # several rows: gemm_w4
    assert not gemv_w4.supports(torch.randn(1, 577).half()[:, 1:], 4, 128)  # misaligned view


@pytest.mark.parametrize("m,n,k,group", [(2, 96, 256, 128), (16, 130, 512, 64), (29, 64, 1024, 256), (64, 200, 384, 32)])
def test_gemm_w4(m: int, n: int, k: int, group: int) -> None:
    """The tensor-core 4-bit kernel for 2-64 rows (on the GPU its PTX path) against the
    reference, outputs poisoned; tiles inside one group and spanning several, split and unsplit K, rows over one or several programs,
    x permuted first or split into planes in the kernel."""
    from halfbyte.kernels import gemm_w4

    qweight, scales, mins = random_packed(n, k, 4, group, seed=n + m + 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m + 1)).half().to(DEVICE)
    assert gemm_w4.supports(x, 4, group)
    ref = quant_matmul_ref(x, qweight, scales, mins, 4, group)
    for split_k, block_n, block_kw, block_m, x_split in ((1, 64, 16, None, False), (2, 32, 16, 16, True),
                                                         (None, None, 32, None, True), (None, 128, None, 16, False)):
        if k % (8 * block_kw if block_kw else 128):
            continue
        torch.empty(m, n, dtype=x.dtype, device=DEVICE).fill_(float("nan"))  # poison the allocator's next block
        out = gemm_w4.gemm_w4(x, qweight, scales, mins, group, split_k=split_k, block_n=block_n, block_kw=block_kw,
                              block_m=block_m, x_split=x_split)
        assert out.dtype == torch.float16 and out.shape == (m, n)
        assert rel_err(out, ref) <= 1e-3, (split_k, block_n, block_kw, block_m, x_split, rel_err(out, ref))


def test_gemm_w4_declines_what_it_cannot_do() -> None:
    from halfbyte.kernels import gemm_w4

    qweight, scales, mins = random_packed(64, 576, 4, 64, seed=3)
    with pytest.raises(ValueError, match="gemm_w4"):  # 576 is not a whole number of 128-k tiles
        gemm_w4.gemm_w4(torch.randn(4, 576).half().to(DEVICE), qweight, scales, mins, 64)
    assert not gemm_w4.supports(torch.randn(1, 512).half(), 4, 128)  # one row: gemv_w4's job
    assert not gemm_w4.supports(torch.randn(4, 512), 4, 128)  # fp16 only
    assert not gemm_w4.supports(torch.randn(4, 512).half(), 3, 128)
