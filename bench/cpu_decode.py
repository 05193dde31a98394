"""CPU decode speed on the embedded default model: halfbyte beside transformers, same run.

Usage: python bench/cpu_decode.py [--model DIR] [--quantized DIR] [--new-tokens 128] [--json OUT.json]

Rows: halfbyte's fp32 reference path on the dequantized import; halfbyte's 4-bit path (the
GGUF's own Q4_1 weights imported bit-exact, bf16 activations, torch's int4 CPU kernel);
transformers fp32 and bf16 on the dequantized import. Prints a table last; the ratios are the
numbers to track (BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

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


def bench_halfbyte(model_dir: Path, new_tokens: int, dtype: str) -> dict[str, float]:
    with LLM(model_dir, device="cpu", dtype=dtype) as llm:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))  # warm-up
        prompt_ids = llm.tokenizer.encode(PROMPT)
        # time prefill and decode separately: first token, then the rest
        t0 = time.perf_counter()
        first: list[float] = []
        llm.generate(prompt_ids, params, on_token=lambda rid, d: first.append(time.perf_counter()) if not first else None)
        total = time.perf_counter() - t0
        ttft = (first[0] - t0) if first else float("nan")
        return {"tokens_per_s": (new_tokens - 1) / (total - ttft), "ttft_s": ttft, "prompt_tokens": len(prompt_ids)}


def bench_transformers(model_dir: Path, new_tokens: int, dtype: torch.dtype) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        total = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == new_tokens
    return {"tokens_per_s": (new_tokens - 1) / (total - ttft), "ttft_s": ttft, "prompt_tokens": ids.shape[1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantized", default=None, help="halfbyte 4-bit directory (default: import the default GGUF)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_default_model(fetch=True)
    quant_dir = Path(args.quantized) if args.quantized else default_quantized_dir()
    rows = {
        "halfbyte fp32": bench_halfbyte(model_dir, args.new_tokens, "float32"),
        "halfbyte 4-bit bf16": bench_halfbyte(quant_dir, args.new_tokens, "bfloat16"),
        "transformers fp32": bench_transformers(model_dir, args.new_tokens, torch.float32),
        "transformers bf16": bench_transformers(model_dir, args.new_tokens, torch.bfloat16),
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
    print(f"\n{'engine':<22}{'decode tok/s':>14}{'TTFT ms':>10}")
    for name, r in rows.items():
        print(f"{name:<22}{r['tokens_per_s']:>14.1f}{r['ttft_s'] * 1000:>10.1f}")
    print(f"halfbyte fp32 / transformers fp32: {result['ratio']:.2f}x; halfbyte 4-bit / transformers fp32: "
          f"{result['ratio_4bit']:.2f}x; halfbyte 4-bit / transformers bf16: {result['ratio_4bit_vs_bf16']:.2f}x")


if __name__ == "__main__":
    main()
