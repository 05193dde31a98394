"""mma_w4 (4-bit tensor-core matmul for 1-16 rows on repacked weights) against the torch reference
on the original layout; the repack itself round-trips."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels import mma_w4
from halfbyte.kernels.quant_matmul import quant_matmul_ref
from tests.kernel_testing import DEVICE, poison, rel_err
from tests.test_kernels_quant_matmul import random_packed


def test_repack_round_trips_and_moves_every_value() -> None:
    qweight, _, _ = random_packed(40, 384, 4, 128, seed=5)
    packed = mma_w4.repack(qweight, 384, chunk=16)
    assert packed.shape == (40, 384 // 8) and packed.dtype == torch.int32
    assert torch.equal(mma_w4.unrepack(packed, 384), qweight)
    # nibble s of word w of row n is k = 128 b + 32 t + 8 i + 2 (s % 4) + s // 4 (the module docstring)
    from halfbyte.quant.packing import unpack

    orig = unpack(qweight.cpu(), 4, 384)  # [N, K]
    n, b, t, i, s = 7, 2, 3, 1, 6
    w = int(packed[n, 16 * b + 4 * t + i]) & 0xFFFFFFFF
    assert (w >> (4 * s)) & 15 == int(orig[n, 128 * b + 32 * t + 8 * i + 2 * (s % 4) + s // 4])


def test_repack_rejects_partial_blocks() -> None:
    qweight, _, _ = random_packed(8, 96, 4, 32, seed=1)
    with pytest.raises(ValueError, match="multiple of 128"):
        mma_w4.repack(qweight, 96)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k,group", [(96, 384, 128), (40, 256, 32), (200, 512, 64)])
def test_mma_w4(m: int, n: int, k: int, group: int) -> None:
    qweight, scales, mins = random_packed(n, k, 4, group, seed=m * 100 + n)
    packed = mma_w4.repack(qweight, k)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)) * 3).half().to(DEVICE)
    ref = quant_matmul_ref(x, qweight, scales, mins, 4, group)
    for warps, split_k in ((4, 1), (2, 2), (1, None), (8, 3)):
        out = poison(torch.empty(m, n, dtype=torch.float16, device=DEVICE))
        mma_w4.mma_w4(x, packed, scales, mins, group, num_warps=warps, split_k=split_k, out=out)
        assert not out.isnan().any(), (warps, split_k)
        assert rel_err(out, ref) <= 1e-3, (warps, split_k, rel_err(out, ref))


def test_mma_w4_large_activations() -> None:
    """|x| in the hundreds: the fp32 accumulation keeps the sums in range."""
    n, k, group = 64, 1024, 128
    qweight, scales, mins = random_packed(n, k, 4, group, seed=9)
    x = (torch.randn(2, k, generator=torch.Generator().manual_seed(3)) * 300).half().to(DEVICE)
    out = mma_w4.mma_w4(x, mma_w4.repack(qweight, k), scales, mins, group)
    assert rel_err(out, quant_matmul_ref(x, qweight, scales, mins, 4, group)) <= 1e-3


def test_mma_w4_declines_what_it_cannot_do() -> None:
    x = torch.zeros(1, 256, dtype=torch.float16)
    assert mma_w4.supports(x, 4, 128)
    assert not mma_w4.supports(x, 3, 128)
    assert not mma_w4.supports(torch.zeros(17, 256, dtype=torch.float16), 4, 128)
    assert not mma_w4.supports(torch.zeros(1, 192, dtype=torch.float16), 4, 64)
    assert not mma_w4.supports(x.float(), 4, 128)


@pytest.mark.parametrize("m", [1, 5, 17, 70])
def test_quant_linear_through_mma_w4(m: int) -> None:
    """A two-slice 4-bit layer held in the mma layout where it can be (one slice cannot) equals
    the reference at every row count. (On CUDA prepare_for_inference does this with
    HALFBYTE_W4_KERNEL=mma; here the repack is called directly so CI runs it too.)"""
    from halfbyte.model.quant_linear import QuantLinear
    from halfbyte.quant.qtensor import QuantSlice, QuantWeight

    n = 72
    q1, s1, m1 = random_packed(n, 256, 4, 64, seed=1)
    q2, s2, m2 = random_packed(n, 96, 4, 32, seed=2)  # 96: not whole 128-k blocks
    w = QuantWeight(n, 352, [QuantSlice(0, 256, 4, 64, q1, s1, m1), QuantSlice(256, 352, 4, 32, q2, s2, m2)])
    layer = QuantLinear(w, None, torch.float16)
    layer._repack_for_mma()
    assert layer.mma_packed[0] is not None and layer.mma_packed[1] is None
    assert w.slices[0].qweight.numel() == 0 and layer.qweight_0 is layer.mma_packed[0]
    x = torch.randn(m, 352, device=DEVICE).half()
    ref = quant_matmul_ref(x[:, :256], q1, s1, m1, 4, 64) + quant_matmul_ref(x[:, 256:], q2, s2, m2, 4, 32)
    assert rel_err(layer(x), ref) <= 1e-3


@pytest.mark.parametrize("m", [1, 20, 70])
def test_matmul_any_rows_and_dequantize(m: int) -> None:
    """Every row count through the mma layout alone: chunks of 16 up to 64 rows, then the
    dequantized W^T and a dense matmul; the dequantization equals the format's."""
    from halfbyte.kernels.quant_matmul import dequantize_ref

    n, k, group = 40, 256, 32
    qweight, scales, mins = random_packed(n, k, 4, group, seed=m)
    packed = mma_w4.repack(qweight, k)
    w_t = mma_w4.dequantize_t(packed, scales, mins, group, torch.float32)
    assert torch.allclose(w_t.t(), dequantize_ref(qweight, scales, mins, 4, group, k), rtol=1e-6, atol=1e-6)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().to(DEVICE)
    out = mma_w4.matmul(x, packed, scales, mins, group)
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert rel_err(out, quant_matmul_ref(x, qweight, scales, mins, 4, group)) <= 1e-3
