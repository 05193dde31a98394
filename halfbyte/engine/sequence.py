"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from halfbyte.engine.detokenizer import IncrementalDetokenizer
from halfbyte.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: sequences live in sets and lists of the scheduler
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None  # per-request RNG: a seed gives the same tokens in any batch
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    arrival: int = 0  # admission order; preemption takes the newest
    priority: int = 0  # higher runs first; preemption takes the lowest
    cache_salt: str | None = None  # e.g. an adapter id: prefix-cache keys differ per salt
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full computed pages
    enqueued_step: int = 0  # the scheduler step it (re)joined the waiting queue: its age
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
