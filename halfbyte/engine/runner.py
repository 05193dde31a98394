"""Turning a scheduled batch into device tensors, running the model, sampling a token per sequence.

On CUDA a batch whose new tokens fit the largest decode graph replays it, one row per token
(token_rows.py): decodes, and extends such as a prefix-cache hit's few new tokens.
HALFBYTE_GRAPH_EXTEND=0 keeps extends eager (for comparisons). Host-to-device copies here are
non-blocking: a blocking one waits for the whole stream, which would stall the host behind the
step in flight (launched_step.py)."""

from __future__ import annotations

import os

import torch

from halfbyte.engine.cuda_graphs import CudaGraphDecoder
from halfbyte.engine.kv_cache import PagePool
from halfbyte.engine.launched_step import LaunchedStep, resolve_placeholders
from halfbyte.engine.sampler import Sampler
from halfbyte.engine.scheduler import ScheduledBatch
from halfbyte.engine.sequence import Sequence
from halfbyte.engine.token_rows import MAX_ROW_CONTEXT, row_context, token_rows
from halfbyte.kernels.attention import AttentionMetadata, paged_kernels_fit
from halfbyte.kernels.dispatch import triton_enabled
from halfbyte.model.llama import LlamaModel


def _first_if_consecutive(pages: list[int]) -> int | None:
    return pages[0] if pages and pages[-1] - pages[0] == len(pages) - 1 and pages == list(
        range(pages[0], pages[-1] + 1)) else None


def _to_device(values: list[int] | list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _block_tables(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """[B, max pages] int32, zero-padded."""
    width = max(len(s.block_table) for s in seqs)
    return _to_device([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], torch.int32, device)


def _graphable(model: LlamaModel, page_size: int) -> bool:
    """Whether decode graphs give right answers: dynamic NTK changes frequencies with the sequence
    length (no fixed graph for it), and the graphs' attention must be the Triton decode kernel,
    which reads each row's length on the device (the other paths read the host lengths, fixed at
    max_seq_len in a graph: they would attend past the end)."""
    cfg = model.cfg
    return (
        triton_enabled(model.device) and cfg.rope_scaling.type != "dynamic" and cfg.sliding_window is None
        and paged_kernels_fit(page_size, cfg.head_dim)
    )


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: PagePool, max_num_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.pool = pool
        self.device = model.device
        self.graphs: CudaGraphDecoder | None = None
        self.graph_extend = os.environ.get("HALFBYTE_GRAPH_EXTEND", "1") != "0"  # extends through the graphs
        self.sampler = Sampler()  # the engine sets sampler.eos_token_ids (min_tokens suppresses them)
        if _graphable(model, pool.page_size):
            self.graphs = CudaGraphDecoder(model, pool.kv_caches, max_num_seqs, max_model_len, pool.scratch_page)

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        page = self.pool.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(seq.block_table[p // page] * page + p % page for p in span)
            query_start.append(len(ids))
            seq_lens.append(start + n)
        dev = self.device
        meta = AttentionMetadata(
            query_start=query_start,
            seq_lens=seq_lens,
            block_tables=_block_tables(batch.seqs, dev),
            slot_mapping=_to_device(slots, torch.int64, dev),
            contiguous_from=[_first_if_consecutive(s.block_table) for s in batch.seqs],
        )
        return _to_device(ids, torch.int64, dev), _to_device(positions, torch.int64, dev), meta

    @torch.inference_mode()
    def forward_logits(self, batch: ScheduledBatch, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [S, vocab] at the last token of each sequence that samples this step
        (batch.samples); marks the batch's tokens cached. previous_tokens: the in-flight step's
        sampled tokens, which the batch's placeholders name (launched_step.py)."""
        self.pool.apply_copies()  # prefix-cache and copy-on-write pages, before any write
        if self.graphs is not None and self._fits_graph(batch):
            rows = token_rows(batch, self.pool.page_size)
            input_ids, positions, meta = rows.prepare(_block_tables(batch.seqs, self.device))
            input_ids = resolve_placeholders(input_ids, previous_tokens)
            self._mark_computed(batch)
            logits = self.graphs.run(input_ids, positions, meta.slot_mapping, meta.block_tables, meta.device_seq_lens())
            if len(rows.sample_rows) == rows.num_rows:  # every row samples (a decode step): all of them
                return logits
            return logits[_to_device(rows.sample_rows, torch.long, self.device)]
        input_ids, positions, meta = self._prepare(batch)
        input_ids = resolve_placeholders(input_ids, previous_tokens)
        self._mark_computed(batch)
        hidden = self.model(input_ids, positions, self.pool.kv_caches, meta)
        # a sequence mid-prefill has no next token yet: only finished chunks reach the LM head
        last = [meta.query_start[i + 1] - 1 for i, s in enumerate(batch.samples) if s]
        return self.model.compute_logits(hidden[_to_device(last, torch.long, self.device)])

    def _fits_graph(self, batch: ScheduledBatch) -> bool:
        """Whether the batch's tokens, one row each, fit a decode graph (and are worth it)."""
        graphs = self.graphs
        assert graphs is not None
        if graphs.bucket(batch.num_tokens) is None:
            return False
        if max(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)) > graphs.max_seq_len:
            return False
        if max(len(s.block_table) for s in batch.seqs) > graphs.max_pages:
            return False
        if batch.num_tokens == len(batch.seqs):  # one token per sequence: decodes (1-token chunks too)
            return True
        return self.graph_extend and row_context(batch) <= MAX_ROW_CONTEXT

    @staticmethod
    def _mark_computed(batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous_tokens: torch.Tensor | None = None) -> LaunchedStep:
        """Run the batch and sample a token per sampling sequence, without waiting for either:
        the tokens come back through the returned step (LaunchedStep.token_list)."""
        logits = self.forward_logits(batch, previous_tokens)
        sampling = [s for s, take in zip(batch.seqs, batch.samples, strict=True) if take]
        if sampling:
            tokens = self.sampler.sample_async(logits, sampling, previous_tokens)
        else:
            tokens = torch.empty(0, dtype=torch.int64, device=logits.device)
        logprobs = self.sampler.logprobs_async(logits, tokens, [s.params for s in sampling]) if sampling else None
        return LaunchedStep.start(batch, sampling, tokens, logprobs)
