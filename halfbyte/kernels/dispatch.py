"""Shared rule for choosing a Triton kernel over its torch reference."""

from __future__ import annotations

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors; HALFBYTE_REFERENCE=1 forces the references (for debugging)."""
    return t.is_cuda and os.environ.get("HALFBYTE_REFERENCE", "0") != "1"
