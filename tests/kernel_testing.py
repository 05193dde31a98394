"""Shared tools for kernel tests: the device to test on, relative error, poisoned outputs."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so a kernel that skips elements cannot pass."""
    return t.fill_(float("nan"))
