"""Split-K partials left to the consumer (kernels/split_sum.py): gemv_w4 with defer=True hands
back partials that add up to its own combined output, and RMSNorm(+residual) and SiLU-and-mul
given partials equal their references on the summed tensor. On the CPU the kernels run through
TRITON_INTERPRET=1 (set in conftest); on a GPU, natively."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels import gemv_w4
from halfbyte.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton
from halfbyte.kernels.quant_matmul import quant_matmul_ref
from halfbyte.kernels.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm_triton
from halfbyte.kernels.split_sum import SplitSum, resolve
from tests.kernel_testing import DEVICE, rel_err


def _partials(splits: int, rows: int, cols: int, seed: int) -> SplitSum:
    g = torch.Generator().manual_seed(seed)
    return SplitSum(torch.randn(splits, rows, cols, generator=g).to(DEVICE) / splits, torch.float16)


def test_total_sums_in_fp32_and_rounds_once() -> None:
    p = SplitSum(torch.tensor([[[2048.0, 1.0]], [[0.75, 0.5]], [[0.75, 0.25]]]), torch.float16)
    # 2049.5 rounds to 2050 in fp16 (spacing 2 there); rounding after each add would keep 2048
    assert p.total().tolist() == [[2050.0, 1.75]]
    assert p.shape == torch.Size([1, 2]) and resolve(p).dtype == torch.float16
    x = torch.ones(2, 3)
    assert resolve(x) is x


@pytest.mark.parametrize("splits", [2, 4])
def test_gemv_w4_deferred_partials_add_up_to_its_output(splits: int) -> None:
    n, k, group = 256, 512, 128
    g = torch.Generator().manual_seed(splits)
    x = torch.randn(1, k, generator=g).half().to(DEVICE)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32).to(DEVICE)
    scales = (torch.rand(k // group, n, generator=g) * 0.02).half().to(DEVICE)
    mins = (-torch.rand(k // group, n, generator=g) * 0.1).half().to(DEVICE)
    cfg = dict(split_k=splits, block_n=64, block_kw=8)
    combined = gemv_w4.gemv_w4(x, qweight, scales, mins, group, **cfg)
    deferred = gemv_w4.gemv_w4(x, qweight, scales, mins, group, defer=True, **cfg)
    assert isinstance(deferred, SplitSum) and deferred.partials.shape[0] == splits
    assert deferred.dtype == torch.float16 and deferred.shape == combined.shape
    assert rel_err(deferred.total(), combined) <= 2e-3  # one fp16 ulp at most (same fp32 sums)
    assert rel_err(deferred.total(), quant_matmul_ref(x, qweight, scales, mins, 4, group)) <= 1e-3
    single = gemv_w4.gemv_w4(x, qweight, scales, mins, group, defer=True, split_k=1, block_n=64, block_kw=8)
    assert isinstance(single, torch.Tensor)  # nothing to defer without a split


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_add_rms_norm_sums_the_partials(splits: int) -> None:
    x = _partials(splits, 2, 576, splits)
    r = torch.randn(2, 576, generator=torch.Generator().manual_seed(7)).half().to(DEVICE)
    w = (1 + 0.1 * torch.randn(576, generator=torch.Generator().manual_seed(8))).half().to(DEVICE)
    out, summed = rms_norm_triton(x, w, 1e-5, residual=r)
    ref_out, ref_sum = add_rms_norm_ref(x.total(), r, w, 1e-5)
    assert summed is not None and out.dtype == torch.float16
    assert rel_err(out, ref_out) <= 1e-3
    assert rel_err(summed, ref_sum) <= 1e-3
    # the dispatcher: Triton where it runs (a CUDA residual), else the reference on the sum
    out2, summed2 = add_rms_norm(x, r, w, 1e-5)
    assert rel_err(out2, ref_out) <= 1e-3 and rel_err(summed2, ref_sum) <= 1e-3


@pytest.mark.parametrize("splits", [1, 4])
def test_silu_and_mul_sums_the_partials(splits: int) -> None:
    gu = _partials(splits, 3, 2 * 1000, 10 + splits)
    ref = silu_and_mul_ref(gu.total())
    out = silu_and_mul_triton(gu)
    assert out.dtype == torch.float16 and out.shape == (3, 1000)
    assert rel_err(out, ref) <= 1e-3
    assert rel_err(silu_and_mul(gu), ref) <= 1e-3


def test_quant_linear_forward_split_equals_forward() -> None:
    """Where forward_split cannot defer (the CPU, a bias, several slices) it is forward."""
    from halfbyte.model.quant_linear import QuantLinear
    from halfbyte.quant.qtensor import QuantSlice, QuantWeight

    g = torch.Generator().manual_seed(3)
    n, k = 64, 128
    q = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32)
    s = QuantSlice(0, k, 4, 64, q, (torch.rand(2, n, generator=g) * 0.02).half(), (-torch.rand(2, n, generator=g) * 0.1).half())
    lin = QuantLinear(QuantWeight(n, k, [s], None), None, torch.float32)
    lin.prepare_for_inference(torch.device("cpu"))
    x = torch.randn(1, k, generator=g)
    y = lin.forward_split(x)
    assert isinstance(y, torch.Tensor) and torch.equal(y, lin(x))
