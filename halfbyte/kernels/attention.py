"""Attention over a paged KV cache: the batch's new tokens attend causally to their sequence's
cached keys and values, located through per-sequence block tables.

One op covers prefill, chunked prefill over a cached prefix, and decode: each sequence b has
query tokens q[query_start[b]:query_start[b+1]], the last ones of its seq_lens[b] tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from halfbyte.kernels.dispatch import reference_forced, use_triton

# prefill / extend / mixed batches on CUDA: "sdpa" (torch's flash attention per sequence, the
# path measured on the H200: 5.3 ms for a 2,048-token 8B prefill) or "triton"
# (kernels/prefill_attention.py, varlen over the pages; default once it has been timed on a GPU)
PREFILL_BACKEND = os.environ.get("HALFBYTE_PREFILL_ATTENTION", "sdpa")


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens are, in the flat batch and in the page pool."""

    query_start: list[int]  # [B + 1] offsets of each sequence's new tokens in the flat batch
    seq_lens: list[int]  # [B] tokens in each sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_pages] int32 page ids, on the cache's device
    slot_mapping: torch.Tensor  # [T] int64 flat cache slot (page * page_size + offset) per new token
    seq_lens_tensor: torch.Tensor | None = None  # [B] int32 on the device, made once per step
    # per sequence, its first page if its pages are consecutive (the reference then slices the
    # cache instead of gathering it); None entries or no list: gather
    contiguous_from: list[int | None] | None = None
    query_start_tensor: torch.Tensor | None = None  # [B + 1] int32 on the device, made on first use

    def device_query_start(self) -> torch.Tensor:
        if self.query_start_tensor is None:
            self.query_start_tensor = torch.tensor(self.query_start, dtype=torch.int32, device=self.block_tables.device)
        return self.query_start_tensor

    @property
    def max_new_tokens(self) -> int:
        return max(b - a for a, b in zip(self.query_start, self.query_start[1:]))

    def device_seq_lens(self) -> torch.Tensor:
        if self.seq_lens_tensor is None:
            self.seq_lens_tensor = torch.tensor(self.seq_lens, dtype=torch.int32, device=self.block_tables.device)
        return self.seq_lens_tensor

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return self.query_start[-1] == self.num_seqs


