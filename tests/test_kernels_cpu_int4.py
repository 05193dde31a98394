"""torch's packed int4 CPU kernel (kernels/cpu_int4.py) against the fp32 reference of the format."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels import cpu_int4
from halfbyte.kernels.quant_matmul import quant_matmul_ref
from halfbyte.model.quant_linear import QuantLinear
from halfbyte.quant.qtensor import QuantSlice, QuantWeight
from tests.kernel_testing import rel_err
from tests.test_kernels_quant_matmul import random_packed

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="this torch has no int4 CPU kernel")


@pytest.mark.parametrize("m,n,k,group", [(1, 96, 576, 32), (3, 960, 576, 32), (2, 64, 1024, 128), (5, 48, 512, 64),
                                         # from DENSE_ROWS rows on: dequantized to bf16 + dense matmul
                                         (cpu_int4.DENSE_ROWS, 96, 576, 32), (200, 48, 512, 256)])
def test_int4_matmul_cpu_matches_reference(m: int, n: int, k: int, group: int) -> None:
    qweight, scales, mins = (t.cpu() for t in random_packed(n, k, 4, group, seed=n + k))  # a CPU kernel
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + n))
    ref = quant_matmul_ref(x, qweight, scales, mins, 4, group)
    out = cpu_int4.int4_matmul_cpu(x, cpu_int4.pack_for_cpu(qweight, scales, mins, group, k))
    assert out.shape == (m, n)
    # bf16 activations, scales and output: rounding of x alone costs ~2.5e-3 here
    assert rel_err(out, ref) <= 6e-3
    # and the wrong zero (m instead of m + 8s) would be far off: the check can fail
    wrong = cpu_int4.pack_for_cpu(qweight, scales, mins - 8 * scales.float(), group, k)
    assert rel_err(cpu_int4.int4_matmul_cpu(x, wrong), ref) > 0.05


@pytest.mark.parametrize("n,k,group", [(96, 576, 32), (48, 512, 256)])
def test_dequantize_t_is_the_int4_kernels_weight(n: int, k: int, group: int) -> None:
    """The dense path's bf16 W^T against the format's fp32 dequantization (one bf16 rounding),
    and the two CPU paths against each other on the same rows."""
    qweight, scales, mins = (t.cpu() for t in random_packed(n, k, 4, group, seed=n * k))
    w = cpu_int4.pack_for_cpu(qweight, scales, mins, group, k)
    eye = torch.eye(k)
    ref_t = quant_matmul_ref(eye, qweight, scales, mins, 4, group)  # [K, N] = W^T in fp32
    dense_t = cpu_int4.dequantize_t(w)
    assert dense_t.dtype == torch.bfloat16 and dense_t.shape == (k, n)
    assert rel_err(dense_t, ref_t) <= 4e-3  # bf16 scales and zeros, one rounding of each weight
    x = torch.randn(cpu_int4.DENSE_ROWS - 1, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, group, w.scales_and_zeros)
    assert rel_err(torch.mm(x, dense_t), kernel) <= 6e-3


def test_supports_only_what_the_kernel_takes() -> None:
    assert cpu_int4.supports(4, 32, 576, 960)
    assert not cpu_int4.supports(3, 32, 576, 960)
    assert not cpu_int4.supports(4, 32, 576, 40)  # N must be a multiple of 16
    assert not cpu_int4.supports(4, 128, 576, 960)  # K must be whole groups


def test_quant_linear_bf16_on_cpu_uses_the_int4_kernel() -> None:
    n, k, group = 64, 256, 32
    qweight, scales, mins = (t.cpu() for t in random_packed(n, k, 4, group, seed=7))
    weight = QuantWeight(n, k, [QuantSlice(0, k, 4, group, qweight, scales, mins)], None)
    layer = QuantLinear(weight, None, torch.bfloat16)
    layer.prepare_for_inference(torch.device("cpu"))
    assert layer.cpu_int4 and layer.dense_t is None
    x = torch.randn(2, k)
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, quant_matmul_ref(x, qweight, scales, mins, 4, group)) <= 6e-3
    fp32 = QuantLinear(weight, None, torch.float32)
    fp32.prepare_for_inference(torch.device("cpu"))
    assert not fp32.cpu_int4 and fp32.dense_t is not None  # the fp32 reference path stays dense
