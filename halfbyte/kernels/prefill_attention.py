"""Prefill / extend attention over the paged KV cache in Triton (varlen, causal, GQA).

Each sequence b brings n_b new tokens (the last n_b of its seq_lens[b]); they attend to the
cached prefix and causally to each other, all read through the block table. One kernel serves
whole prompts, chunks of a prompt over its cached part, and decode rows of a mixed batch.

Grid (sequence, query head, block of BLOCK_M new tokens): each program streams the pages its
rows can see, one page per iteration, with an online softmax. The reference is
kernels/attention.py's paged_attention_ref."""

from __future__ import annotations

import torch

from halfbyte.kernels.triton_utils import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _prefill_kernel(
        q_ptr, kc_ptr, vc_ptr, out_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr,
        stride_qt, stride_qh, stride_cp, stride_cs, stride_ch, stride_bt,
        scale, window,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        mblk = tl.program_id(2)
        q_start = tl.load(query_start_ptr + b)
        n_new = tl.load(query_start_ptr + b + 1) - q_start
        if mblk * BLOCK_M >= n_new:
            return
        seq_len = tl.load(seq_lens_ptr + b)
        context = seq_len - n_new  # cached tokens before the new ones
        kh = h // GROUP

        m_idx = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = m_idx < n_new
        q_pos = context + m_idx  # [BLOCK_M] absolute positions of the rows
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, PAGE)
        rows = (q_start + m_idx).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)

        last_key = context + tl.minimum(n_new, (mblk + 1) * BLOCK_M) - 1
        first_key = 0
        if window > 0:
            first_key = tl.maximum(0, context + mblk * BLOCK_M - window + 1)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for p in range(first_key // PAGE, last_key // PAGE + 1):
            page = tl.load(block_table_ptr + b * stride_bt + p).to(tl.int64)
            k_pos = p * PAGE + t
            offs = page * stride_cp + t[:, None] * stride_cs + kh * stride_ch + d[None, :]
            k_ok = k_pos < seq_len
            k = tl.load(kc_ptr + offs, mask=k_ok[:, None], other=0.0)
            v = tl.load(vc_ptr + offs, mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, PAGE] fp32
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            if window > 0:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            # a row that has seen no visible key yet keeps m = -inf: shift by 0, not -inf - -inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            probs = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(probs, axis=1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v)
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


def prefill_attention_triton(
    q: torch.Tensor,  # [T, Hq, D] new tokens of all sequences, flat
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_pages] int32
    query_start: torch.Tensor,  # [B + 1] int32 offsets into q
    seq_lens: torch.Tensor,  # [B] int32 cached + new tokens per sequence
    max_new_tokens: int,
    scale: float,
    sliding_window: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """[T, Hq, D] causal attention of each sequence's new tokens over its pages."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # short chunks (decode rows, small extends) waste less of a 16-row block
    bm = block_m or (16 if max_new_tokens <= 16 else 64)
    grid = (block_tables.shape[0], num_heads, triton.cdiv(max_new_tokens, bm))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale, sliding_window or 0,
        GROUP=num_heads // num_kv_heads, BLOCK_M=bm, HEAD_DIM=head_dim, PAGE=page_size,
        num_warps=4, num_stages=2,
    )
    return out