def store_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def _per_sequence(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """For each sequence: (its rows of the flat batch, q [Hq, n, D], k and v [Hkv, L, D] gathered
    from its pages, L)."""
    page_size = k_cache.shape[1]
    for b, seq_len in enumerate(meta.seq_lens):
        rows = slice(meta.query_start[b], meta.query_start[b + 1])
        num_pages = (seq_len + page_size - 1) // page_size
        first = meta.contiguous_from[b] if meta.contiguous_from is not None else None
        if first is not None:  # consecutive pages (usual for a lone sequence): a view, no gather
            k, v = k_cache[first : first + num_pages], v_cache[first : first + num_pages]
        else:
            pages = meta.block_tables[b, :num_pages]
            k, v = k_cache[pages], v_cache[pages]
        k = k.flatten(0, 1)[:seq_len].transpose(0, 1)
        v = v.flatten(0, 1)[:seq_len].transpose(0, 1)
        yield rows, q[rows].transpose(0, 1), k, v, seq_len


def _causal_mask(n_new: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[n_new, seq_len] bool: the new tokens are the last n_new of the sequence."""
    q_pos = torch.arange(seq_len - n_new, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for every sequence in the batch, computed in fp32. Returns [T, Hq, D]."""
    if meta.is_decode and meta.num_seqs > 1:
        return _decode_batched(q, k_cache, v_cache, meta, scale, sliding_window)
    out = torch.empty_like(q)
    for rows, qb, k, v, seq_len in _per_sequence(q, k_cache, v_cache, meta):
        num_kv, n_new = k.shape[0], qb.shape[1]
        group = qb.shape[0] // num_kv
        # [Hq, n, D] -> [Hkv, group * n, D]: each KV head serves its group in one matmul
        qg = qb.float().reshape(num_kv, group * n_new, -1)
        scores = torch.matmul(qg, k.float().transpose(1, 2)).mul_(scale).view(num_kv, group, n_new, seq_len)
        if n_new > 1 or (sliding_window is not None and seq_len > sliding_window):
            # (a lone decode token sees its whole context: no mask to build)
            scores.masked_fill_(~_causal_mask(n_new, seq_len, sliding_window, q.device), float("-inf"))
        probs = scores.softmax(dim=-1).view(num_kv, group * n_new, seq_len)
        o = torch.matmul(probs, v.float()).view(num_kv * group, n_new, -1)
        out[rows] = o.transpose(0, 1).to(q.dtype)
    return out


# a decode batch is padded to its longest sequence and attended in one op, in chunks of
# sequences whose gathered K (fp32) stays under this many elements
_DECODE_CHUNK_ELEMENTS = 2**24


def _decode_batched(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """paged_attention_ref for one new token per sequence: the batch's pages gathered into
    [B, L_max] and masked past each sequence's length (a Python loop per sequence dominated the
    CPU engine's batched decode)."""
    page_size, num_kv, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_seqs, group = meta.num_seqs, q.shape[1] // num_kv
    seq_lens = torch.tensor(meta.seq_lens, device=q.device)
    per_seq = max(1, _DECODE_CHUNK_ELEMENTS // (max(meta.seq_lens) * num_kv * head_dim))
    out = torch.empty_like(q)
    for b0 in range(0, num_seqs, per_seq):
        b1 = min(num_seqs, b0 + per_seq)
        lens = seq_lens[b0:b1]
        num_pages = (max(meta.seq_lens[b0:b1]) + page_size - 1) // page_size
        pages = meta.block_tables[b0:b1, :num_pages].long().clamp_min(0)  # unused entries: any page, masked
        # [b, P, page, Hkv, D] -> [b, Hkv, L, D]
        k = k_cache[pages].flatten(1, 2).transpose(1, 2).float()
        v = v_cache[pages].flatten(1, 2).transpose(1, 2).float()
        qg = q[b0:b1].float().view(b1 - b0, num_kv, group, head_dim)
        scores = torch.matmul(qg, k.transpose(2, 3)).mul_(scale)  # [b, Hkv, group, L]
        pos = torch.arange(k.shape[2], device=q.device)
        invalid = pos[None, :] >= lens[:, None]  # [b, L]
        if sliding_window is not None:
            invalid |= pos[None, :] <= (lens - 1 - sliding_window)[:, None]
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        o = torch.matmul(scores.softmax(dim=-1), v)  # [b, Hkv, group, D]
        out[b0:b1] = o.view(b1 - b0, num_kv * group, head_dim).to(q.dtype)
    return out


def paged_kernels_fit(page_size: int, head_dim: int) -> bool:
    """Whether the Triton paged-attention kernels take this cache shape."""
    return page_size >= 16 and head_dim & (head_dim - 1) == 0


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    page_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if use_triton(q) and meta.is_decode and sliding_window is None and paged_kernels_fit(page_size, head_dim):
        from halfbyte.kernels.decode_attention import decode_attention_triton

        return decode_attention_triton(
            q, k_cache, v_cache, meta.block_tables, meta.device_seq_lens(), scale, max(meta.seq_lens)
        )
    if use_triton(q) and PREFILL_BACKEND == "triton" and paged_kernels_fit(page_size, head_dim):
        from halfbyte.kernels.prefill_attention import prefill_attention_triton

        return prefill_attention_triton(
            q, k_cache, v_cache, meta.block_tables, meta.device_query_start(), meta.device_seq_lens(),
            meta.max_new_tokens, scale, sliding_window,
        )
    if q.is_cuda or not (reference_forced() or (meta.is_decode and meta.num_seqs > 1)):
        # the CPU too, but for decode batches (one padded op): torch's fused CPU attention ran a
        # 512-token SmolLM2 prefill's attention 5-16x faster than the reference's fp32 scores, and
        # needs no fp32 copy of a lone sequence's whole KV per decode step (BENCHMARKS.md, CPU prefill)
        return prefill_attention_sdpa(q, k_cache, v_cache, meta, scale, sliding_window)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window)


def prefill_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Prefill / extend through torch's fused attention (flash when nothing is cached), one
    sequence at a time: on CUDA (HALFBYTE_PREFILL_ATTENTION=triton selects the Triton kernel
    instead) and on the CPU (its flash kernel, in the inputs' dtype with fp32 sums; there also
    a lone sequence's decode step)."""
    out = torch.empty_like(q)
    for rows, qb, k, v, seq_len in _per_sequence(q, k_cache, v_cache, meta):
        n_new = qb.shape[1]
        # flash attention on CUDA takes 4-D [batch, heads, L, D] inputs with equal head counts: 3-D
        # or GQA inputs sent torch 2.11 to its fp32 math kernel (60% of a 2,048-token prefill on
        # the H200). The CPU's flash kernel takes KV heads shared by query groups as they are.
        group = qb.shape[0] // k.shape[0]
        gqa = group > 1 and not q.is_cuda
        if group > 1 and q.is_cuda:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        qb, k, v = qb.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if n_new == seq_len and not (sliding_window is not None and seq_len > sliding_window):
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            mask = _causal_mask(n_new, seq_len, sliding_window, q.device)
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[rows] = o[0].transpose(0, 1)
    return out
