"""Programmatic dependent launch (kernels/triton_utils.pdl_args): a kernel may start while the one
before it finishes, so every kernel must wait for its predecessor before touching memory. A
missed wait is a race that single-kernel tests cannot see; a graphed decode (hundreds of chained
launches) with PDL must give the same logits, bit for bit, as without it."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels import triton_utils
from halfbyte.kernels.triton_utils import pdl_args
from tests.kernel_testing import graphed_decode_logits


@pytest.fixture
def pdl_env(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def set_pdl(on: bool) -> None:
        monkeypatch.setenv("HALFBYTE_PDL", "1" if on else "0")
        triton_utils._pdl_on.cache_clear()

    yield set_pdl
    monkeypatch.undo()
    triton_utils._pdl_on.cache_clear()


def test_pdl_is_never_asked_of_the_cpu_or_when_turned_off(pdl_env) -> None:  # type: ignore[no-untyped-def]
    assert pdl_args(torch.device("cpu")) == {"PDL": False}
    pdl_env(False)
    if torch.cuda.is_available():
        assert pdl_args(torch.device("cuda")) == {"PDL": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_decode_is_the_same_with_and_without_pdl(pdl_env, batch: int) -> None:  # type: ignore[no-untyped-def]
    pdl_env(True)
    if not pdl_args(torch.device("cuda"))["PDL"]:
        pytest.skip("not run: this GPU or Triton has no programmatic dependent launch")
    with_pdl = graphed_decode_logits(batch, 24)
    pdl_env(False)
    without = graphed_decode_logits(batch, 24)
    assert torch.isfinite(without).all()
    assert torch.equal(with_pdl, without)
