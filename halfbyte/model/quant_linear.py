"""A linear layer whose weight is stored in the halfbyte quantized format (docs/format.md)."""

from __future__ import annotations

import torch
from torch import nn

from halfbyte.kernels.quant_matmul import quant_matmul
from halfbyte.quant.qtensor import QuantWeight


class QuantLinear(nn.Module):
    """y = x @ dequant(W)^T (+ b). Act-order permutes x once; each K-slice (its own bits) adds
    its part. On the CPU the weight is dequantized once into a dense W^T (the reference path is
    about correctness; dequantizing every call would cost more than the matmul)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.qweight = weight
        self.bias = nn.Parameter(bias.to(dtype), False) if bias is not None else None
        self.dtype = dtype
        self.dense_t: torch.Tensor | None = None
        self._register_tensors()

    def _register_tensors(self) -> None:
        # buffers so that .to(), memory accounting and state_dict() see the quantized tensors
        for i, s in enumerate(self.qweight.slices):
            self.register_buffer(f"qweight_{i}", s.qweight, persistent=False)
            self.register_buffer(f"scales_{i}", s.scales, persistent=False)
            self.register_buffer(f"mins_{i}", s.mins, persistent=False)

    def prepare_for_inference(self, device: torch.device) -> None:
        if device.type == "cpu":
            self.dense_t = self.qweight.dequantize(self.dtype).t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_t is not None:
            y = torch.mm(x, self.dense_t)
        else:
            w = self.qweight
            xs = x[:, w.perm.long()] if w.perm is not None else x
            y = None
            for s in w.slices:
                part = quant_matmul(xs[:, s.k_start : s.k_end], s.qweight, s.scales, s.mins, s.bits, s.group_size)
                y = part if y is None else y + part
            assert y is not None
        return y + self.bias if self.bias is not None else y
