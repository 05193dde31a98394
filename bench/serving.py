"""Serving benchmark of the paged engine: many requests through LLMEngine.step().

Cases (each a row of the final table, all written to --out as JSON):
  throughput  N concurrent requests of mixed prompt / output lengths: aggregate tokens/s
  prefix      time to first token of a request whose --prefix-len-token prefix is cached,
              against one with an uncached prefix of the same length (and their ratio)
  itl         the largest gap between tokens of running decodes while a --long-prompt prefills
              in chunks of --max-batch-tokens, against the gap before it arrives
  decode64    --decode-requests x (prompt --decode-prompt, output --decode-output): decode
              tokens/s once all have their first token, with and without async scheduling,
              and its ratio to one request alone
  asynccheck  --check-requests requests mixing greedy, seeded filters, penalties and logprobs
              (prompt 64, output 32), with async scheduling and without: tokens and logprobs equal
  sampling64  the same batch sampling with every filter on (bench/sampling.py's parameters:
              temperature, top-k, top-p, min-p, typical, penalties, logit bias, seeds) against
              greedy, output --sampling-output: what sampling adds to a step, as a share of it

Token times are taken when step() returns them: under async scheduling the engine reads a step's
tokens while the next one runs, so a synchronize here would measure something the engine avoids.

GPU (random-weight quantized model of --shape, no download):
  python bench/serving.py --device cuda --shape llama3-8b --out serving_gpu.json
CPU (the default SmolLM2 model), small sizes:
  python bench/serving.py --device cpu --num-requests 8 --prefix-len 256 --long-prompt 1024 \
      --max-batch-tokens 256 --decode-requests 8 --decode-prompt 64 --decode-output 16 --out serving_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from halfbyte.engine import llm_engine as engine_module  # noqa: E402
from halfbyte.engine.config import EngineConfig  # noqa: E402
from halfbyte.engine.llm_engine import LLMEngine  # noqa: E402
from halfbyte.model.loader import LoadedModel  # noqa: E402
from halfbyte.sampling_params import SamplingParams  # noqa: E402


class _SilentTokenizer:
    """Random weights have no tokenizer: token ids in, no text out."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def random_engine(shape: str, bits: int, config: EngineConfig) -> LLMEngine:
    from random_model import random_model

    dev = torch.device("cuda")
    model = random_model(shape, bits, 128, torch.float16, dev, max_position_embeddings=config.max_model_len or 32768)
    fake_dir = Path(tempfile.mkdtemp())
    loaded = LoadedModel(fake_dir, model.cfg, _SilentTokenizer(), model)  # type: ignore[arg-type]
    saved = engine_module.resolve_loadable, engine_module.is_quantized, engine_module.load_pretrained
    engine_module.resolve_loadable = lambda *a, **k: fake_dir  # type: ignore[assignment]
    engine_module.is_quantized = lambda *a, **k: True  # type: ignore[assignment]
    engine_module.load_pretrained = lambda *a, **k: loaded  # type: ignore[assignment]
    try:
        return LLMEngine(None, device="cuda", dtype="float16", config=config)
    finally:
        engine_module.resolve_loadable, engine_module.is_quantized, engine_module.load_pretrained = saved


