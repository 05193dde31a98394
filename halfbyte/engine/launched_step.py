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


@dataclass
class LaunchedStep:
    batch: ScheduledBatch
    sampling: list[Sequence]  # the batch's sequences that sample a token, in token order
    slots: list[int]  # where each one's placeholder sits in its token_ids
    tokens: torch.Tensor  # [S] int64 on the device
    logits: torch.Tensor | None  # kept only when a row asks for logprobs (read before the next launch)
    host: torch.Tensor  # [S] int64 on the host (pinned on CUDA): the copy in flight
    ready: torch.cuda.Event | None  # recorded after the copy; None on the CPU

    @classmethod
    def start(cls, batch: ScheduledBatch, sampling: list[Sequence], tokens: torch.Tensor,
              logits: torch.Tensor | None) -> LaunchedStep:
        """Begin the copy of the tokens to the host and put a placeholder at the end of each
        sampling sequence (its token count is then what it will be once the token is known)."""
        ready = None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = tokens
        slots = []
        for row, seq in enumerate(sampling):
            slots.append(len(seq.token_ids))
            seq.token_ids.append(placeholder(row))
        return cls(batch, sampling, slots, tokens, logits, host, ready)

    def token_list(self) -> list[int]:
        """The sampled tokens; waits for this step only (later launches keep running)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
