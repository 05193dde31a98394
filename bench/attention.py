"""Paged attention speed on the GPU: the decode kernel's KV read bandwidth (issue 5: >= 70% of
the copy bandwidth at batch 64 x context 4,096) and prefill/extend attention, Triton vs SDPA.

Usage: python bench/attention.py [--batch 64] [--context 4096] [--page 16] [--json OUT]
Llama-3-8B heads (32 query, 8 KV, dim 128), fp16, random pages (shuffled block tables)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv import GPU_MD_COPY_GBS, copy_bandwidth, graph_time  # noqa: E402

from halfbyte.kernels.attention import AttentionMetadata, paged_attention_ref, prefill_attention_sdpa  # noqa: E402
from halfbyte.kernels.decode_attention import decode_attention_triton  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def event_time(fn, reps: int = 5) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call, eager (prefill paths loop over sequences on the host)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048, help="new tokens of the extend case")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    b, ctx, page, d = args.batch, args.context, args.page, args.head_dim
    per_seq = -(-ctx // page)
    pages = b * per_seq
    k_cache = torch.randn(pages, page, args.kv_heads, d, device=dev, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(pages, device=dev).to(torch.int32).view(b, per_seq)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, args.heads, d, device=dev, dtype=torch.float16)
    scale = d**-0.5
    results: dict[str, object] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                      batch=b, context=ctx, page=page)
    out = decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale, ctx)
    meta = AttentionMetadata(list(range(b + 1)), [ctx] * b, tables, torch.zeros(b, dtype=torch.int64, device=dev))
    sub = slice(0, 4)  # the fp32 reference on a few sequences (it gathers every page)
    meta_sub = AttentionMetadata(list(range(5)), [ctx] * 4, tables[sub], torch.zeros(4, dtype=torch.int64, device=dev))
    results["decode_rel_err"] = rel_err(out[sub], paged_attention_ref(q[sub], k_cache, v_cache, meta_sub, scale))
    kv_bytes = 2 * b * ctx * args.kv_heads * d * 2
    copy_gbs = copy_bandwidth()
    per_tile = {}
    for ppt in (1, 2, 4, 8):  # pages per loop iteration (default: 64 tokens)
        per_tile[ppt] = graph_time(
            lambda ppt=ppt: decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale, ctx, None, ppt), reps=20)
    results["decode_us_by_pages_per_tile"] = {k: v * 1e6 for k, v in per_tile.items()}
    t = graph_time(lambda: decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, scale, ctx), reps=20)
    results.update(copy_gbs=copy_gbs, decode_us=t * 1e6, decode_gbs=kv_bytes / t / 1e9,
                   decode_pct_copy=100 * kv_bytes / t / 1e9 / copy_gbs,
                   decode_pct_4161=100 * kv_bytes / t / 1e9 / GPU_MD_COPY_GBS)
    del meta
    # extend: `prefill` new tokens over a cached prefix of `context`, one sequence
    n_new, total = args.prefill, ctx + args.prefill
    per = -(-total // page)
    kc = torch.randn(per, page, args.kv_heads, d, device=dev, dtype=torch.float16)
    vc = torch.randn_like(kc)
    table = torch.randperm(per, device=dev).to(torch.int32).view(1, per)
    qn = torch.randn(n_new, args.heads, d, device=dev, dtype=torch.float16)
    m = AttentionMetadata([0, n_new], [total], table, torch.zeros(n_new, dtype=torch.int64, device=dev))
    ref = prefill_attention_sdpa(qn, kc, vc, m, scale)
    results["extend_sdpa_us"] = event_time(lambda: prefill_attention_sdpa(qn, kc, vc, m, scale)) * 1e6
    try:
        from halfbyte.kernels.prefill_attention import prefill_attention_triton

        qs, sl = m.device_query_start(), m.device_seq_lens()
        out_t = prefill_attention_triton(qn, kc, vc, table, qs, sl, n_new, scale, None)
        results["extend_triton_rel_err"] = rel_err(out_t, ref)
        results["extend_triton_us"] = event_time(
            lambda: prefill_attention_triton(qn, kc, vc, table, qs, sl, n_new, scale, None)) * 1e6
    except Exception as e:  # report, do not hide
        results["extend_triton_error"] = f"{type(e).__name__}: {str(e)[-400:]}"
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\npaged attention on {results['device']}: copy {copy_gbs:.0f} GB/s")
    print(f"decode  batch {b} x ctx {ctx}, page {page}: {t * 1e6:.1f} us, {kv_bytes / t / 1e9:.0f} GB/s = "
          f"{results['decode_pct_copy']:.1f}% of copy, {results['decode_pct_4161']:.1f}% of 4161; "
          f"rel err {results['decode_rel_err']:.1e}")
    print("decode us by pages per tile: " + ", ".join(f"{k}: {v * 1e6:.1f}" for k, v in per_tile.items()))
    print(f"extend  {n_new} new over {ctx} cached: sdpa {results['extend_sdpa_us']:.0f} us, "
          f"triton {results.get('extend_triton_us', float('nan')):.0f} us "
          f"(rel err {results.get('extend_triton_rel_err', float('nan')):.1e}) {results.get('extend_triton_error', '')}")


if __name__ == "__main__":
    main()
