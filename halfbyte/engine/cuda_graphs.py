"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, static input buffers.

A decode step launches hundreds of small kernels; captured once, it replays with one launch and
no per-kernel host work. Prefill stays eager (its shapes vary and its kernels are large); an extend
whose new tokens fit a bucket replays it with one row per token (engine/token_rows.py)."""

from __future__ import annotations

from typing import Any

import torch

from halfbyte.kernels.attention import AttentionMetadata
from halfbyte.model.llama import KVCache, LlamaModel

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CudaGraphDecoder:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        max_batch: int,
        max_seq_len: int,
        scratch_page: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_seq_len = max_seq_len
        self.scratch_page = scratch_page  # padded rows write their KV here, never read
        page_size = kv_caches[0][0].shape[1]
        self.max_pages = -(-max_seq_len // page_size)
        self.page_size = page_size
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (max_batch,)
        if self.buckets[-1] < max_batch:
            self.buckets += (max_batch,)
        dev = model.device
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(top, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(top, self.max_pages, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        # the cos/sin table must not grow (reallocate) under a captured graph
        model.rotary.reserve(max_seq_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graphs' shared memory pool handle

    def _forward(self, bs: int) -> torch.Tensor:
        meta = AttentionMetadata(
            query_start=list(range(bs + 1)),
            seq_lens=[self.max_seq_len] * bs,  # host view: only its max sizes the split grid
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            seq_lens_tensor=self.seq_lens[:bs],
        )
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, bs: int) -> None:
        self._reset_padding(0, bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up: compile kernels, settle the allocator
            for _ in range(2):
                self._forward(bs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[bs] = self._forward(bs)
        self.pool = graph.pool()
        self.graphs[bs] = graph

    def capture_all(self) -> None:
        """Capture every bucket now (at engine start, as vLLM does): a lazy capture in the middle
        of serving stalls every running request for its warm-up and capture (~0.1-0.5 s each,
        seen when a batch shrinks into a new bucket)."""
        for bs in self.buckets:
            if bs not in self.graphs:
                self.capture(bs)

    def _reset_padding(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch_page * self.page_size
        self.block_tables[start:end] = self.scratch_page
        self.seq_lens[start:end] = 1

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 logits [B, vocab] for B decode tokens."""
        batch = input_ids.shape[0]
        bs = self.bucket(batch)
        assert bs is not None, "batch larger than the biggest captured bucket"
        if bs not in self.graphs:
            self.capture(bs)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(slot_mapping)
        self.block_tables[:batch].zero_()
        self.block_tables[:batch, : block_tables.shape[1]].copy_(block_tables)
        self.seq_lens[:batch].copy_(seq_lens)
        self._reset_padding(batch, bs)
        self.graphs[bs].replay()
        return self.logits[bs][:batch]
