"""Row-parallel linear layers (o_proj, down_proj under tensor parallelism).

Column-parallel layers need no class of their own: q/k/v and gate/up on a rank are an ordinary
Linear / QuantLinear over its output columns. A row-parallel layer computes a partial sum over
its K range and all-reduces it (the one collective after attention-out and after MLP-down);
the bias is added once, after the sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfbyte.distributed.collectives import Collectives
from halfbyte.distributed.plan import RowSplit
from halfbyte.model.linear import Linear
from halfbyte.model.quant_linear import QuantLinear


class RowParallelLinear(Linear):
    """Dense: weight [out, in_local], the rank's input columns; x is the rank's input shard."""

    def __init__(
        self, in_local: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
        comm: Collectives,
    ) -> None:
        super().__init__(in_local, out_features, bias, dtype, device)
        self.comm = comm

    def forward(self, x: torch.Tensor, x_planes: object = None) -> torch.Tensor:  # x [T, in_local] -> [T, out]
        y = torch.mm(x, self.weight) if self.transposed else F.linear(x, self.weight)
        y = self.comm.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class RowParallelQuantLinear(torch.nn.Module):
    """Quantized: `inner` holds the stored-order K range split.k_range, cut on group boundaries
    (no permutation inside; None when the range is empty). Local split: x is exactly that range.
    Gathered split (act-order, or groups straddling the input shards): x is all-gathered to the
    full input, permuted to stored order, and the rank's range taken."""

    def __init__(
        self, inner: QuantLinear | None, out_features: int, bias: torch.Tensor | None, split: RowSplit,
        input_widths: list[int], perm: torch.Tensor | None, comm: Collectives, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.out_features = out_features
        self.split = split
        self.input_widths = input_widths  # every rank's input shard width, for the all-gather
        self.comm = comm
        self.dtype = dtype
        self.bias: torch.Tensor | None
        self.register_buffer("bias", bias.to(dtype) if bias is not None else None, persistent=False)
        self.perm: torch.Tensor | None
        self.register_buffer("perm", perm.long() if perm is not None else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split.gathered:
            x = self.comm.all_gather_last(x, self.input_widths)  # [T, K] original order
            if self.perm is not None:
                x = x[:, self.perm]
            x = x[:, self.split.k_range[0] : self.split.k_range[1]]
        if self.inner is not None:
            y: torch.Tensor = self.inner(x)
        else:
            y = torch.zeros(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        y = self.comm.all_reduce(y)
        return y + self.bias if self.bias is not None else y
