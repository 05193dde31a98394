"""Triton RMSNorm(+residual) and SiLU-and-mul against their torch references, fresh random inputs.
On the CPU these run through TRITON_INTERPRET=1 (set in conftest); on a GPU, natively."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from halfbyte.kernels import gemv_w4_i8
from halfbyte.kernels.rms_norm import add_rms_norm_ref, rms_norm_planes, rms_norm_ref, rms_norm_triton
from tests.kernel_testing import DEVICE, DTYPES, rel_err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (3, 4096), (2, 100)])
def test_rms_norm(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    for chunk in (None, 64, 4096):  # columns per program: the default, several chunks, the whole row
        out, none, no_planes = rms_norm_triton(x, w, 1e-5, chunk=chunk)
        assert none is None and no_planes is None
        assert rel_err(out, rms_norm_ref(x, w, 1e-5)) <= 1e-3, chunk


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    x, r = (torch.randn(5, 576, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(DEVICE, dtype)
    out, summed, _ = rms_norm_triton(x, w, 1e-6, residual=r)
    ref_out, ref_sum = add_rms_norm_ref(x, r, w, 1e-6)
    assert summed is not None
    assert rel_err(out, ref_out) <= 1e-3
    assert torch.equal(summed, ref_sum)


@pytest.mark.parametrize("hidden,group,with_residual", [(576, 64, True), (4096, 128, True), (1536, 32, False)])
def test_rms_norm_planes(hidden: int, group: int, with_residual: bool) -> None:
    """The norm's output and, from the same launch, its int8 planes for gemv_w4_i8: bit for bit
    what quantize_x_ref makes of that output (row sums to fp32 rounding), on poisoned buffers."""
    g = torch.Generator().manual_seed(hidden + group)
    x, r = (torch.randn(1, hidden, generator=g).half().to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).half().to(DEVICE)
    for t in (torch.empty(hidden // 8, 4, dtype=torch.int32, device=DEVICE), torch.empty(hidden // 8, device=DEVICE)):
        t.fill_(-1)  # poison the allocator's next blocks
    out, summed, planes = rms_norm_planes(x, r if with_residual else None, w, 1e-5, group)
    ref_out, ref_sum = add_rms_norm_ref(x, r, w, 1e-5) if with_residual else (rms_norm_ref(x, w, 1e-5), x)
    assert torch.equal(summed, ref_sum)
    assert rel_err(out, ref_out) <= 1e-3
    ref = gemv_w4_i8.quantize_x_ref(out, group)
    assert torch.equal(planes.planes, ref.planes) and torch.equal(planes.scales, ref.scales)
    assert torch.allclose(planes.row_sums, ref.row_sums, rtol=1e-5, atol=1e-5)
    assert planes.group_size == group


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (4, 1536), (3, 1000)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows + inter)
    gu = torch.randn(rows, 2 * inter, generator=g).to(DEVICE, dtype)
    assert rel_err(silu_and_mul_triton(gu), silu_and_mul_ref(gu)) <= 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hkv,d", [(1, 9, 3, 64), (6, 8, 2, 128), (3, 4, 4, 32)])
def test_rope_and_store(dtype: torch.dtype, tokens: int, hq: int, hkv: int, d: int) -> None:
    from halfbyte.kernels.rotary import rope_and_store_ref, rope_and_store_triton

    g = torch.Generator().manual_seed(tokens * hq + d)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views, as in the model
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    pos = torch.randint(0, 5000, (tokens,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    pages, page = 4, 8
    slots = torch.randperm(pages * page, generator=g)[:tokens].to(DEVICE)
    caches = [torch.full((pages, page, hkv, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    q_ref = rope_and_store_ref(q, k, v, cos, sin, caches[0], caches[1], slots)
    q_out = rope_and_store_triton(q, k, v, cos, sin, caches[2], caches[3], slots)
    assert rel_err(q_out, q_ref) <= 1e-3
    flat = [c.view(-1, hkv, d)[slots] for c in caches]
    assert rel_err(flat[2], flat[0]) <= 1e-3
    assert torch.equal(flat[3], flat[1])
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert caches[2].view(-1, hkv, d)[untouched.to(DEVICE)].isnan().all()  # nothing written elsewhere
