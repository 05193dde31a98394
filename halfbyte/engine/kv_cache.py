"""The KV cache: one preallocated pool of fixed-size pages shared by all sequences.

A sequence owns a block table (its page ids in order); token i of it lives in page
block_table[i // page_size] at offset i % page_size. Pages are reference-counted: a full page
with a prefix-cache key can be shared by every sequence with that prefix, and a page shared
when it would be written is copied first (copy-on-write). Copies are queued and run by the
runner before the step's forward (`apply_copies`), so scheduling stays host-only."""

from __future__ import annotations

import torch

from halfbyte.engine.prefix_cache import PageKey, PrefixCache, page_key, root_key
from halfbyte.engine.sequence import Sequence
from halfbyte.model.config import ModelConfig


class PagePool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        # one extra page past the pool: padded rows of a CUDA-graph batch write there, unread
        self.scratch_page = num_pages
        shape = (num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        # per layer: (k, v) [num_pages + 1, page_size, Hkv, D]
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: recently freed pages are reused first
        self.refcount = [0] * num_pages
        self.prefix: PrefixCache | None = PrefixCache() if enable_prefix_caching else None
        self.pending_copies: list[tuple[int, int, int]] = []  # (src page, dst page, tokens)

    # --- pages ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take: never-used or released ones, plus evictable cached ones."""
        return len(self._free) + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self) -> int:
        if self._free:
            page = self._free.pop()
        elif self.prefix is not None and self.prefix.num_evictable:
            page = self.prefix.evict_oldest()
        else:
            raise RuntimeError("page pool exhausted; the scheduler should have checked num_free")
        self.refcount[page] = 1
        return page

    def _take(self, page: int) -> None:
        """One more reference to an existing page (a cached one leaves the LRU list)."""
        if self.refcount[page] == 0 and self.prefix is not None:
            self.prefix.unpark(page)
        self.refcount[page] += 1

    def _drop(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.prefix is not None and page in self.prefix:
                self.prefix.park(page)  # stays cached until evicted
            else:
                self._free.append(page)
                if self.pending_copies:  # a backed-out admission: its copy has no reader
                    self.pending_copies = [c for c in self.pending_copies if c[1] != page]

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(block_table) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append pages to block_table until it holds num_tokens tokens."""
        need = self.pages_for(num_tokens) - len(block_table)
        if need > self.num_free:
            raise RuntimeError("page pool exhausted; the scheduler should have checked can_grow")
        for _ in range(need):
            block_table.append(self.allocate())

    def release(self, block_table: list[int]) -> None:
        # tail pages first: the LRU list then evicts a prefix's tail before its head
        for page in reversed(block_table):
            self._drop(page)
        block_table.clear()

    def fork(self, block_table: list[int]) -> list[int]:
        """A second block table sharing every page (parallel samples of one prompt)."""
        for page in block_table:
            self._take(page)
        return list(block_table)

    def make_writable(self, block_table: list[int], index: int, num_tokens: int) -> None:
        """Copy-on-write: before writing into page `index`, give this table its own copy if the
        page is shared or cached (num_tokens: how many of its tokens to keep)."""
        page = block_table[index]
        if self.refcount[page] == 1 and (self.prefix is None or page not in self.prefix):
            return
        fresh = self.allocate()
        self.pending_copies.append((page, fresh, num_tokens))
        self._drop(page)
        block_table[index] = fresh

    def apply_copies(self) -> None:
        """Run the queued page copies (before the forward that writes the destinations)."""
        if not self.pending_copies:
            return
        dev = self.kv_caches[0][0].device  # non-blocking copies: no wait for a step in flight
        src = torch.tensor([s for s, _, _ in self.pending_copies]).to(dev, non_blocking=True)
        dst = torch.tensor([d for _, d, _ in self.pending_copies]).to(dev, non_blocking=True)
        for k, v in self.kv_caches:  # whole pages: the tail past the kept tokens is overwritten before it is read
            k[dst] = k[src]
            v[dst] = v[src]
        self.pending_copies.clear()

    # --- prefix cache -----------------------------------------------------------------------
    def adopt_cached_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no pages the longest cached run of its prefix: shared full pages,
        then a copy of the best partly matching page. At least its last token stays to compute
        (its logits are needed), so a page holding it is copied, never shared."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        page, n = self.page_size, seq.num_tokens
        if self.prefix is None:
            return
        stats = self.prefix.stats
        parent = root_key(seq.cache_salt)
        cached = 0
        while (cached + page) <= n - 1:  # full pages before the one holding the last token
            tokens = tuple(seq.token_ids[cached : cached + page])
            key = page_key(parent, tokens)
            hit = self.prefix.lookup(key, tokens)
            if hit is None:
                break
            self._take(hit)
            seq.block_table.append(hit)
            seq.page_keys.append(key)
            parent, cached = key, cached + page
            stats.hit_pages += 1
        stats.miss_pages += n // page - len(seq.block_table)
        partial = self.prefix.best_partial(parent, seq.token_ids[cached : min(cached + page, n - 1)])
        if partial is not None and self.num_free > 0:
            src, keep = partial
            fresh = self.allocate()
            self.pending_copies.append((src, fresh, keep))
            seq.block_table.append(fresh)
            cached += keep
            stats.partial_pages += 1
        seq.num_computed_tokens = cached
        stats.hit_tokens += cached
        stats.miss_tokens += n - cached

    def cache_full_pages(self, seq: Sequence) -> None:
        """Key and register the sequence's pages that its computed tokens have filled."""
        if self.prefix is None:
            return
        page = self.page_size
        parent: PageKey = seq.page_keys[-1] if seq.page_keys else root_key(seq.cache_salt)
        for i in range(len(seq.page_keys), seq.num_computed_tokens // page):
            tokens = tuple(seq.token_ids[i * page : (i + 1) * page])
            key = page_key(parent, tokens)
            self.prefix.insert(seq.block_table[i], parent, key, tokens)
            seq.page_keys.append(key)
            parent = key
