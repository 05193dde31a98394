"""A batch's new tokens as one-token rows: how extend batches run through the decode graphs.

A decode graph computes rows of one token each, every row with its own position, cache slot,
block table and sequence length. Within a layer the graph stores all rows' K and V in the cache
(rope_and_store) before attention reads it, so the row of the token at position p of a sequence,
given that sequence's block table and seq_len p + 1, attends to exactly its positions 0..p:
causal extend attention, one row per token. A prefix-cache hit that computes 16 new tokens, or a
short prefill chunk mixed with decodes, then replays one graph instead of an eager forward
(~3.5 ms instead of 30-45 ms of launch overhead for an 8B model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halfbyte.engine.scheduler import ScheduledBatch
from halfbyte.kernels.attention import AttentionMetadata

# Each row reads its sequence's whole context, where an eager extend reads it once per sequence.
# Above this many (row, context token) pairs the repeated reads could cost more than the launch
# overhead they save (1M tokens of an 8B model's fp16 KV: ~130 GB, ~30 ms if L2 reuse failed).
MAX_ROW_CONTEXT = 1 << 20


@dataclass
class TokenRows:
    """One row per new token of a batch, sequence by sequence (the batch's flat token order)."""

    input_ids: list[int]  # [R]
    positions: list[int]  # [R]
    slots: list[int]  # [R] flat cache slot (page * page_size + offset) of each row's K/V
    seq_lens: list[int]  # [R] position + 1: the tokens the row attends to
    row_seqs: list[int]  # [R] the batch index of each row's sequence (whose block table it reads)
    sample_rows: list[int]  # the last row of each sequence that samples this step, in batch order

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)

    def prepare(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Device tensors (input_ids, positions, decode-shaped metadata) for the rows, given the
        batch's block tables [B, max_pages] (one per sequence, on the device)."""
        dev = block_tables.device
        packed = torch.tensor(  # one host-to-device copy  # [5, R]
            [self.input_ids, self.positions, self.slots, self.seq_lens, self.row_seqs], dtype=torch.int64
        ).to(dev, non_blocking=True)  # non-blocking: a blocking copy waits for the step in flight
        if self.num_rows != block_tables.shape[0]:  # (a pure decode batch: already one row per sequence)
            block_tables = block_tables.index_select(0, packed[4])  # [R, max_pages]
        meta = AttentionMetadata(
            query_start=list(range(self.num_rows + 1)),
            seq_lens=self.seq_lens,
            block_tables=block_tables,
            slot_mapping=packed[2],
            seq_lens_tensor=packed[3].to(torch.int32),
        )
        return packed[0], packed[1], meta


def token_rows(batch: ScheduledBatch, page_size: int) -> TokenRows:
    """Expand a scheduled batch (before its tokens are marked computed) into one-token rows."""
    rows = TokenRows([], [], [], [], [], [])
    for b, (seq, n, samples) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.samples, strict=True)):
        start = seq.num_computed_tokens
        span = range(start, start + n)
        rows.input_ids.extend(seq.token_ids[start : start + n])
        rows.positions.extend(span)
        rows.slots.extend(seq.block_table[p // page_size] * page_size + p % page_size for p in span)
        rows.seq_lens.extend(p + 1 for p in span)
        rows.row_seqs.extend([b] * n)
        if samples:
            rows.sample_rows.append(len(rows.input_ids) - 1)
    return rows


def row_context(batch: ScheduledBatch) -> int:
    """(row, context token) pairs the rows' attention would read: sum of their seq_lens."""
    return sum(n * s.num_computed_tokens + n * (n + 1) // 2 for s, n in zip(batch.seqs, batch.num_new_tokens))
