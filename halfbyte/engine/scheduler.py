"""Deciding which sequences run each step: whole-prompt prefills first, then a decode batch.

Continuous batching: sequences join after their prefill and leave when they finish. When the
page pool cannot hold the next decode token, the newest running sequence is preempted
(its pages freed, its tokens recomputed later)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from halfbyte.engine.kv_cache import PagePool
from halfbyte.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    is_prefill: bool


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_batch_tokens: int) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        prefills: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(prefills) < self.max_num_seqs:
            seq = self.waiting[0]
            new_tokens = seq.num_tokens - seq.num_computed_tokens
            if prefills and tokens + new_tokens > self.max_batch_tokens:
                break
            if not self.pool.can_grow(seq.block_table, seq.num_tokens):
                break
            self.waiting.popleft()
            self.pool.grow(seq.block_table, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            prefills.append(seq)
            tokens += new_tokens
        if prefills:
            self.running.extend(prefills)
            return ScheduledBatch(prefills, is_prefill=True)
        return self._schedule_decode()

    def _schedule_decode(self) -> ScheduledBatch | None:
        self.running.sort(key=lambda s: s.arrival)
        batch: list[Sequence] = []
        while self.running:
            seq = self.running.pop(0)
            while not self.pool.can_grow(seq.block_table, seq.num_tokens):
                victim = self.running.pop() if self.running else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.pool.grow(seq.block_table, seq.num_tokens)
                batch.append(seq)
        self.running = batch
        # a copy: finishing a sequence removes it from `running` while the step walks the batch
        return ScheduledBatch(list(batch), is_prefill=False) if batch else None

    def _preempt(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
