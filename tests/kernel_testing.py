"""Shared tools for kernel tests: the device to test on, relative error, poisoned outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so a kernel that skips elements cannot pass."""
    return t.fill_(float("nan"))

# Triton 3.9's interpreter mishandles bf16: tl.dot on bf16 is off by ~1e10, and fp32 -> bf16
# casts truncate instead of rounding to nearest (a 1-ulp bias, rel. error ~7e-3). bf16 cases
# therefore run only where kernels run natively, on the GPU.
BF16 = pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton interpreter's bf16 is wrong")
)
DTYPES = [torch.float16, BF16, torch.float32]


def graphed_decode_logits(batch: int, steps: int) -> torch.Tensor:
    """Logits of `steps` CUDA-graphed decode steps of a random 4-bit SmolLM2-shaped model from an
    empty cache, each step fed the last one's argmax: hundreds of chained launches, for tests
    that a launch option (PDL, L2 prefetch) changes no result."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
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
