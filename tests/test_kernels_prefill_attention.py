"""Varlen prefill / extend attention (Triton) against the paged reference: new tokens over a
cached prefix and themselves, scattered pages, GQA, mixed decode rows, sliding window."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels.attention import AttentionMetadata, paged_attention_ref
from halfbyte.kernels.prefill_attention import prefill_attention_triton
from tests.kernel_testing import BF16, DEVICE, rel_err


def _case(new: list[int], context: list[int], hq: int, hkv: int, d: int, page: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context, new)]
    max_pages = max(-(-n // page) for n in seq_lens)
    num_pages = max_pages * len(seq_lens) + 2
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(num_pages, generator=g)  # pages scattered through the pool
    tables = perm[: max_pages * len(seq_lens)].view(len(seq_lens), max_pages).to(torch.int32).to(DEVICE)
    q = torch.randn(sum(new), hq, d, generator=g).to(DEVICE, dtype)
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(query_start=starts, seq_lens=seq_lens, block_tables=tables,
                             slot_mapping=torch.zeros(sum(new), dtype=torch.int64, device=DEVICE))
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize(
    "new,context,hq,hkv,d,page,window",
    [
        ([37], [0], 9, 3, 64, 16, None),                 # a whole prompt, SmolLM2 heads
        ([20, 5, 1, 70], [0, 33, 48, 16], 8, 2, 32, 16, None),  # extends over cached prefixes + a decode row
        ([17, 1], [40, 100], 4, 4, 32, 32, None),        # MHA, bigger pages
        ([50, 9], [30, 0], 8, 2, 32, 16, 24),            # sliding window
    ],
)
def test_prefill_attention(new, context, hq, hkv, d, page, window, dtype) -> None:  # type: ignore[no-untyped-def]
    q, k_cache, v_cache, meta = _case(new, context, hq, hkv, d, page, dtype, seed=sum(new) + hq + d)
    scale = d**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale, window)
    qs = torch.tensor(meta.query_start, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(meta.seq_lens, dtype=torch.int32, device=DEVICE)
    for block_m in (16, 32):  # one and several row blocks per sequence
        out = prefill_attention_triton(q, k_cache, v_cache, meta.block_tables, qs, sl, max(new), scale, window, block_m)
        assert not out.isnan().any()
        assert rel_err(out, ref) <= (2e-3 if dtype == torch.float16 else 8e-3)


def test_prefill_attention_reads_only_its_slots() -> None:
    """NaN in every cache slot past each sequence's length, and in pages no sequence uses."""
    q, k_cache, v_cache, meta = _case([3, 18], [5, 0], 4, 2, 16, 16, torch.float16, seed=1)
    page = k_cache.shape[1]
    used = torch.zeros(k_cache.shape[0] * page, dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(meta.seq_lens):
        for pos in range(n):
            used[int(meta.block_tables[b, pos // page]) * page + pos % page] = True
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    for cache in (k_cache, v_cache):
        cache.view(-1, *cache.shape[2:])[~used] = float("nan")
    qs = torch.tensor(meta.query_start, dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(meta.seq_lens, dtype=torch.int32, device=DEVICE)
    out = prefill_attention_triton(q, k_cache, v_cache, meta.block_tables, qs, sl, 18, 0.25)
    assert not out.isnan().any() and rel_err(out, ref) <= 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "new,context,hq,hkv,window",
    [
        ([37], [0], 9, 3, None),                      # a whole prompt, SmolLM2 heads (causal flash)
        ([20, 5, 1, 70], [0, 33, 48, 16], 8, 2, None),  # extends over cached prefixes + a decode row (mask)
        ([1], [90], 9, 3, None),                      # a lone sequence's decode step
        ([50, 9], [30, 0], 4, 4, 24),                 # MHA, sliding window
    ],
)
def test_cpu_dispatch_matches_the_reference(new, context, hq, hkv, window, dtype, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On the CPU paged_attention runs torch's fused attention (not the fp32 reference) for
    everything but decode batches; HALFBYTE_REFERENCE=1 gives the reference itself back."""
    import halfbyte.kernels.attention as attention

    q, k_cache, v_cache, meta = _case(new, context, hq, hkv, 32, 16, torch.float32, seed=sum(new) + hq)
    q, k_cache, v_cache = q.cpu().to(dtype), k_cache.cpu().to(dtype), v_cache.cpu().to(dtype)
    meta.block_tables, meta.slot_mapping = meta.block_tables.cpu(), meta.slot_mapping.cpu()
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 32**-0.5, window)
    calls: list[int] = []
    monkeypatch.setattr(attention, "paged_attention_ref", lambda *a: calls.append(1) or paged_attention_ref(*a))
    out = attention.paged_attention(q, k_cache, v_cache, meta, 32**-0.5, window)
    assert not calls  # the fused path, not the reference
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)
    monkeypatch.setenv("HALFBYTE_REFERENCE", "1")
    assert torch.equal(attention.paged_attention(q, k_cache, v_cache, meta, 32**-0.5, window), ref) and calls
