"""The scheduler without a model: token budgets, decodes first, chunked prefill, aging,
priorities, admission by pages and preemption by recompute. A fake step marks the scheduled
tokens computed and appends a token to each sequence that samples."""

from __future__ import annotations

import torch

from halfbyte.engine.kv_cache import PagePool
from halfbyte.engine.scheduler import ScheduledBatch, Scheduler
from halfbyte.engine.sequence import Sequence, SequenceStatus
from tests.test_kv_cache import CFG, PAGE, make_seq


def make_scheduler(num_pages: int = 64, budget: int = 16, max_num_seqs: int = 8, **kw: int) -> Scheduler:
    pool = PagePool(CFG, num_pages, PAGE, torch.float32, torch.device("cpu"), enable_prefix_caching=True)
    return Scheduler(pool, max_num_seqs, budget, **kw)


def fake_step(sched: Scheduler, max_tokens: int = 1000) -> ScheduledBatch | None:
    batch = sched.schedule()
    if batch is None:
        return None
    sched.pool.apply_copies()
    for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
        seq.num_computed_tokens += n
        sched.pool.cache_full_pages(seq)
        if samples:
            seq.token_ids.append(7)
            if len(seq.output_token_ids) >= max_tokens:
                seq.status = SequenceStatus.FINISHED
                sched.finish(seq)
    return batch


def add(sched: Scheduler, n: int, first: int = 1, priority: int = 0) -> Sequence:
    seq = make_seq(list(range(first, first + n)))
    seq.priority = priority
    seq.arrival = len(sched.running) + len(sched.waiting) + sched.step_count * 100
    sched.add(seq)
    return seq


def test_budget_chunks_a_long_prompt_and_decodes_run_every_step() -> None:
    sched = make_scheduler(budget=16)
    shorts = [add(sched, 3, first=100 * i) for i in range(1, 4)]
    fake_step(sched)
    assert all(s.num_uncomputed_tokens == 1 for s in shorts)  # prefilled, sampled, now decoding
    long = add(sched, 100, first=1000)
    steps = 0
    while long.num_computed_tokens < long.num_tokens - 1:
        remaining = long.num_uncomputed_tokens
        batch = fake_step(sched)
        assert batch is not None and batch.num_tokens <= 16
        assert all(s in batch.seqs and n == 1 for s, n in zip(shorts, [1, 1, 1]))  # no decode stalls
        assert batch.num_new_tokens[batch.seqs.index(long)] == min(16 - 3, remaining)
        assert not batch.samples[batch.seqs.index(long)] or long.num_uncomputed_tokens == 1
        steps += 1
    assert steps == -(-100 // 13)


def test_short_prompts_pass_a_long_one_but_it_is_not_starved() -> None:
    sched = make_scheduler(budget=8, aging_tokens=2)
    long = add(sched, 200, first=1)
    fake_step(sched)  # the long one starts alone
    short = add(sched, 4, first=500)
    batch = fake_step(sched)
    assert batch is not None and batch.seqs[0] is short  # shortest remaining goes first
    # keep short requests arriving: aging still lets the long prefill progress to the end
    for i in range(200):
        add(sched, 4, first=600 + 10 * i)
        fake_step(sched, max_tokens=1)
        if long.num_uncomputed_tokens <= 1:
            break
    assert long.num_uncomputed_tokens <= 1


def test_priority_runs_first_and_is_preempted_last() -> None:
    sched = make_scheduler(num_pages=6, budget=64)
    low = add(sched, 8, first=1, priority=0)
    high = add(sched, 8, first=100, priority=5)
    batch = fake_step(sched)
    assert batch is not None and batch.seqs[0] is high
    # both decode until pages run out: the low-priority one is preempted, the high one runs on
    for _ in range(10):
        fake_step(sched)
    assert high.status is SequenceStatus.RUNNING and low.num_preemptions >= 1
    assert sched.num_preemptions >= 1


def test_preempted_sequence_resumes_with_its_output_tokens() -> None:
    sched = make_scheduler(num_pages=5, budget=64)
    a = add(sched, 6, first=1)
    b = add(sched, 6, first=50)
    for _ in range(6):
        fake_step(sched, max_tokens=12)
    assert b.num_preemptions >= 1 or a.num_preemptions >= 1
    for seq in (a, b):
        assert seq.token_ids[: 6] == seq.prompt_token_ids
    # everything finishes once the other is done
    for _ in range(200):
        if not sched.has_work():
            break
        fake_step(sched, max_tokens=12)
    assert not sched.has_work()
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 12
    assert sched.pool.num_free == 5  # no page leaked


def test_admission_waits_for_pages_and_max_num_seqs() -> None:
    sched = make_scheduler(num_pages=8, budget=64, max_num_seqs=2)
    seqs = [add(sched, 5, first=100 * i + 1) for i in range(3)]
    batch = fake_step(sched)
    assert batch is not None and len(batch.seqs) == 2 and seqs[2].status is SequenceStatus.WAITING
