"""gemv_w4_i8 (x as int8 planes, integer dot products) against its torch references."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels import gemv_w4_i8
from halfbyte.kernels.quant_matmul import quant_matmul_ref
from tests.kernel_testing import DEVICE, rel_err
from tests.test_kernels_quant_matmul import random_packed


@pytest.mark.parametrize("k,group,scale", [(256, 128, 1.0), (576, 64, 300.0), (1536, 32, 1e-3)])
def test_quantize_x_matches_reference(k: int, group: int, scale: float) -> None:
    """Planes and scales bit for bit, row sums to fp32 rounding; x back from the planes to ~15 bits;
    a group of zeros (scale 0) stays zero."""
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(k)) * scale).half()
    x[0, :group] = 0
    x = x.to(DEVICE)
    ref = gemv_w4_i8.quantize_x_ref(x, group)
    for t in (torch.empty(k // 8, 4, dtype=torch.int32, device=DEVICE), torch.empty(k // 8, device=DEVICE)):
        t.fill_(-1)  # poison the allocator's next blocks
    got = gemv_w4_i8.quantize_x(x, group)
    assert torch.equal(got.planes, ref.planes) and torch.equal(got.scales, ref.scales)
    assert torch.allclose(got.row_sums, ref.row_sums, rtol=1e-5, atol=1e-6 * scale)
    back = gemv_w4_i8.dequantize_x(ref)
    assert rel_err(back, x) <= 2e-4
    assert back[0, :group].abs().max() == 0 and ref.scales[0] == 0
    # the a plane stays within +-63 and b within +-127: what the exact integer sums rely on
    a = ((ref.planes[:, :2].to(torch.int64)[..., None] >> (8 * torch.arange(4, device=DEVICE))) & 255)
    assert ((a < 64) | (a > 192)).all()


@pytest.mark.parametrize("n,k,group", [(96, 576, 64), (300, 1536, 32), (64, 4096, 128), (40, 384, 128)])
def test_gemv_w4_i8(n: int, k: int, group: int) -> None:
    """The GEMV (on the GPU its dp4a PTX) against the reference on the dequantized planes and on
    fp16 x; tiles inside one group and spanning several, split and unsplit K, a partial last tile."""
    qweight, scales, mins = random_packed(n, k, 4, group, seed=n + 3)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(k + 5)) * 4).half().to(DEVICE)
    assert gemv_w4_i8.supports(x, 4, group)
    xp = gemv_w4_i8.quantize_x(x, group)
    ref_planes = quant_matmul_ref(gemv_w4_i8.dequantize_x(xp), qweight, scales, mins, 4, group)
    ref_x = quant_matmul_ref(x, qweight, scales, mins, 4, group)
    for cfg in (dict(split_k=1, block_n=64, block_kw=8), dict(split_k=3, block_n=32, block_kw=16),
                dict(block_n=128, block_kw=32, num_warps=8), dict(split_k=2, block_n=64, block_kw=2)):
        torch.empty(1, n, dtype=torch.float16, device=DEVICE).fill_(float("nan"))  # poison the allocator's next block
        out = gemv_w4_i8.gemv_w4_i8_planes(xp, qweight, scales, mins, **cfg)
        assert out.dtype == torch.float16 and out.shape == (1, n)
        assert rel_err(out, ref_planes) <= 1e-3, (cfg, rel_err(out, ref_planes))
        assert rel_err(out, ref_x) <= 1e-3, (cfg, rel_err(out, ref_x))
    assert rel_err(gemv_w4_i8.gemv_w4_i8(x, qweight, scales, mins, group), ref_x) <= 1e-3
    with pytest.raises(ValueError, match="even"):
        gemv_w4_i8.gemv_w4_i8_planes(xp, qweight, scales, mins, block_kw=3)


def test_gemv_w4_i8_declines_what_it_cannot_do() -> None:
    x = torch.randn(1, 576).half()
    assert not gemv_w4_i8.supports(x, 4, 128)  # K not whole groups
    assert not gemv_w4_i8.supports(x, 4, 24)  # groups not whole word pairs
    assert not gemv_w4_i8.supports(torch.randn(2, 512).half(), 4, 128)
    assert not gemv_w4_i8.supports(torch.randn(1, 512).half(), 8, 128)


def test_quant_linear_takes_planes_from_the_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's seam: a 4-bit QuantLinear asks for x's planes only for one fp16 row on the GPU,
    and its output from the planes the RMSNorm wrote matches its output from x."""
    from halfbyte.kernels.rms_norm import rms_norm_planes
    from halfbyte.model.quant_linear import QuantLinear
    from halfbyte.quant.qtensor import QuantSlice, QuantWeight

    monkeypatch.setattr(gemv_w4_i8, "_ENV", "all")  # every supported shape, not only the tuned ones
    n, k, group = 96, 576, 64
    qweight, scales, mins = random_packed(n, k, 4, group, seed=17)
    bias = torch.randn(n).half().to(DEVICE)
    layer = QuantLinear(QuantWeight(n, k, [QuantSlice(0, k, 4, group, qweight, scales, mins)]), bias, torch.float16)
    x, w = (torch.randn(1, k, generator=torch.Generator().manual_seed(s)).half().to(DEVICE) for s in (1, 2))
    h, _, planes = rms_norm_planes(x, None, w, 1e-5, group)
    assert layer.x_planes_group(h) == (group if DEVICE.type == "cuda" else None)
    assert layer.x_planes_group(torch.cat([h, h])) is None  # two rows: gemm_w4's job
    ref = quant_matmul_ref(h, qweight, scales, mins, 4, group) + bias.float()
    assert rel_err(layer(h, planes), ref) <= 1e-3 and rel_err(layer(h), ref) <= 1e-3
    monkeypatch.setattr(gemv_w4_i8, "_ENV", "0")
    assert layer.x_planes_group(h) is None
