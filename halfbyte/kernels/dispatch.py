"""Shared rule for choosing a Triton kernel over its torch reference."""

from __future__ import annotations

import os

import torch


def triton_enabled(device: torch.device) -> bool:
    """Triton runs on CUDA devices; HALFBYTE_REFERENCE=1 forces the references (for debugging)."""
    return device.type == "cuda" and os.environ.get("HALFBYTE_REFERENCE", "0") != "1"


def use_triton(t: torch.Tensor) -> bool:
    return triton_enabled(t.device)
