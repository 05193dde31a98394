"""Deciding which sequences run each step: continuous batching with chunked prefill.

Each step spends a token budget (max_batch_tokens). Running decodes come first, one token each,
so a long prompt being prefilled never stalls them (no head-of-line blocking). What is left goes
to prefill work, running chunks and newly admitted requests alike, shortest remaining first
with aging: every step a request waits takes `aging_tokens` off its rank, so short requests
pass a long one but the long one's turn always comes. Higher `priority` goes first.

Admission needs free pages for the whole remaining prompt (after reusing cached prefix pages).
When a decode needs a page and none is free, the newest lowest-priority running sequence is
preempted: its pages are released (full ones stay in the prefix cache) and it is recomputed
later from its tokens, prompt and output alike."""

from __future__ import annotations

from dataclasses import dataclass, field

from halfbyte.engine.kv_cache import PagePool
from halfbyte.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step (1 for a decode)
    # whether each sequence's chunk reaches its last token: only those sample a new token
    samples: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(self.seqs, self.num_new_tokens)]

    @property
    def is_prefill(self) -> bool:
        return any(n > 1 for n in self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        max_num_seqs: int,
        max_batch_tokens: int,
        aging_tokens: int | None = None,
        starvation_steps: int = 64,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        # rank credit per step waited; default: a budget's worth every 8 steps
        self.aging_tokens = aging_tokens if aging_tokens is not None else max(1, max_batch_tokens // 8)
        # a request kept out for lack of pages this long stops others from being admitted past it
        self.starvation_steps = starvation_steps
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.step_count = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.enqueued_step = self.step_count
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        self.step_count += 1
        while True:
            chosen = self._schedule_once()
            if chosen or not self.running:
                break
            # running prefills stuck for pages and no decode to run: free room by recompute
            self._preempt(self._newest_running(exclude=()))
        if not chosen:
            return None
        return ScheduledBatch([s for s, _ in chosen], [n for _, n in chosen])

    def _schedule_once(self) -> list[tuple[Sequence, int]]:
        budget = self.max_batch_tokens
        chosen: list[tuple[Sequence, int]] = []
        self.running.sort(key=lambda s: (-s.priority, s.arrival))
        for seq in list(self.running):  # decodes first: one token each
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            if self._reserve_decode(seq, {s for s, _ in chosen}):
                chosen.append((seq, 1))
                budget -= 1
        if budget == 0:
            return chosen
        step = self.step_count
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1] + self.waiting
        prefills.sort(key=lambda s: (-s.priority, s.num_uncomputed_tokens - (step - s.enqueued_step) * self.aging_tokens))
        admitting = True
        for seq in prefills:
            if budget == 0:
                break
            if seq.status is SequenceStatus.WAITING:
                if not admitting or len(self.running) >= self.max_num_seqs:
                    continue
                if not self._admit(seq):
                    if step - seq.enqueued_step >= self.starvation_steps:
                        admitting = False  # keep the pages that free up for it
                    continue
            n = self._grow_chunk(seq, min(seq.num_uncomputed_tokens, budget))
            if n > 0:
                chosen.append((seq, n))
                budget -= n
        return chosen

    def _admit(self, seq: Sequence) -> bool:
        if not seq.block_table:
            self.pool.adopt_cached_prefix(seq)
        if self.pool.pages_for(seq.num_tokens) - len(seq.block_table) > self.pool.num_free:
            self.pool.release(seq.block_table)  # back out; its cached pages stay cached
            seq.num_computed_tokens = 0
            seq.page_keys.clear()
            return False
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _grow_chunk(self, seq: Sequence, n: int) -> int:
        """Pages for the next n tokens of seq, fewer tokens if the pool runs short; how many."""
        page = self.pool.page_size
        self._make_writable(seq)
        room = (len(seq.block_table) + self.pool.num_free) * page - seq.num_computed_tokens
        n = min(n, room)
        if n > 0:
            self.pool.grow(seq.block_table, seq.num_computed_tokens + n)
        return n

    def _make_writable(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.pool.page_size
        if index < len(seq.block_table) and self.pool.num_free > 0:
            self.pool.make_writable(seq.block_table, index, seq.num_computed_tokens % self.pool.page_size)

    def _reserve_decode(self, seq: Sequence, scheduled: set[Sequence]) -> bool:
        while not self.pool.can_grow(seq.block_table, seq.num_tokens):
            victim = self._newest_running(exclude=scheduled | {seq})
            self._preempt(victim or seq)
            if victim is None:
                return False
        self._make_writable(seq)
        self.pool.grow(seq.block_table, seq.num_tokens)
        return True

    def _newest_running(self, exclude: set[Sequence] | tuple[()]) -> Sequence | None:
        candidates = [s for s in self.running if s not in exclude]
        return max(candidates, key=lambda s: (-s.priority, s.arrival)) if candidates else None

    def _preempt(self, seq: Sequence | None) -> None:
        assert seq is not None
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.num_computed_tokens = 0
        seq.page_keys.clear()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)  # keeps its enqueued_step: its age carries over

    def finish(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
