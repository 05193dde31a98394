"""Paged decode attention (Triton) against the paged reference on random caches and tables."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels.attention import AttentionMetadata, paged_attention_ref
from halfbyte.kernels.decode_attention import decode_attention_triton
from tests.kernel_testing import BF16, DEVICE, rel_err


def _random_case(seq_lens: list[int], hq: int, hkv: int, d: int, page: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page) for n in seq_lens)
    num_pages = max_pages * len(seq_lens) + 3
    k_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(num_pages, page, hkv, d, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(num_pages, generator=g)  # pages scattered through the pool
    tables = perm[: max_pages * len(seq_lens)].view(len(seq_lens), max_pages).to(torch.int32).to(DEVICE)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(DEVICE, dtype)
    meta = AttentionMetadata(
        query_start=list(range(len(seq_lens) + 1)), seq_lens=seq_lens, block_tables=tables,
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64, device=DEVICE),
    )
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize(
    "seq_lens,hq,hkv,d,page,splits",
    [
        ([1, 17, 40], 9, 3, 64, 16, 1),   # SmolLM2 heads, lengths off page boundaries
        ([100, 33], 8, 2, 128, 16, 3),    # split context
        ([64], 4, 4, 32, 32, 2),          # MHA, bigger pages
        ([5, 250, 16, 77], 32, 8, 128, 16, None),  # Llama-3-8B heads, automatic splits
    ],
)
def test_decode_attention(seq_lens, hq, hkv, d, page, splits, dtype) -> None:  # type: ignore[no-untyped-def]
    q, k_cache, v_cache, meta = _random_case(seq_lens, hq, hkv, d, page, dtype, seed=sum(seq_lens) + hq)
    scale = d**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for pages_per_tile in (None, 1, 2):  # default (64-token tiles, straddling splits of 3 pages), one, two
        out = decode_attention_triton(q, k_cache, v_cache, meta.block_tables, seq_lens_t, scale, max(seq_lens),
                                      splits, pages_per_tile)
        assert not out.isnan().any()
        assert rel_err(out, ref) <= (1e-3 if dtype == torch.float16 else 4e-3), pages_per_tile


@pytest.mark.parametrize("window", [None, 20])
def test_batched_decode_reference_matches_one_sequence_at_a_time(window, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The reference's padded decode batch (with chunking forced) against the same sequences
    attended alone, where the reference takes its per-sequence path."""
    import halfbyte.kernels.attention as attention

    seq_lens = [1, 17, 40, 33, 64]
    q, k_cache, v_cache, meta = _random_case(seq_lens, 9, 3, 64, 16, torch.float32, seed=7)
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    tables = meta.block_tables.cpu()
    monkeypatch.setattr(attention, "_DECODE_CHUNK_ELEMENTS", 2 * 64 * 3 * 64)  # two sequences per chunk
    out = paged_attention_ref(q, k_cache, v_cache, AttentionMetadata(
        list(range(len(seq_lens) + 1)), seq_lens, tables, torch.zeros(len(seq_lens), dtype=torch.int64)), 0.125, window)
    for b, n in enumerate(seq_lens):
        alone = AttentionMetadata([0, 1], [n], tables[b : b + 1], torch.zeros(1, dtype=torch.int64))
        ref = paged_attention_ref(q[b : b + 1], k_cache, v_cache, alone, 0.125, window)
        torch.testing.assert_close(out[b : b + 1], ref, rtol=1e-5, atol=1e-6)
