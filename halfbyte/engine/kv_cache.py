"""The KV cache: one preallocated pool of fixed-size pages shared by all sequences.

A sequence owns a block table (its page ids in order); token i of it lives in page
block_table[i // page_size] at offset i % page_size."""

from __future__ import annotations

import torch

from halfbyte.model.config import ModelConfig


class PagePool:
    def __init__(
        self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        # one extra page past the pool: padded rows of a CUDA-graph batch write there, unread
        self.scratch_page = num_pages
        shape = (num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        # per layer: (k, v) [num_pages, page_size, Hkv, D]
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: recently freed pages are reused first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(block_table) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append pages to block_table until it holds num_tokens tokens."""
        need = self.pages_for(num_tokens) - len(block_table)
        if need > self.num_free:
            raise RuntimeError("page pool exhausted; the scheduler should have checked can_grow")
        for _ in range(need):
            block_table.append(self._free.pop())

    def release(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()
