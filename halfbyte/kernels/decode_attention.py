"""Decode attention over the paged KV cache in Triton: one new token per sequence.

Grid (sequence, kv head, split). Each program serves all query heads of its KV head (GQA: K/V
are read once for the group) over one split of the context, with an online softmax; a second
kernel merges the splits. Splitting long contexts keeps every SM busy at small batch."""

from __future__ import annotations

import torch

from halfbyte.kernels.triton_utils import HAS_TRITON, next_power_of_2, pdl_args, pdl_sync, tl, triton

if HAS_TRITON:

    @triton.jit
    def _decode_split_kernel(
        q_ptr, kc_ptr, vc_ptr, block_table_ptr, seq_lens_ptr, acc_ptr, ml_ptr,
        stride_qb, stride_qh, stride_cp, stride_cs, stride_ch, stride_bt,
        scale, pages_per_split, num_splits,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        PAGES_PER_TILE: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_sync(PDL)
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)
        num_pages = tl.cdiv(seq_len, PAGE)
        first = split * pages_per_split
        last = tl.minimum(first + pages_per_split, num_pages)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        TILE: tl.constexpr = PAGE * PAGES_PER_TILE  # tokens per iteration: more bytes in flight
        t = tl.arange(0, TILE)
        heads = kh * GROUP + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for p in range(first, last, PAGES_PER_TILE):
            pages = p + t // PAGE  # the page of each token of the tile
            valid = (p * PAGE + t < seq_len) & (pages < last)
            page = tl.load(block_table_ptr + b * stride_bt + pages, mask=valid, other=0).to(tl.int64)
            offs = page[:, None] * stride_cp + (t % PAGE)[:, None] * stride_cs + kh * stride_ch + d[None, :]
            k = tl.load(kc_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(vc_ptr + offs, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_G, PAGE] fp32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            probs = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v)
            m = m_new
        # partials: acc [B, Hq, S, D], (m, l) [B, Hq, S, 2]
        row = (b * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        gmask = g < GROUP
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(ml_ptr + row * 2, m, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, l, mask=gmask)

    @triton.jit
    def _decode_merge_kernel(
        acc_ptr, ml_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr
    ):
        pdl_sync(PDL)
        row = tl.program_id(0).to(tl.int64)  # b * Hq + h
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, HEAD_DIM)
        smask = s < num_splits
        m = tl.load(ml_ptr + (row * num_splits + s) * 2, mask=smask, other=float("-inf"))
        l = tl.load(ml_ptr + (row * num_splits + s) * 2 + 1, mask=smask, other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(smask & (m > float("-inf")), tl.exp(m - m_max), 0.0)
        acc = tl.load(acc_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def choose_num_splits(batch: int, num_kv_heads: int, max_pages: int, num_sms: int = 132) -> int:
    """Enough splits that batch * kv_heads * splits covers the SMs about twice, none empty-ish."""
    want = max(1, (2 * num_sms) // max(1, batch * num_kv_heads))
    return max(1, min(want, max_pages, 64))


def decode_attention_triton(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    pages_per_tile: int | None = None,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_pages = -(-max_seq_len // page_size)
    splits = num_splits or choose_num_splits(batch, num_kv_heads, max_pages)
    pages_per_split = -(-max_pages // splits)
    acc = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, acc, ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale, pages_per_split, splits,
        GROUP=group, BLOCK_G=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page_size,
        PAGES_PER_TILE=pages_per_tile or max(1, 64 // page_size),
        num_warps=4, num_stages=2, **pdl_args(q.device),
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(batch * num_heads,)](acc, ml, out, splits, HEAD_DIM=head_dim, BLOCK_S=next_power_of_2(splits),
                                                 **pdl_args(q.device))
    return out
