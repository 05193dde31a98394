"""SwiGLU's gate: silu(gate) * up on the fused gate/up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first, then up) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(gate_up)