class Run:
    """Requests added to an engine, stepped to the end, with the host time of every token."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.token_times: dict[str, list[float]] = {}
        self.added: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[dict[int, float]]] = {}
        self.step_times: list[tuple[float, float]] = []  # (end, duration) of each step() call

    def add(self, rid: str, ids: list[int], out_len: int, params: SamplingParams | None = None,
            cache_salt: str | None = None) -> None:
        base = params or SamplingParams(temperature=0)
        self.engine.add_request(rid, ids, replace(base, max_tokens=out_len, ignore_eos=True), cache_salt=cache_salt)
        self.added[rid] = time.perf_counter()
        self.token_times[rid] = []

    def step(self) -> None:
        before = time.perf_counter()
        outs = self.engine.step()  # tokens returned are on the host: their GPU work is done
        now = time.perf_counter()
        self.step_times.append((now, now - before))
        for o in outs:
            self.token_times[o.request_id].extend([now] * len(o.new_token_ids))
            self.logprobs.setdefault(o.request_id, []).extend(o.logprobs or [])
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    def until_done(self, rids: list[str] | None = None) -> None:
        while any(len(self.token_times[r]) == 0 or self.engine.sequence(r) is not None for r in rids or self.token_times):
            if not self.engine.has_unfinished():
                break
            self.step()


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


def case_throughput(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    run = Run(engine)
    vocab = engine.model_config.vocab_size
    prompt_tokens = 0
    start = time.perf_counter()
    for i in range(args.num_requests):
        n = rng.randint(args.prompt_min, args.prompt_max)
        prompt_tokens += n
        run.add(f"tp{i}", random_ids(rng, n, vocab), rng.randint(args.output_min, args.output_max))
    run.until_done()
    elapsed = time.perf_counter() - start
    generated = sum(len(t) for t in run.token_times.values())
    return {"requests": args.num_requests, "prompt_tokens": prompt_tokens, "generated_tokens": generated,
            "seconds": elapsed, "output_tok_s": generated / elapsed, "total_tok_s": (generated + prompt_tokens) / elapsed}


def _ttft(engine: LLMEngine, rid: str, ids: list[int]) -> float:
    run = Run(engine)
    run.add(rid, ids, 1)
    run.until_done([rid])
    return run.token_times[rid][0] - run.added[rid]


def case_prefix(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    warm = random_ids(rng, 64, vocab)
    _ttft(engine, "warm", warm)
    # a 16-token prefix hit first: on CUDA it replays the decode graph of the cached request's
    # 16 rows (runner.py, token_rows.py), whose lazy capture must not land in the measurement
    _ttft(engine, "warm-hit", warm[:48] + random_ids(rng, 16, vocab))
    prefix = random_ids(rng, args.prefix_len, vocab)
    _ttft(engine, "seed-prefix", prefix + random_ids(rng, 16, vocab))  # puts the prefix in the cache
    uncached = _ttft(engine, "uncached", random_ids(rng, args.prefix_len + 16, vocab))
    before = engine.stats()
    cached = _ttft(engine, "cached", prefix + random_ids(rng, 16, vocab))
    after = engine.stats()
    return {"prefix_len": args.prefix_len, "ttft_uncached_ms": uncached * 1e3, "ttft_cached_ms": cached * 1e3,
            "speedup": uncached / cached, "hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
            "computed_tokens": after.prefix_miss_tokens - before.prefix_miss_tokens}


def case_itl(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    run = Run(engine)
    decodes = [f"d{i}" for i in range(args.itl_decodes)]
    for rid in decodes:
        run.add(rid, random_ids(rng, 32, vocab), 100_000 if False else args.itl_output)
    for _ in range(8):  # all decoding, a few steady gaps
        run.step()
    steady_from = {r: len(run.token_times[r]) for r in decodes}
    run.add("long", random_ids(rng, args.long_prompt, vocab), 1)
    long_seq = engine.sequence("long")
    prefill_steps = 0
    while long_seq is not None and long_seq.num_computed_tokens < args.long_prompt:
        run.step()
        prefill_steps += 1
    during_from = {r: len(run.token_times[r]) for r in decodes}
    run.step()  # the long prompt's last chunk and first token

    def max_gap(rid: str, lo: int, hi: int) -> float:
        t = run.token_times[rid][max(lo - 1, 0) : hi]
        return max((b - a for a, b in zip(t, t[1:])), default=0.0)

    steady = max(max_gap(r, 1, steady_from[r]) for r in decodes)
    during = max(max_gap(r, steady_from[r], during_from[r] + 1) for r in decodes)
    missed = sum(prefill_steps - (during_from[r] - steady_from[r]) for r in decodes)
    for rid in decodes:
        engine.abort_request(rid)
    return {"long_prompt": args.long_prompt, "max_batch_tokens": engine.config.max_batch_tokens,
            "decodes": len(decodes), "prefill_steps": prefill_steps, "decode_steps_missed": missed,
            "max_gap_steady_ms": steady * 1e3, "max_gap_during_prefill_ms": during * 1e3}


_last_p50: dict[int, float] = {}  # batch size -> median step() time of the last _decode_rate window
_last_full: dict[int, float] = {}  # batch size -> tokens/s of that window while all n requests ran


def _warm(engine: LLMEngine, n: int, rng: random.Random, params: list[SamplingParams] | None = None) -> None:
    """Short requests whose lengths differ, so the batch shrinks step by step: every kernel
    specialization and graph bucket the measurement will meet is compiled before it."""
    vocab = engine.model_config.vocab_size
    run = Run(engine)
    for i in range(n):
        run.add(f"warm-{rng.random():.6f}-{i}", random_ids(rng, 32, vocab), 2 + i % 16, params[i] if params else None)
    run.until_done()


def _decode_rate(engine: LLMEngine, n: int, prompt: int, output: int, rng: random.Random,
                 params: list[SamplingParams] | None = None, salt: str | None = None) -> tuple[float, list[list[int]]]:
    """Decode tokens/s once every request has its first token, and each request's tokens.
    salt: a prefix-cache salt, so that a rerun of the same prompts computes them again."""
    vocab = engine.model_config.vocab_size
    run = Run(engine)
    rids = [f"dec{n}-{rng.random():.6f}-{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        run.add(rid, random_ids(rng, prompt, vocab), output, params[i] if params else None, salt)
    while any(not run.token_times[r] for r in rids):
        run.step()
    start = max(run.token_times[r][0] for r in rids)
    run.until_done(rids)
    end = max(run.token_times[r][-1] for r in rids)
    tokens = sum(sum(1 for t in run.token_times[r] if t > start) for r in rids)
    durations = sorted(d for t, d in run.step_times if start < t <= end)
    _last_p50[n] = durations[len(durations) // 2] if durations else float("nan")
    # while all n run: from the last first token to the first request's last token
    full_end = min(run.token_times[r][-1] for r in rids)
    full_tokens = sum(sum(1 for t in run.token_times[r] if start < t <= full_end) for r in rids)
    _last_full[n] = full_tokens / (full_end - start) if full_end > start else float("nan")
    if durations:  # the spread of step() calls in the window: one-off stalls show here
        p50, p90 = durations[len(durations) // 2], durations[int(0.9 * (len(durations) - 1))]
        print(f"  decode n={n}: {len(durations)} steps, p50 {p50 * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms, "
              f"max {durations[-1] * 1e3:.1f} ms, sum {sum(durations):.3f} s of {end - start:.3f} s", flush=True)
    return tokens / (end - start), [run.tokens[r] for r in rids]


def case_decode(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    n, prompt, out = args.decode_requests, args.decode_prompt, args.decode_output
    _warm(engine, n, rng)
    one, _ = _decode_rate(engine, 1, prompt, out, rng)
    seed = rng.random()
    many, tokens = _decode_rate(engine, n, prompt, out, random.Random(seed), salt="async")
    many_p50, many_full = n / _last_p50[n], _last_full[n]
    was, engine.async_scheduling = engine.async_scheduling, False
    try:  # the same prompts, computed again (another cache salt), greedy: the same tokens expected
        sync_rate, sync_tokens = _decode_rate(engine, n, prompt, out, random.Random(seed), salt="sync")
        sync_p50 = n / _last_p50[n]
    finally:
        engine.async_scheduling = was
    return {"requests": n, "prompt": prompt, "output": out, "async_scheduling": was, "decode_tok_s": many,
            "decode_tok_s_sync": sync_rate, "tokens_equal_sync": tokens == sync_tokens,
            "decode_tok_s_median_step": many_p50, "decode_tok_s_all_running": many_full, "decode_tok_s_sync_median_step": sync_p50,
            "first_difference": [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                 for x, y in zip(tokens, sync_tokens) if x != y],
            "batch1_tok_s": one, "ratio_to_batch1": many / one}


def _profile_steps(engine: LLMEngine, params: list[SamplingParams], prompt: int, rng: random.Random) -> None:
    """Host (cProfile) and device (torch.profiler) time of 24 steady decode steps, printed."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    run = Run(engine)
    vocab = engine.model_config.vocab_size
    for i, p in enumerate(params):
        run.add(f"prof-{i}", random_ids(rng, prompt, vocab), 40, p)
    while any(not t for t in run.token_times.values()):  # prefill
        run.step()
    for _ in range(4):  # first decodes
        run.step()
    prof = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
        prof.enable()
        for _ in range(24):
            run.step()
        prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(tprof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(tprof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    run.until_done()


def case_async_check(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from sampling import make_params

    n, vocab = args.check_requests, engine.model_config.vocab_size
    kinds = [SamplingParams(temperature=0), make_params(1, typical=True),
             SamplingParams(temperature=0.8, top_p=0.9, seed=5, repetition_penalty=1.2, logprobs=3),
             SamplingParams(temperature=0, logprobs=1, frequency_penalty=0.5)]
    prompts = [random_ids(rng, 64, vocab) for _ in range(n)]
    results = []
    was = engine.async_scheduling
    for on in (True, False):
        engine.async_scheduling = on
        run = Run(engine)
        for i, ids in enumerate(prompts):
            run.add(f"check-{on}-{i}", ids, 32, kinds[i % len(kinds)], cache_salt=f"check-{on}")
        run.until_done()
        results.append([(run.tokens[f"check-{on}-{i}"], run.logprobs.get(f"check-{on}-{i}", [])) for i in range(n)])
    engine.async_scheduling = was
    same = [a == b for a, b in zip(*results, strict=True)]
    return {"requests": n, "equal": sum(same), "all_equal": all(same),
            "logprob_tokens": sum(len(lp) for _, lp in results[0])}


def case_sampling(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from sampling import make_params

    n, prompt, out = args.decode_requests, args.decode_prompt, args.sampling_output
    params = [make_params(i, typical=True) for i in range(n)]
    _warm(engine, n, rng)  # graphs, and the sampling kernels' first compile at each batch size
    _warm(engine, n, rng, params)
    greedy, _ = _decode_rate(engine, n, prompt, out, rng)
    p50_greedy = _last_p50[n]
    filtered, _ = _decode_rate(engine, n, prompt, out, rng, params)
    p50_filtered = _last_p50[n]
    step_greedy, step_filtered = n / greedy * 1e3, n / filtered * 1e3  # ms per engine step
    if args.profile_sampling:
        _profile_steps(engine, [make_params(i, typical=True) for i in range(n)], prompt, rng)
    return {"requests": n, "prompt": prompt, "output": out, "greedy_tok_s": greedy, "all_filters_tok_s": filtered,
            "step_ms_greedy": step_greedy, "step_ms_all_filters": step_filtered,
            "sampling_share": (step_filtered - step_greedy) / step_greedy,
            "median_step_ms_greedy": p50_greedy * 1e3, "median_step_ms_all_filters": p50_filtered * 1e3,
            "sampling_share_median": (p50_filtered - p50_greedy) / p50_greedy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="llama3-8b", help="GPU: random-weight shape from bench/random_model.py")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--model", default=None, help="CPU: a model directory (default: SmolLM2)")
    ap.add_argument("--cases", default="throughput,prefix,itl,decode64,sampling64,asynccheck")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--output-min", type=int, default=16)
    ap.add_argument("--output-max", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--long-prompt", type=int, default=16384)
    ap.add_argument("--itl-decodes", type=int, default=8)
    ap.add_argument("--itl-output", type=int, default=100_000)
    ap.add_argument("--decode-requests", type=int, default=64)
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--decode-output", type=int, default=256)
    ap.add_argument("--sampling-output", type=int, default=128)
    ap.add_argument("--check-requests", type=int, default=16)
    ap.add_argument("--profile-sampling", action="store_true", help="profile 24 all-filter decode steps")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.itl_output = min(args.itl_output, args.long_prompt)  # enough to outlast the prefill
    max_len = max(args.long_prompt, args.prefix_len, args.prompt_max, args.decode_prompt) + max(args.output_max, args.decode_output) + 64
    config = EngineConfig(max_model_len=max_len, max_batch_tokens=args.max_batch_tokens,
                          max_num_seqs=max(args.max_num_seqs, args.decode_requests),
                          # CPU: room for the shared prefix to survive the uncached request between
                          kv_cache_tokens=args.kv_cache_tokens or (None if args.device.startswith("cuda") else 4 * max_len))
    if args.device.startswith("cuda"):
        engine = random_engine(args.shape, args.bits, config)
        label = f"{args.shape} {args.bits}-bit random, {torch.cuda.get_device_name()}"
    else:
        from halfbyte.io.default_model import ensure_default_model

        model = args.model or ensure_default_model(fetch=True)
        engine = LLMEngine(model, device="cpu", dtype="float32", config=config)
        label = f"{Path(str(model)).name} fp32, CPU"
    rng = random.Random(0)
    runners = {"throughput": case_throughput, "prefix": case_prefix, "itl": case_itl, "decode64": case_decode,
               "sampling64": case_sampling, "asynccheck": case_async_check}
    results: dict[str, Any] = {"device": label, "torch": torch.__version__, "pages": engine.pool.num_pages,
                               "page_size": engine.pool.page_size, "args": vars(args)}
    for name in args.cases.split(","):
        results[name] = runners[name](engine, args, rng)
        print(name, json.dumps(results[name]), flush=True)
    results["stats"] = vars(engine.stats())
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nserving benchmark: {label}, {engine.pool.num_pages} pages of {engine.pool.page_size}")
    rows = []
    if "throughput" in results:
        r = results["throughput"]
        rows.append(("throughput", f"{r['requests']} req, {r['prompt_tokens']} prompt tok",
                     f"{r['output_tok_s']:.1f} out tok/s, {r['total_tok_s']:.1f} total tok/s"))
    if "prefix" in results:
        r = results["prefix"]
        rows.append(("TTFT, cached prefix", f"prefix {r['prefix_len']}, computed {r['computed_tokens']} tok",
                     f"{r['ttft_cached_ms']:.1f} ms vs {r['ttft_uncached_ms']:.1f} ms uncached ({r['speedup']:.1f}x)"))
    if "itl" in results:
        r = results["itl"]
        rows.append(("max inter-token gap", f"{r['decodes']} decodes, {r['long_prompt']}-tok prompt, budget {r['max_batch_tokens']}",
                     f"{r['max_gap_during_prefill_ms']:.1f} ms during prefill vs {r['max_gap_steady_ms']:.1f} ms before; "
                     f"{r['decode_steps_missed']} missed decode steps"))
    if "decode64" in results:
        r = results["decode64"]
        rows.append(("decode throughput", f"{r['requests']} x (prompt {r['prompt']}, out {r['output']})",
                     f"{r['decode_tok_s']:.1f} tok/s, {r['decode_tok_s_all_running']:.1f} while all run, "
                     f"median step {r['decode_tok_s_median_step']:.1f} "
                     f"(sync {r['decode_tok_s_sync']:.1f}, same tokens: "
                     f"{r['tokens_equal_sync']}), "
                     f"{r['ratio_to_batch1']:.1f}x batch 1 ({r['batch1_tok_s']:.1f})"))
    if "asynccheck" in results:
        r = results["asynccheck"]
        rows.append(("async vs sync outputs", f"{r['requests']} mixed requests, {r['logprob_tokens']} logprob tokens",
                     f"{r['equal']}/{r['requests']} equal (tokens and logprobs)"))
    if "sampling64" in results:
        r = results["sampling64"]
        rows.append(("sampling, all filters", f"{r['requests']} x (prompt {r['prompt']}, out {r['output']})",
                     f"step {r['step_ms_all_filters']:.2f} vs {r['step_ms_greedy']:.2f} ms greedy: "
                     f"+{100 * r['sampling_share']:.1f}% of the step; median steps "
                     f"{r['median_step_ms_all_filters']:.2f} vs {r['median_step_ms_greedy']:.2f} ms: "
                     f"+{100 * r['sampling_share_median']:.1f}%"))
    width = max(len(a) for a, _, _ in rows)
    wid2 = max(len(b) for _, b, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{width}}  {b:<{wid2}}  {c}")


if __name__ == "__main__":
    main()
