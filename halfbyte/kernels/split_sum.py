"""A linear layer's output left as its split-K partial sums, for the next kernel to add up.

Why: a split-K GEMV that combines its own partials ends in a chain of memory round trips (the
partial store made visible, an acq_rel counter, the last program's loads of every partial):
measured 1.5-2.8 us per call on Llama-3-8B shapes at batch 1 (bench/gemv.py --diag), ~10% of a
decode step. The kernel that consumes the output (RMSNorm with the residual add, SiLU-and-mul)
reads it anyway, and summing S partials there costs one load per split of data already in L2.
The sum is in a fixed order (split 0 first), so results are deterministic."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# HALFBYTE_SPLIT_SUM=0: every GEMV combines its own partials (A/B runs of the decode bench)
ENABLED = os.environ.get("HALFBYTE_SPLIT_SUM", "1") != "0"


@dataclass
class SplitSum:
    """partials [S, M, N] fp32 of an [M, N] result in `dtype`: the result is their sum over S,
    rounded once to dtype (what the GEMV's own combine stores)."""

    partials: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.partials.device

    def total(self) -> torch.Tensor:
        """[M, N] in dtype, summed in split order (as the kernels do)."""
        acc = self.partials[0].clone()
        for p in self.partials[1:]:
            acc += p
        return acc.to(self.dtype)


def resolve(x: torch.Tensor | SplitSum) -> torch.Tensor:
    """The plain tensor, for consumers without a split-summing kernel."""
    return x.total() if isinstance(x, SplitSum) else x
