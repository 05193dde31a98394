"""Where an eager (not graphed) forward spends host time: wall per step against GPU time, and
the Python functions that cost the most (cProfile).

Usage: python bench/eager_overhead.py [--shape llama3-8b] [--tokens 1] [--steps 5]
An eager step matters for prefill chunks and extends (a prefix-cache hit computes ~16 tokens);
graphed decode does not pay it."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_model import random_model  # noqa: E402

from halfbyte.engine.kv_cache import PagePool  # noqa: E402
from halfbyte.kernels.attention import AttentionMetadata  # noqa: E402

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=1, help="new tokens per step (1 = decode, 16 = a small extend)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    dev = torch.device("cuda")
    model = random_model(args.shape, 4, 128, torch.float16, dev)
    pages = -(-(args.context + args.tokens) // PAGE)
    pool = PagePool(model.cfg, pages + 1, PAGE, torch.float16, dev)
    table = torch.arange(pages, dtype=torch.int32, device=dev)[None]
    n, start = args.tokens, args.context
    ids = torch.randint(0, model.cfg.vocab_size, (n,), device=dev)
    pos = torch.arange(start, start + n, device=dev)
    slots = pos.clone()  # pages are 0..pages-1 in order: slot = position

    def step() -> torch.Tensor:
        meta = AttentionMetadata([0, n], [start + n], table, slots, contiguous_from=[0])
        return model.compute_logits(model(ids, pos, pool.kv_caches, meta)[-1:])

    with torch.inference_mode():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.steps
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        ev0.record()
        step()
        ev1.record()
        ev1.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)
    print(out.getvalue())
    print(f"{args.shape}, {n} new tokens at context {start}: eager step wall {wall * 1e3:.2f} ms, "
          f"GPU span of one step {ev0.elapsed_time(ev1):.2f} ms")


if __name__ == "__main__":
    main()
