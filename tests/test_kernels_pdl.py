"""Programmatic dependent launch (kernels/triton_utils.pdl_args): a kernel may start while the one
before it finishes, so every kernel must wait for its predecessor before touching memory. A
missed wait is a race that single-kernel tests cannot see; a graphed decode (hundreds of chained
launches) with PDL must give the same logits, bit for bit, as without it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from halfbyte.kernels import triton_utils
from halfbyte.kernels.triton_utils import pdl_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


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


def _graphed_decode_logits(batch: int, steps: int) -> torch.Tensor:
    from random_model import random_model

    from halfbyte.engine.cuda_graphs import CudaGraphDecoder
    from halfbyte.engine.kv_cache import PagePool

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = random_model("smollm2-135m", 4, 64, torch.float16, dev, max_position_embeddings=512)
    page, per_seq = 16, 8
    pool = PagePool(model.cfg, batch * per_seq + 1, page, torch.float16, dev)
    decoder = CudaGraphDecoder(model, pool.kv_caches, batch, page * per_seq, scratch_page=pool.num_pages - 1)
    tables = torch.arange(batch * per_seq, dtype=torch.int32, device=dev).view(batch, per_seq)
    token = torch.randint(0, model.cfg.vocab_size, (batch,), device=dev)
    out = []
    for p in range(steps):  # decode from an empty cache: every step reads what the last wrote
        pos = torch.full((batch,), p, dtype=torch.int64, device=dev)
        slot = tables[:, p // page].long() * page + p % page
        logits = decoder.run(token, pos, slot, tables, torch.full((batch,), p + 1, dtype=torch.int32, device=dev))
        out.append(logits.clone())
        token = logits.argmax(-1)
    return torch.stack(out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 4])
def test_graphed_decode_is_the_same_with_and_without_pdl(pdl_env, batch: int) -> None:  # type: ignore[no-untyped-def]
    pdl_env(True)
    if not pdl_args(torch.device("cuda"))["PDL"]:
        pytest.skip("not run: this GPU or Triton has no programmatic dependent launch")
    with_pdl = _graphed_decode_logits(batch, 24)
    pdl_env(False)
    without = _graphed_decode_logits(batch, 24)
    assert torch.isfinite(without).all()
    assert torch.equal(with_pdl, without)
