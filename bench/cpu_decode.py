"""CPU decode speed on the embedded default model: halfbyte beside transformers, same run.

Usage: python bench/cpu_decode.py [--model DIR] [--quantized DIR] [--new-tokens 128] [--prefill 128,512,1024]
                                  [--long-context 1024] [--json OUT.json]

Rows: halfbyte's fp32 reference path on the dequantized import; halfbyte's 4-bit path (the
GGUF's own Q4_1 weights imported bit-exact, bf16 activations, torch's int4 CPU kernel);
transformers fp32 and bf16 on the dequantized import. Per row also: prefill speed of prompts of
the --prefill lengths (random token ids, a different prompt for every timed run: no prefix-cache
hits; best of 3) and decode speed after a --long-context prompt. Prints a table last; the
ratios are the numbers to track (BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halfbyte import LLM, SamplingParams  # noqa: E402
from halfbyte.io.default_model import default_gguf_path, ensure_default_model  # noqa: E402
from halfbyte.quant.import_checkpoint import convert_if_foreign  # noqa: E402


def default_quantized_dir() -> Path:
    """The default GGUF imported with its Q4_1 weights kept (bit-exact), made once (cached)."""
    ensure_default_model(fetch=True)
    return convert_if_foreign(default_gguf_path())

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_speed(run: Callable[[list[int]], object], n: int, vocab: int) -> float:
    """Prompt tokens/s of run(prompt) on n random tokens: best of 3 prompts after a warm-up one,
    each prompt different (no prefix-cache hits)."""
    times = []
    for seed in range(4):  # the first warms this length up
        ids = random_prompt(n, vocab, seed)
        t0 = time.perf_counter()
        run(ids)
        times.append(time.perf_counter() - t0)
    return n / min(times[1:])


def _decode_speed(llm: LLM, prompt_ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s after the first token, time to the first token in s)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    first: list[float] = []
    llm.generate(prompt_ids, params, on_token=lambda rid, d: first.append(time.perf_counter()) if not first else None)
    total = time.perf_counter() - t0
    ttft = (first[0] - t0) if first else float("nan")
    return (new_tokens - 1) / (total - ttft), ttft


def bench_halfbyte(model_dir: Path, new_tokens: int, dtype: str, prefill: list[int], long_context: int) -> dict[str, float]:
    with LLM(model_dir, device="cpu", dtype=dtype) as llm:
        llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))  # warm-up
        prompt_ids = llm.tokenizer.encode(PROMPT)
        # time prefill and decode separately: first token, then the rest
        speed, ttft = _decode_speed(llm, prompt_ids, new_tokens)
        row = {"tokens_per_s": speed, "ttft_s": ttft, "prompt_tokens": len(prompt_ids)}
        vocab = llm.tokenizer.vocab_size
        for n in prefill:
            row[f"prefill_{n}_tokens_per_s"] = _prefill_speed(
                lambda ids: llm.generate(ids, SamplingParams(max_tokens=1, temperature=0)), n, vocab)
        if long_context:
            row[f"decode_after_{long_context}_tokens_per_s"] = _decode_speed(
                llm, random_prompt(long_context, vocab, 99), new_tokens)[0]
        return row


def _transformers_decode_speed(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s after the first token, time to the first token in s): one generate of a
    single token, then one of new_tokens."""
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    total = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == new_tokens
    return (new_tokens - 1) / (total - ttft), ttft


def bench_transformers(model_dir: Path, new_tokens: int, dtype: torch.dtype, prefill: list[int],
                       long_context: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up
        speed, ttft = _transformers_decode_speed(model, ids, new_tokens)
        row = {"tokens_per_s": speed, "ttft_s": ttft, "prompt_tokens": ids.shape[1]}
        for n in prefill:  # one forward pass over the prompt: what generate's first step does
            row[f"prefill_{n}_tokens_per_s"] = _prefill_speed(
                lambda ids: model(torch.tensor([ids]), logits_to_keep=1), n, len(tok))
        if long_context:
            x = torch.tensor([random_prompt(long_context, len(tok), 99)])
            model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)  # warm-up at this length
            row[f"decode_after_{long_context}_tokens_per_s"] = _transformers_decode_speed(model, x, new_tokens)[0]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantized", default=None, help="halfbyte 4-bit directory (default: import the default GGUF)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", default="128,512,1024", help="prompt lengths whose prefill speed is timed ('' for none)")
    ap.add_argument("--long-context", type=int, default=1024, help="decode speed after a prompt this long (0: skip)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_default_model(fetch=True)
    quant_dir = Path(args.quantized) if args.quantized else default_quantized_dir()
    prefill = [int(v) for v in args.prefill.split(",") if v]
    extra = (prefill, args.long_context)
    rows = {
        "halfbyte fp32": bench_halfbyte(model_dir, args.new_tokens, "float32", *extra),
        "halfbyte 4-bit bf16": bench_halfbyte(quant_dir, args.new_tokens, "bfloat16", *extra),
        "transformers fp32": bench_transformers(model_dir, args.new_tokens, torch.float32, *extra),
        "transformers bf16": bench_transformers(model_dir, args.new_tokens, torch.bfloat16, *extra),
    }
    speed = {name: r["tokens_per_s"] for name, r in rows.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "threads": args.threads, "torch": torch.__version__, "new_tokens": args.new_tokens, "rows": rows,
        "ratio": speed["halfbyte fp32"] / speed["transformers fp32"],
        "ratio_4bit": speed["halfbyte 4-bit bf16"] / speed["transformers fp32"],
        "ratio_4bit_vs_bf16": speed["halfbyte 4-bit bf16"] / speed["transformers bf16"],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    cols = [f"prefill_{n}_tokens_per_s" for n in prefill] + (
        [f"decode_after_{args.long_context}_tokens_per_s"] if args.long_context else [])
    heads = [f"prefill {n}" for n in prefill] + ([f"decode @{args.long_context}"] if args.long_context else [])
    print(f"\n{'engine':<22}{'decode tok/s':>14}{'TTFT ms':>10}" + "".join(f"{h:>16}" for h in heads) + "  (tok/s)")
    for name, r in rows.items():
        print(f"{name:<22}{r['tokens_per_s']:>14.1f}{r['ttft_s'] * 1000:>10.1f}" + "".join(f"{r[c]:>16.1f}" for c in cols))
    print(f"halfbyte fp32 / transformers fp32: {result['ratio']:.2f}x; halfbyte 4-bit / transformers fp32: "
          f"{result['ratio_4bit']:.2f}x; halfbyte 4-bit / transformers bf16: {result['ratio_4bit_vs_bf16']:.2f}x")


if __name__ == "__main__":
    main()
