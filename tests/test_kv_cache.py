"""The page pool and prefix cache without a model: refcounts, LRU eviction, copy-on-write,
longest-prefix reuse, partial-page copies, salts and counters."""

from __future__ import annotations

import pytest
import torch

from halfbyte.engine.detokenizer import IncrementalDetokenizer
from halfbyte.engine.kv_cache import PagePool
from halfbyte.engine.sequence import Sequence
from halfbyte.model.config import ModelConfig
from halfbyte.sampling_params import SamplingParams

PAGE = 4
CFG = ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4,
                  max_position_embeddings=256)


def make_pool(num_pages: int = 8, prefix: bool = True) -> PagePool:
    return PagePool(CFG, num_pages, PAGE, torch.float32, torch.device("cpu"), enable_prefix_caching=prefix)


def make_seq(tokens: list[int], salt: str | None = None) -> Sequence:
    det = IncrementalDetokenizer.__new__(IncrementalDetokenizer)  # never used here
    return Sequence("r", list(tokens), SamplingParams(), det, cache_salt=salt)


def compute(pool: PagePool, seq: Sequence, fill: float | None = None) -> None:
    """Pretend a forward ran: pages for all tokens, their KV written with a per-token value."""
    pool.apply_copies()
    pool.grow(seq.block_table, seq.num_tokens)
    for pos in range(seq.num_computed_tokens, seq.num_tokens):
        page, off = seq.block_table[pos // PAGE], pos % PAGE
        for k, v in pool.kv_caches:
            k[page, off] = fill if fill is not None else float(seq.token_ids[pos])
            v[page, off] = -k[page, off]
    seq.num_computed_tokens = seq.num_tokens
    pool.cache_full_pages(seq)


def cached_values(pool: PagePool, seq: Sequence, upto: int) -> list[float]:
    k = pool.kv_caches[0][0]
    return [float(k[seq.block_table[p // PAGE], p % PAGE, 0, 0]) for p in range(upto)]


def test_refcounts_and_free_list() -> None:
    pool = make_pool(prefix=False)
    table: list[int] = []
    pool.grow(table, 9)
    assert len(table) == 3 and pool.num_free == 5
    shared = pool.fork(table)
    assert all(pool.refcount[p] == 2 for p in table)
    pool.release(table)
    assert pool.num_free == 5  # still held by the fork
    pool.release(shared)
    assert pool.num_free == 8 and all(c == 0 for c in pool.refcount)
    with pytest.raises(RuntimeError):
        pool.grow(table, 8 * PAGE + 1)


def test_copy_on_write_keeps_the_other_holder_intact() -> None:
    pool = make_pool(prefix=False)
    seq = make_seq(list(range(10, 16)))  # 6 tokens: page 1 half full
    compute(pool, seq)
    other = pool.fork(seq.block_table)
    pool.make_writable(seq.block_table, 1, 2)
    assert seq.block_table[1] != other[1] and pool.refcount[other[1]] == 1
    pool.apply_copies()
    k = pool.kv_caches[0][0]
    assert torch.equal(k[seq.block_table[1], :2], k[other[1], :2])  # kept tokens copied
    k[seq.block_table[1], 2] = 99.0  # the writer's new token
    assert float(k[other[1], 2, 0, 0]) != 99.0
    before = list(seq.block_table)
    pool.make_writable(seq.block_table, 1, 3)  # now exclusive: written in place
    assert seq.block_table == before and not pool.pending_copies


def test_prefix_reuse_full_pages_then_partial_copy() -> None:
    pool = make_pool()
    first = make_seq(list(range(1, 12)))  # 11 tokens: pages [1-4] [5-8] full, [9-11] partial
    compute(pool, first)
    assert len(first.page_keys) == 2
    pool.release(first.block_table)  # finished: its full pages stay cached, unreferenced
    assert pool.num_free == 8
    second = make_seq(list(range(1, 11)) + [50, 51])  # shares 10 tokens
    pool.adopt_cached_prefix(second)
    stats = pool.prefix.stats  # type: ignore[union-attr]
    # two full pages shared; the third matched no cached full page (the first's third was partial)
    assert second.num_computed_tokens == 8 and stats.hit_pages == 2 and stats.hit_tokens == 8
    assert stats.miss_tokens == 4 and stats.miss_pages == 1
    compute(pool, second)
    assert cached_values(pool, second, 12) == [float(t) for t in second.token_ids]
    third = make_seq(list(range(1, 11)) + [50, 77, 78])  # shares 11 tokens with second
    pool.adopt_cached_prefix(third)
    assert third.num_computed_tokens == 11 and stats.partial_pages == 1
    assert third.block_table[:2] == second.block_table[:2] and third.block_table[2] != second.block_table[2]
    compute(pool, third, fill=-1.0)  # writes only positions 11, 12
    assert cached_values(pool, third, 11) == [float(t) for t in third.token_ids[:11]]
    assert cached_values(pool, second, 12) == [float(t) for t in second.token_ids]  # untouched


def test_last_token_is_always_computed() -> None:
    pool = make_pool()
    first = make_seq(list(range(1, 9)))  # exactly two full pages
    compute(pool, first)
    again = make_seq(list(range(1, 9)))
    pool.adopt_cached_prefix(again)
    # the page with the last token is copied (its 3 first tokens), not shared: it gets written
    assert again.num_computed_tokens == 7
    assert again.block_table[0] == first.block_table[0] and again.block_table[1] != first.block_table[1]


def test_salt_separates_entries() -> None:
    pool = make_pool()
    compute(pool, make_seq(list(range(1, 10)), salt="adapter-a"))
    other = make_seq(list(range(1, 10)), salt="adapter-b")
    pool.adopt_cached_prefix(other)
    assert other.num_computed_tokens == 0
    same = make_seq(list(range(1, 10)), salt="adapter-a")
    pool.adopt_cached_prefix(same)
    assert same.num_computed_tokens == 8


def test_lru_evicts_oldest_unreferenced_only_when_free_list_is_empty() -> None:
    pool = make_pool(num_pages=6)
    old = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    compute(pool, old)
    pool.release(old.block_table)
    new = make_seq([9, 10, 11, 12, 13, 14, 15, 16])
    compute(pool, new)
    pool.release(new.block_table)
    assert len(pool.prefix.key_of) == 4 and pool.num_free == 6  # type: ignore[union-attr]
    held = make_seq([20, 21, 22, 23, 24, 25, 26, 27, 28, 29])  # 3 pages: 2 free + 1 evicted
    compute(pool, held)
    assert pool.prefix.stats.evictions == 1  # type: ignore[union-attr]
    # the oldest prefix lost its tail page first; the newer prefix is whole
    probe_new = make_seq([9, 10, 11, 12, 13, 14, 15, 16, 0])
    pool.adopt_cached_prefix(probe_new)
    assert probe_new.num_computed_tokens == 8
    probe_old = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    pool.adopt_cached_prefix(probe_old)
    assert probe_old.num_computed_tokens == 4


def test_pages_in_use_are_never_evicted() -> None:
    pool = make_pool(num_pages=4)
    live = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    compute(pool, live)  # two cached pages, still referenced
    filler = make_seq([9, 10, 11, 12, 13, 14, 15, 16])
    compute(pool, filler)
    assert pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.release(filler.block_table)
    pool.grow([], 2 * PAGE)  # takes the two parked pages of `filler`, not `live`'s
    assert cached_values(pool, live, 8) == [float(t) for t in live.token_ids]
