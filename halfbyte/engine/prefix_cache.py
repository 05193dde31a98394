"""Prefix cache: full KV pages keyed by a hash chained over their token ids.

A page's key hashes its parent's key, an optional salt (an adapter id: the same tokens under
another adapter have other keys and values) and its own token ids, so equal keys mean equal
whole prefixes. Cached pages no sequence holds wait in an LRU list and are evicted only when
the pool has no free page left."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

PageKey = bytes


def root_key(salt: str | None) -> PageKey:
    """The parent key of a sequence's first page."""
    return hashlib.blake2b((salt or "").encode(), digest_size=16, person=b"halfbyte-root").digest()


def page_key(parent: PageKey, token_ids: list[int] | tuple[int, ...]) -> PageKey:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


@dataclass
class PrefixCacheStats:
    hit_tokens: int = 0  # prompt tokens whose KV came from the cache
    miss_tokens: int = 0  # prompt tokens computed
    hit_pages: int = 0  # full pages shared from the cache
    miss_pages: int = 0  # full prompt pages not found
    partial_pages: int = 0  # partly matching pages reused by copying
    evictions: int = 0


class PrefixCache:
    """Which pages hold which prefixes. Knows nothing of refcounts: the pool tells it when a page
    becomes unreferenced (`park`) or referenced again (`unpark`)."""

    def __init__(self) -> None:
        self.page_of: dict[PageKey, int] = {}
        self.key_of: dict[int, PageKey] = {}
        self.parent_of: dict[int, PageKey] = {}
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # checked on lookup: a hash collision cannot alias
        self.children: dict[PageKey, set[int]] = {}  # parent key -> cached pages under it (partial matches)
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        self.stats = PrefixCacheStats()

    def __contains__(self, page: int) -> bool:
        return page in self.key_of

    @property
    def num_evictable(self) -> int:
        return len(self.lru)

    def lookup(self, key: PageKey, token_ids: tuple[int, ...]) -> int | None:
        page = self.page_of.get(key)
        return page if page is not None and self.tokens_of[page] == token_ids else None

    def best_partial(self, parent: PageKey, token_ids: list[int]) -> tuple[int, int] | None:
        """(page, n): the cached page under `parent` whose tokens share the longest prefix n >= 1
        with token_ids."""
        best: tuple[int, int] | None = None
        for page in self.children.get(parent, ()):
            cached = self.tokens_of[page]
            n = 0
            for a, b in zip(cached, token_ids):
                if a != b:
                    break
                n += 1
            if n and (best is None or n > best[1]):
                best = (page, n)
        return best

    def insert(self, page: int, parent: PageKey, key: PageKey, token_ids: tuple[int, ...]) -> bool:
        """Register a just-filled page; False if the key is already cached (on another page)."""
        if key in self.page_of or page in self.key_of:
            return False
        self.page_of[key] = page
        self.key_of[page] = key
        self.parent_of[page] = parent
        self.tokens_of[page] = token_ids
        self.children.setdefault(parent, set()).add(page)
        return True

    def park(self, page: int) -> None:
        self.lru[page] = None
        self.lru.move_to_end(page)

    def unpark(self, page: int) -> None:
        self.lru.pop(page, None)

    def evict_oldest(self) -> int:
        page, _ = self.lru.popitem(last=False)
        self._forget(page)
        self.stats.evictions += 1
        return page

    def _forget(self, page: int) -> None:
        key = self.key_of.pop(page)
        del self.page_of[key]
        parent = self.parent_of.pop(page)
        del self.tokens_of[page]
        siblings = self.children[parent]
        siblings.discard(page)
        if not siblings:
            del self.children[parent]
