"""A linear layer whose weight is stored in the halfbyte quantized format (docs/format.md)."""

from __future__ import annotations

import torch
from torch import nn

from halfbyte.kernels import cpu_int4
from halfbyte.kernels.gemv_w4_i8 import XPlanes
from halfbyte.kernels.quant_matmul import quant_matmul, quant_matmul_planes, x_planes_group
from halfbyte.quant.qtensor import QuantWeight


class QuantLinear(nn.Module):
    """y = x @ dequant(W)^T (+ b). Act-order permutes x once; each K-slice (its own bits) adds
    its part. On the CPU the weight is dequantized once into a dense W^T (the reference path is
    about correctness; dequantizing every call would cost more than the matmul), except in bf16,
    where 4-bit slices run through torch's packed int4 kernel (kernels/cpu_int4.py)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.qweight = weight
        # a buffer, not a Parameter: the dense-weight loader fills every Parameter from the stream,
        # and this bias arrives with the quantized tensors instead
        self.bias: torch.Tensor | None
        self.register_buffer("bias", bias.to(dtype) if bias is not None else None, persistent=False)
        self.dtype = dtype
        self.dense_t: torch.Tensor | None = None
        self.cpu_int4: list[tuple[int, int, cpu_int4.CpuInt4Weight]] = []
        self._register_tensors()

    def _register_tensors(self) -> None:
        # buffers so that .to(), memory accounting and state_dict() see the quantized tensors
        for i, s in enumerate(self.qweight.slices):
            self.register_buffer(f"qweight_{i}", s.qweight, persistent=False)
            self.register_buffer(f"scales_{i}", s.scales, persistent=False)
            self.register_buffer(f"mins_{i}", s.mins, persistent=False)

    def prepare_for_inference(self, device: torch.device) -> None:
        if device.type != "cpu":
            return
        w = self.qweight
        if self.dtype == torch.bfloat16 and w.perm is None and all(
            cpu_int4.supports(s.bits, s.group_size, s.width, self.out_features) for s in w.slices
        ):  # bf16 on the CPU: torch's int4 kernel reads the 4-bit weights, ~7x fewer bytes than fp32
            self.cpu_int4 = [
                (s.k_start, s.k_end, cpu_int4.pack_for_cpu(s.qweight, s.scales, s.mins, s.group_size, s.width))
                for s in w.slices
            ]
        else:
            self.dense_t = w.dequantize(self.dtype).t().contiguous()

    def x_planes_group(self, x: torch.Tensor) -> int | None:
        """The group size in which forward wants x's int8 planes beside x (written by x's producer,
        read by gemv_w4_i8), or None: one 4-bit slice in stored order, a call the kernel takes."""
        w = self.qweight
        if self.dense_t is not None or self.cpu_int4 or w.perm is not None or len(w.slices) != 1:
            return None
        s = w.slices[0]
        return x_planes_group(x, self.out_features, s.bits, s.group_size)

    def forward(self, x: torch.Tensor, x_planes: XPlanes | None = None) -> torch.Tensor:
        """x_planes: x as int8 planes in x_planes_group(x)'s groups, or None."""
        y: torch.Tensor | None = None
        if x_planes is not None:
            s = self.qweight.slices[0]
            y = quant_matmul_planes(x_planes, s.qweight, s.scales, s.mins)
        elif self.dense_t is not None:
            y = torch.mm(x, self.dense_t)
        elif self.cpu_int4:
            for start, end, packed in self.cpu_int4:
                part = cpu_int4.int4_matmul_cpu(x[:, start:end], packed)
                y = part if y is None else y + part
            assert y is not None
            y = y.to(x.dtype)
        else:
            w = self.qweight
            xs = x[:, w.perm.long()] if w.perm is not None else x
            for s in w.slices:
                part = quant_matmul(xs[:, s.k_start : s.k_end], s.qweight, s.scales, s.mins, s.bits, s.group_size)
                y = part if y is None else y + part
        assert y is not None
        return y + self.bias if self.bias is not None else y
