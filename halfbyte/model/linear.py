"""Linear layers of the network. Dense now; quantized, LoRA and tensor-parallel variants share
this interface (forward on [T, in] -> [T, out], weights loaded by name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W^T (+ b). The weight may be several checkpoint matrices fused along out_features
    (q/k/v, gate/up): one matmul instead of three reads the activations once."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        )

        self.transposed = False

    def transpose_weight(self) -> None:
        """Store W^T [in, out] contiguous: the CPU's GEMV reads that layout up to 2x faster."""
        if not self.transposed:
            self.weight = nn.Parameter(self.weight.data.t().contiguous(), False)
            self.transposed = True

    def x_planes_group(self, x: torch.Tensor) -> int | None:
        """Dense weights take no int8 planes of x (QuantLinear's seam)."""
        return None

    def forward(self, x: torch.Tensor, x_planes: object = None) -> torch.Tensor:
        """x_planes: ignored (QuantLinear's seam: x as int8 planes)."""
        if self.transposed:
            if self.bias is not None:
                return torch.addmm(self.bias, x, self.weight)
            return torch.mm(x, self.weight)
        return F.linear(x, self.weight, self.bias)
