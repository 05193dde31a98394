"""GPU decode and prefill speed of a random-weight quantized model of a named shape.

Usage: python bench/decode.py [--shape llama3-8b] [--bits 4] [--group 128] [--json OUT]
Prints batch-1 decode tokens/s at context 128 and 2048 (CUDA graphs and eager), prefill tokens/s
for 2048 tokens, and peak memory; a table last."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_model import random_model  # noqa: E402

from halfbyte.engine.cuda_graphs import CudaGraphDecoder  # noqa: E402
from halfbyte.engine.kv_cache import PagePool  # noqa: E402
from halfbyte.kernels.attention import AttentionMetadata  # noqa: E402

PAGE = 16


def prefill(model, pool, ids: torch.Tensor, table: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    n = ids.shape[0]
    dev = ids.device
    pos = torch.arange(n, device=dev)
    slots = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(n)], device=dev)
    meta = AttentionMetadata([0, n], [n], torch.tensor([table], dtype=torch.int32, device=dev), slots)
    hidden = model(ids, pos, pool.kv_caches, meta)
    return model.compute_logits(hidden[-1:])


def time_decode(model, pool, decoder, context: int, steps: int, use_graph: bool, profile: bool = False) -> float:  # type: ignore[no-untyped-def]
    dev = model.device
    table = list(range(-(-(context + steps) // PAGE)))
    ids = torch.randint(0, model.cfg.vocab_size, (context,), device=dev)
    logits = prefill(model, pool, ids, table)
    token = logits.argmax(-1)
    tables = torch.tensor([table], dtype=torch.int32, device=dev)
    torch.cuda.synchronize()
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as make_profiler

        prof = make_profiler(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    start = time.perf_counter()
    for i in range(steps):
        p = context + i
        pos = torch.tensor([p], device=dev)
        slot = torch.tensor([table[p // PAGE] * PAGE + p % PAGE], device=dev)
        seq_lens = torch.tensor([p + 1], dtype=torch.int32, device=dev)
        if use_graph:
            logits = decoder.run(token, pos, slot, tables, seq_lens)
        else:
            meta = AttentionMetadata([0, 1], [p + 1], tables, slot, seq_lens)
            logits = model.compute_logits(model(token, pos, pool.kv_caches, meta))
        token = logits.argmax(-1)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if prof is not None:
        prof.__exit__(None, None, None)
        print(f"GPU time per decode step, {steps} eager steps at context {context}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16))
    return steps / elapsed


def profile_batch(model, batch: int, context: int, steps: int = 3) -> None:  # type: ignore[no-untyped-def]
    """GPU time by kernel of eager decode steps for `batch` sequences at `context` tokens each
    (issue 5's batch-64 case), and the graphed step time."""
    from torch.profiler import ProfilerActivity, profile

    dev = model.device
    per_seq = -(-(context + steps + 8) // PAGE)
    pool = PagePool(model.cfg, batch * per_seq + 1, PAGE, torch.float16, dev)
    tables = torch.arange(batch * per_seq, dtype=torch.int32, device=dev).view(batch, per_seq)
    token = torch.randint(0, model.cfg.vocab_size, (batch,), device=dev)
    pos = torch.full((batch,), context, dtype=torch.int64, device=dev)
    slot = tables[:, context // PAGE].long() * PAGE + context % PAGE
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(list(range(batch + 1)), [context + 1] * batch, tables, slot, seq_lens)
    model.compute_logits(model(token, pos, pool.kv_caches, meta))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model.compute_logits(model(token, pos, pool.kv_caches, meta))
        torch.cuda.synchronize()
    print(f"GPU time of {steps} eager decode steps, batch {batch} at context {context}:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    one = AttentionMetadata([0, 1], [context + 1], tables[:1], slot[:1], seq_lens[:1])
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # host cost of an eager step
        for _ in range(steps):
            model.compute_logits(model(token[:1], pos[:1], pool.kv_caches, one))
        torch.cuda.synchronize()
    print(f"host time of {steps} eager batch-1 decode steps (self CPU):")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))
    decoder = CudaGraphDecoder(model, pool.kv_caches, batch, context + steps + 8, scratch_page=pool.num_pages - 1)
    for _ in range(3):
        decoder.run(token, pos, slot, tables, seq_lens)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        decoder.run(token, pos, slot, tables, seq_lens)
    torch.cuda.synchronize()
    print(f"graphed decode step, batch {batch} at context {context}: {(time.perf_counter() - t) / 20 * 1e3:.2f} ms")
    del decoder, pool


def add_extra_launches(model, n: int) -> None:  # type: ignore[no-untyped-def]
    """After every layer's MLP, n launches of the SiLU-mul kernel on a dummy row (result unused)."""
    from halfbyte.kernels.activation import silu_and_mul_triton
    from halfbyte.model import llama

    dummy = torch.randn(1, 2 * model.cfg.hidden_size, device=model.device, dtype=torch.float16)
    mlp_forward = llama.MLP.forward

    def forward(self, x, x_planes=None):  # type: ignore[no-untyped-def]
        y = mlp_forward(self, x, x_planes)
        for _ in range(n):
            silu_and_mul_triton(dummy)
        return y

    llama.MLP.forward = forward  # type: ignore[method-assign]


def decode_variants(model, pool, max_len: int, variants: list[str], rounds: int, steps: int) -> None:  # type: ignore[no-untyped-def]
    """Graphed batch-1 decode tok/s at ctx 128 / 2048 under each env variant, alternated, each
    with its own capture; the table last, one line per variant with every round's numbers."""
    results: dict[str, list[str]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            saved = dict(os.environ)
            for kv in ([] if v == "default" else v.split(",")):
                key, _, value = kv.partition("=")
                os.environ[key] = value
            try:
                decoder = CudaGraphDecoder(model, pool.kv_caches, 1, max_len, scratch_page=pool.num_pages - 1)
                tok_s = []
                for ctx in (128, 2048):
                    time_decode(model, pool, decoder, ctx, 8, True)  # capture + warm-up
                    tok_s.append(time_decode(model, pool, decoder, ctx, steps, True))
                results[v].append(f"{tok_s[0]:.1f} / {tok_s[1]:.1f}")
                print(f"round {r + 1} {v}: {results[v][-1]} tok/s (ctx 128 / 2048)", flush=True)
                del decoder
                torch.cuda.empty_cache()
            finally:
                os.environ.clear()
                os.environ.update(saved)
    print("\ngraphed decode tok/s, ctx 128 / 2048, per round:")
    for v, got in results.items():
        print(f"  {v:<44} " + "   ".join(got))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--head-bits", type=int, default=None, help="quantize the LM head too (default: dense fp16)")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="print where prefill and eager decode spend GPU time")
    ap.add_argument("--profile-batch", type=int, default=0, help="only profile eager decode at this batch size")
    ap.add_argument("--context", type=int, default=512, help="context of --profile-batch")
    ap.add_argument("--extra-launches", type=int, default=0,
                    help="diagnostic: N more small kernels per layer (SiLU-mul of a dummy row of 2 x hidden values, PDL, "
                    "in the chain): what one launch of a fused-away kernel costs the step")
    ap.add_argument("--env-variants", default=None,
                    help="'A;B;...', each 'VAR=V[,VAR=V]' or 'default': graphed decode at ctx 128 / 2048 under each, "
                    "alternated --rounds times on one model, one fresh graph capture each (only switches read per "
                    "call, such as HALFBYTE_L2_PREFETCH*, change in-process; import-time ones need separate runs)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)  # GPU.md: cuDNN SDPA costs ~2 ms of CPU per call
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = random_model(args.shape, args.bits, args.group, torch.float16, dev, head_bits=args.head_bits)
    if args.extra_launches:
        add_extra_launches(model, args.extra_launches)
    if args.profile_batch:
        with torch.inference_mode():
            profile_batch(model, args.profile_batch, args.context)
        return
    weights_gb = sum(b.numel() * b.element_size() for b in model.buffers()) / 1e9
    dense_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    max_len = 2048 + args.steps + 64
    pool = PagePool(model.cfg, -(-max_len // PAGE) + 1, PAGE, torch.float16, dev)
    if args.env_variants:
        with torch.inference_mode():
            decode_variants(model, pool, max_len, args.env_variants.split(";"), args.rounds, args.steps)
        return
    decoder = CudaGraphDecoder(model, pool.kv_caches, 1, max_len, scratch_page=pool.num_pages - 1)
    rows = {}
    with torch.inference_mode():
        for ctx in (128, 2048):
            time_decode(model, pool, decoder, ctx, 8, True)  # capture + warm-up
            rows[f"decode ctx {ctx} graph"] = time_decode(model, pool, decoder, ctx, args.steps, True)
        rows["decode ctx 128 eager"] = time_decode(model, pool, decoder, 128, 16, False)
        ids = torch.randint(0, model.cfg.vocab_size, (2048,), device=dev)
        table = list(range(2048 // PAGE))
        prefill(model, pool, ids, table)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            prefill(model, pool, ids, table)
        torch.cuda.synchronize()
        rows["prefill 2048 tok/s"] = 3 * 2048 / (time.perf_counter() - t)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                prefill(model, pool, ids, table)
                torch.cuda.synchronize()
            print("GPU time of one 2,048-token prefill:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
            time_decode(model, pool, decoder, 128, 4, False, profile=True)
    peak = torch.cuda.max_memory_allocated() / 1e9
    bytes_per_token = (weights_gb + dense_gb - model.embed_tokens.numel() * 2 / 1e9) * 1e9
    result = dict(shape=args.shape, bits=args.bits, group=args.group, head_bits=args.head_bits, device=torch.cuda.get_device_name(),
                  torch=torch.__version__, quantized_gb=weights_gb, dense_gb=dense_gb, peak_gb=peak,
                  bytes_per_token=bytes_per_token, rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    head = f", head {args.head_bits}-bit" if args.head_bits else ""
    print(f"\n{args.shape} {args.bits}-bit g{args.group}{head} on {result['device']}: quantized {weights_gb:.2f} GB, "
          f"dense {dense_gb:.2f} GB, peak {peak:.2f} GB")
    for name, v in rows.items():
        print(f"{name:<26}{v:>12.1f}")


if __name__ == "__main__":
    main()
