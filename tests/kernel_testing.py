"""Shared tools for kernel tests: the device to test on, relative error, poisoned outputs."""

from __future__ import annotations

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
