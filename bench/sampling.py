"""Cost of batched sampling against one decode step, measured in the same run.

GPU: python bench/sampling.py [--rows 64] [--vocab 128256] [--context 512] [--json OUT]
  times Sampler.sample on rows x vocab fp32 logits with every filter on (temperature, top-k,
  top-p, min-p, typical, repetition / frequency / presence penalties, logit bias, seeds) and
  without typical (the one filter that needs a full sort), then one Llama-3-8B 4-bit decode step
  at batch `rows` (random weights, CUDA graph), and prints the ratio (goal <= 5%).
  "sample ..." is the default path (fused candidates kernel on CUDA), "old ..." the torch
  filters + race (Sampler(fused=False)); "host ..." is the Python time of one call, the device
  work left queued (see time_host).
CPU: python bench/sampling.py --cpu   small shapes, sampler only."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from halfbyte.engine.sampler import Sampler  # noqa: E402
from halfbyte.sampling_params import SamplingParams  # noqa: E402

PAGE = 16


@dataclass(eq=False)
class BenchSeq:
    params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)


def make_params(i: int, typical: bool) -> SamplingParams:
    return SamplingParams(temperature=0.7 + 0.01 * i, top_k=20 + i, top_p=0.9, min_p=0.02,
                          typical_p=0.95 if typical else 1.0, repetition_penalty=1.1, frequency_penalty=0.2,
                          presence_penalty=0.1, logit_bias={i: 1.0, 100 + i: -2.0}, seed=i)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_sampler(rows: int, vocab: int, context: int, typical: bool, steps: int, dev: torch.device,
                 fused: bool | None = None) -> float:
    """Seconds per Sampler.sample call (host work, kernels and reading the tokens back)."""
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        seqs.append(BenchSeq(make_params(i, typical), prompt, list(prompt)))
    sampler = Sampler({0}, fused=fused)
    logits = torch.randn(rows, vocab, device=dev) * 3
    for _ in range(3):  # warm-up: compiles kernels, admits the rows' token-count slots
        for s, t in zip(seqs, sampler.sample(logits, seqs).token_ids, strict=True):
            s.token_ids.append(t)
    sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        for s, t in zip(seqs, sampler.sample(logits, seqs).token_ids, strict=True):
            s.token_ids.append(t)
    sync(dev)
    return (time.perf_counter() - start) / steps


def time_host(rows: int, vocab: int, context: int, steps: int, dev: torch.device) -> float:
    """Seconds of host (Python) time per call: Sampler.sample_async (everything but the token
    read), its kernels left queued and synchronised outside the timed part."""
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        seqs.append(BenchSeq(make_params(i, True), prompt, list(prompt)))
    sampler = Sampler({0})
    logits = torch.randn(rows, vocab, device=dev) * 3
    for _ in range(3):
        for s, t in zip(seqs, sampler.sample(logits, seqs).token_ids, strict=True):
            s.token_ids.append(t)
    sync(dev)
    total = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        sampler.sample_async(logits, seqs)
        total += time.perf_counter() - start
        sync(dev)
        for s in seqs:
            s.token_ids.append(1)
    return total / steps


def profile_sampler(rows: int, vocab: int, context: int, dev: torch.device) -> None:
    """Where one all-filters call spends host time (cProfile) and GPU time (kernels)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    seqs = [BenchSeq(make_params(i, True), p := torch.randint(0, vocab, (context,), generator=gen).tolist(), list(p))
            for i in range(rows)]
    sampler = Sampler({0})
    logits = torch.randn(rows, vocab, device=dev) * 3
    for _ in range(3):
        sampler.sample(logits, seqs)
    sync(dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        sampler.sample(logits, seqs)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(22)
    if dev.type != "cuda":
        return
    with profile(activities=[ProfilerActivity.CUDA]) as kprof:
        for _ in range(10):
            sampler.sample(logits, seqs)
        sync(dev)
    print("GPU time of 10 all-filters calls:")
    print(kprof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def time_decode_step(rows: int, context: int, steps: int) -> float:
    """Seconds per Llama-3-8B 4-bit decode step at batch `rows` (random weights, CUDA graph)."""
    from random_model import random_model

    from halfbyte.engine.cuda_graphs import CudaGraphDecoder
    from halfbyte.engine.kv_cache import PagePool

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = random_model("llama3-8b", 4, 128, torch.float16, dev)
    per_seq = -(-(context + 64) // PAGE)
    pool = PagePool(model.cfg, rows * per_seq + 1, PAGE, torch.float16, dev)
    decoder = CudaGraphDecoder(model, pool.kv_caches, rows, context + 64, scratch_page=pool.num_pages - 1)
    tables = torch.arange(rows * per_seq, dtype=torch.int32, device=dev).view(rows, per_seq)  # [rows, pages]
    token = torch.randint(0, model.cfg.vocab_size, (rows,), device=dev)
    pos = torch.full((rows,), context, dtype=torch.int64, device=dev)
    slot = tables[:, context // PAGE].long() * PAGE + context % PAGE
    seq_lens = torch.full((rows,), context + 1, dtype=torch.int32, device=dev)
    with torch.inference_mode():
        for _ in range(3):
            decoder.run(token, pos, slot, tables, seq_lens)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            logits = decoder.run(token, pos, slot, tables, seq_lens)
            token = logits.argmax(-1)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cpu", action="store_true", help="small shapes on the CPU, sampler only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="also print host (cProfile) and kernel time of one call")
    args = ap.parse_args()
    if args.cpu:
        dev, rows, vocab, context = torch.device("cpu"), 8, 4096, 64
    else:
        dev, rows, vocab, context = torch.device("cuda"), args.rows, args.vocab, args.context
    results: dict[str, float] = {}
    # new: the default path (the fused candidates kernel on CUDA); old: the torch filters + race
    results["sample all filters ms"] = 1e3 * time_sampler(rows, vocab, context, True, args.steps, dev)
    results["sample no typical ms"] = 1e3 * time_sampler(rows, vocab, context, False, args.steps, dev)
    results["old all filters ms"] = 1e3 * time_sampler(rows, vocab, context, True, args.steps, dev, fused=False)
    results["old no typical ms"] = 1e3 * time_sampler(rows, vocab, context, False, args.steps, dev, fused=False)
    results["host all filters ms"] = 1e3 * time_host(rows, vocab, context, args.steps, dev)
    if not args.cpu:
        results["decode step ms"] = 1e3 * time_decode_step(rows, context, args.steps)
        results["ratio all filters %"] = 100 * results["sample all filters ms"] / results["decode step ms"]
        results["ratio no typical %"] = 100 * results["sample no typical ms"] / results["decode step ms"]
    if args.profile:
        profile_sampler(rows, vocab, context, dev)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=device, torch=torch.__version__, rows=rows, vocab=vocab,
                                                   context=context, results=results), indent=2))
    print(f"\nsampling {rows} rows x {vocab} vocab on {device} (torch {torch.__version__})")
    for name, v in results.items():
        print(f"{name:<26}{v:>10.3f}")


if __name__ == "__main__":
    main()
