"""Round-to-nearest and GPTQ quantization into the halfbyte format."""

from __future__ import annotations

import pytest
import torch

from halfbyte.errors import QuantizationError
from halfbyte.quant import HessianAccumulator, gptq_quantize, quantize_rtn, unpack


def _correlated_activations(tokens: int, k: int, rank: int, seed: int) -> torch.Tensor:
    """X = Z A + small noise: features correlate, as real layer inputs do."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, rank, generator=g)
    a = torch.randn(rank, k, generator=g)
    scale = torch.rand(k, generator=g) * 2 + 0.1  # uneven feature energy, so act_order matters
    return (z @ a + 0.1 * torch.randn(tokens, k, generator=g)) * scale


def _hessian(x: torch.Tensor, batch: int = 300) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    for chunk in x.split(batch):
        acc.add_batch(chunk)
    assert acc.num_samples == x.shape[0]
    return acc.hessian


def _q(w) -> torch.Tensor:
    s = w.slices[0]
    return unpack(s.qweight, s.bits, s.width)


@pytest.fixture(scope="module")
def layer() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _correlated_activations(2048, 256, rank=48, seed=11)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(12)) * 0.05
    return w, x, _hessian(x)


def test_hessian_accumulator_running_mean() -> None:
    x = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    h = _hessian(x.reshape(10, 100, 64).reshape(-1, 64), batch=137)
    torch.testing.assert_close(h, 2 * x.double().t() @ x.double() / 1000, rtol=1e-5, atol=1e-4, check_dtype=False)
    acc = HessianAccumulator(64)
    acc.add_batch(x.reshape(10, 100, 64))  # leading dims are all tokens
    torch.testing.assert_close(acc.hessian, h, rtol=1e-5, atol=1e-4)
    with pytest.raises(QuantizationError):
        acc.add_batch(torch.zeros(3, 63))


@pytest.mark.parametrize("symmetric", [False, True])
def test_rtn_error_decreases_with_bits(symmetric: bool) -> None:
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    errors = [float((quantize_rtn(w, b, 128, symmetric).dequantize() - w).norm()) for b in (2, 3, 4, 5, 6, 8)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] / float(w.norm()) < 0.01


@pytest.mark.parametrize("group_size", [32, 64, 128, 576])
def test_rtn_rounds_to_nearest_grid_point(group_size: int) -> None:
    w = torch.randn(16, 576, generator=torch.Generator().manual_seed(group_size))
    qw = quantize_rtn(w, 4, group_size)
    s = qw.slices[0]
    assert qw.perm is None and s.num_groups == -(-576 // group_size)
    group = torch.arange(576) // group_size
    step = s.scales.float().t()[:, group]
    # asymmetric min/max grid covers the group, so every value is within half a step (+ fp16 slack)
    assert bool(((qw.dequantize() - w).abs() <= step / 2 + 1e-3 * w.abs().max()).all())


def test_rtn_constant_group_is_exact() -> None:
    w = torch.full((4, 64), 0.25)
    assert torch.equal(quantize_rtn(w, 2, 32).dequantize(), w)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_output_error(layer, bits: int, act_order: bool) -> None:
    w, x, h = layer
    ref = x @ w.t()
    rtn = quantize_rtn(w, bits, 64)
    gq, loss = gptq_quantize(w, h, bits, 64, act_order=act_order)
    assert (gq.perm is not None) == act_order
    err_rtn = float((ref - rtn.matmul(x)).norm())
    err_gptq = float((ref - gq.matmul(x)).norm())
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    # the documented loss: ||X W^T - X Wq^T||^2 / n with the undamped Hessian
    assert loss == pytest.approx(err_gptq**2 / x.shape[0], rel=1e-3)


def test_gptq_symmetric_beats_rtn_symmetric(layer) -> None:
    w, x, h = layer
    ref = x @ w.t()
    rtn = quantize_rtn(w, 3, 128, symmetric=True)
    gq, _ = gptq_quantize(w, h, 3, 128, symmetric=True)
    assert float((ref - gq.matmul(x)).norm()) < 0.8 * float((ref - rtn.matmul(x)).norm())
    # symmetric: mins are exactly -2^(bits-1) * scales
    s = gq.slices[0]
    assert torch.equal(s.mins.float(), -4 * s.scales.float())


def test_act_order_helps_with_uneven_inputs(layer) -> None:
    # features have very different energies, the case act_order exists for
    w, x, h = layer
    ref = x @ w.t()
    plain, _ = gptq_quantize(w, h, 3, 64)
    ordered, _ = gptq_quantize(w, h, 3, 64, act_order=True)
    assert float((ref - ordered.matmul(x)).norm()) < 0.8 * float((ref - plain.matmul(x)).norm())


def test_act_order_groups_are_contiguous_in_permuted_order(layer) -> None:
    w, x, h = layer
    gq, _ = gptq_quantize(w, h, 4, 32, act_order=True)
    perm = gq.perm.long()
    assert torch.equal(torch.sort(perm).values, torch.arange(256))
    # largest Hessian diagonal first
    diag = torch.diag(h)[perm]
    assert bool((diag[:-1] >= diag[1:]).all())
    torch.testing.assert_close(gq.matmul(x), x @ gq.dequantize().t(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, 256])
def test_gptq_identity_hessian_is_rtn(group_size: int, symmetric: bool) -> None:
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(group_size))
    rtn = quantize_rtn(w, 3, group_size, symmetric)
    gq, _ = gptq_quantize(w, torch.eye(256), 3, group_size, symmetric=symmetric, block_size=64)
    assert torch.equal(_q(gq), _q(rtn))
    assert torch.equal(gq.slices[0].scales, rtn.slices[0].scales)
    assert torch.equal(gq.slices[0].mins, rtn.slices[0].mins)


def test_gptq_block_size_does_not_change_much(layer) -> None:
    # lazy block updates are an exact reordering of the same arithmetic
    w, _, h = layer
    a, loss_a = gptq_quantize(w, h, 4, 64, block_size=32)
    b, loss_b = gptq_quantize(w, h, 4, 64, block_size=256)
    assert float((_q(a) != _q(b)).float().mean()) < 0.01
    assert loss_a == pytest.approx(loss_b, rel=0.02)


def test_gptq_dead_inputs(layer) -> None:
    w, x, _ = layer
    x = x.clone()
    x[:, ::7] = 0  # these inputs never fire
    h = _hessian(x)
    gq, loss = gptq_quantize(w, h, 3, 64, act_order=True)
    err = float((x @ w.t() - gq.matmul(x)).norm())
    assert loss == pytest.approx(err**2 / x.shape[0], rel=1e-3)
    assert err < 0.8 * float((x @ w.t() - quantize_rtn(w, 3, 64).matmul(x)).norm())


def test_gptq_rank_deficient_hessian_is_rescued_by_damping() -> None:
    x = _correlated_activations(64, 128, rank=8, seed=3)  # H has rank <= 64 < K
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(4))
    gq, loss = gptq_quantize(w, _hessian(x), 4, 32)
    assert torch.isfinite(gq.dequantize()).all() and loss >= 0


@pytest.mark.parametrize(
    "hessian,match",
    [
        (-torch.eye(64), "positive definite"),
        (torch.full((64, 64), float("nan")), "NaN"),
        (torch.eye(32), r"\[64, 64\]"),
    ],
)
def test_gptq_rejects_bad_hessian(hessian: torch.Tensor, match: str) -> None:
    with pytest.raises(QuantizationError, match=match):
        gptq_quantize(torch.randn(8, 64), hessian, 4, 32)


@pytest.mark.parametrize("bits,group_size,k", [(7, 32, 64), (4, 48, 96), (4, 32, 48)])
def test_bad_quantization_arguments(bits: int, group_size: int, k: int) -> None:
    w = torch.randn(8, k)
    with pytest.raises(QuantizationError):
        quantize_rtn(w, bits, group_size)
    with pytest.raises(QuantizationError):
        gptq_quantize(w, torch.eye(k), bits, group_size)
