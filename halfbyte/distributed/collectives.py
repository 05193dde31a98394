"""The collectives the parallel layers call, over one torch.distributed process group, with
the time spent in them counted (the benchmark reports it per step).

Timing on CUDA synchronizes around each call, so it is off unless asked for."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from halfbyte.distributed.peer_all_reduce import PeerAllReduce
from halfbyte.distributed.symm_all_reduce import make_symm_all_reduce


class Collectives:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, timed: bool = False,
                 symm: PeerAllReduce | None = None) -> None:
        self.group = group
        self.symm = symm  # small all-reduces through symmetric memory (peer_all_reduce.py), else NCCL
        self.rank = rank
        self.world_size = world_size
        self.timed = timed
        self.seconds = 0.0  # time in collectives since the last reset (only when timed)
        self.calls = 0

    def _clock(self, t: torch.Tensor) -> float:
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        return time.perf_counter()

    @classmethod
    def for_ranks(cls, group: dist.ProcessGroup, rank: int, world_size: int, device: torch.device,
                  dtype: torch.dtype, timed: bool = False) -> Collectives:
        """Every rank calls this at the same point (the symmetric buffer's rendezvous is collective)."""
        return cls(group, rank, world_size, timed, make_symm_all_reduce(group, device, dtype) if world_size > 1 else None)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; use the result: t itself (NCCL, in place) or a new tensor (symmetric memory)."""
        if self.world_size == 1:
            return t
        start = self._clock(t) if self.timed else 0.0
        if self.symm is not None and self.symm.fits(t):
            t = self.symm(t)
        else:
            dist.all_reduce(t, group=self.group)
        self._count(t, start)
        return t

    def all_gather_last(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Concatenate every rank's t along the last dim; rank r's t is widths[r] wide (uneven
        shards are padded to the widest for the collective, then cut)."""
        if self.world_size == 1:
            return t
        start = self._clock(t) if self.timed else 0.0
        wide = max(widths)
        t = t.contiguous()
        if t.shape[-1] < wide:
            t = torch.nn.functional.pad(t, (0, wide - t.shape[-1]))
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.group)
        out = torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)
        self._count(out, start)
        return out

    def _count(self, t: torch.Tensor, start: float) -> None:
        self.calls += 1
        if self.timed:
            self.seconds += self._clock(t) - start

    def reset(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


SINGLE = Collectives(None, 0, 1)  # tensor_parallel_size 1 through the parallel code path
