"""Shared rule for choosing a Triton kernel over its torch reference."""

from __future__ import annotations

import os

import torch


def reference_forced() -> bool:
    """HALFBYTE_REFERENCE=1 forces the torch references (for debugging) over Triton kernels and
    torch's fused ops."""
    return os.environ.get("HALFBYTE_REFERENCE", "0") == "1"


def triton_enabled(device: torch.device) -> bool:
    """Triton runs on CUDA devices unless the references are forced."""
    return device.type == "cuda" and not reference_forced()


def use_triton(t: torch.Tensor) -> bool:
    return triton_enabled(t.device)
