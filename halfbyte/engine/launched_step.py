"""A launched step whose sampled tokens are read back later, so the host can overlap the next step.

A decode step is GPU work (the graphed forward and the sampler: ~7.5 ms at batch 64 for an 8B
model) followed by host work (stop checks, detokenizing, scheduling, building the next step's
tensors: ~2 ms). Run in turn they add up. With async scheduling the engine launches step N+1
before it reads step N's tokens: the tokens go to the host through a non-blocking copy and an
event, and step N+1's rows whose input is a step-N token read it on the device. On the host such
a token is a placeholder, -(1 + j) for row j of step N's token tensor, replaced when step N is
read (LLMEngine._complete). Only one step is in flight, so a placeholder always names the step
launched just before."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halfbyte.engine.sampler import PendingLogprobs
from halfbyte.engine.scheduler import ScheduledBatch
from halfbyte.engine.sequence import Sequence


def placeholder(row: int) -> int:
    """The host stand-in for row `row` of the in-flight step's sampled tokens."""
    return -1 - row


def resolve_placeholders(input_ids: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """input_ids with each placeholder replaced by the previous step's token it names (on the device)."""
    if previous is None or previous.numel() == 0:
        return input_ids
    rows = (-1 - input_ids).clamp_(min=0)
    return torch.where(input_ids < 0, previous[rows], input_ids)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host that arrives in the background (pinned memory), for CUDA tensors."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class LaunchedStep:
    batch: ScheduledBatch
    sampling: list[Sequence]  # the batch's sequences that sample a token, in token order
    slots: list[int]  # where each one's placeholder sits in its token_ids
    tokens: torch.Tensor  # [S] int64 on the device
    host: torch.Tensor  # [S] int64 on the host (pinned on CUDA): the copy in flight
    logprobs: PendingLogprobs | None  # host copies in flight, for the rows that asked
    ready: torch.cuda.Event | None  # recorded after the copies; None on the CPU

    @classmethod
    def start(cls, batch: ScheduledBatch, sampling: list[Sequence], tokens: torch.Tensor,
              logprobs: PendingLogprobs | None) -> LaunchedStep:
        """Begin the copies of the tokens (and logprobs) to the host and put a placeholder at the
        end of each sampling sequence (its token count is then what it will be once known)."""
        host = _to_host(tokens)
        if logprobs is not None:
            logprobs = PendingLogprobs(logprobs.rows, logprobs.top_n, *map(_to_host, logprobs.tensors()))
        ready = None
        if tokens.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        slots = []
        for row, seq in enumerate(sampling):
            slots.append(len(seq.token_ids))
            seq.token_ids.append(placeholder(row))
        return cls(batch, sampling, slots, tokens, host, logprobs, ready)

    def token_list(self) -> list[int]:
        """The sampled tokens; waits for this step only (later launches keep running). The
        logprobs' host copies are complete after it too."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
