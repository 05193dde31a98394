"""exllamav2 0.3.2's converter on SmolLM2 at issue 3's budgets: perplexity, KL and top-1 agreement
against the reference on the same held-out token windows halfbyte's converter is measured on
(bench/quant_quality.py), so the two converters can be compared at equal bits per weight.

GPU machine only (exllamav2 quantizes and runs with CUDA). Steps:
  1. import the default Q4_1 GGUF (the reference) with halfbyte's importer, write an fp16 copy;
  2. exllamav2's own converter (`python -m exllamav2.conversion.convert_exl2`, its built-in
     calibration data, one measurement pass reused across budgets, head at --head-bits);
  3. score every window with exllamav2: the fp16 reference and each converted model (fp16
     logits), KL(reference || model), top-1 agreement, perplexity; the bits per weight each
     model really stores (every tensor of the decoder layers except norms, over their weights).
The windows come as JSON made on the CPU machine with halfbyte's own tokenizer and windowing:
  python bench/exl2_quality.py --make-windows TEXT --out .evaltext/windows.json [--ctx 1024 --windows 16]
then there: STEPS=exl2q bash bench/gpu_check.sh (carry .whl, the GGUF parts and .evaltext).
If CUDA or exllamav2 is missing it says NOT RUN: a comparison that could not run is never passed."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# exllamav2 0.3.2 without flash-attn runs prefill attention through torch SDPA with the mask of
# `get_block_diag_mask`, which is None for a plain causal batch: the attention is not causal
# (measured: the fp16 reference scored ppl 193.6 where halfbyte's CPU reference scores 28.38),
# and the converter's calibration forward passes take the same path. Its matmul path builds the
# causal mask; EXLLAMA_NO_SDPA selects it here and in the converter's subprocess.
os.environ["EXLLAMA_NO_SDPA"] = "1"


def make_windows(text: str, out: str, ctx: int, windows: int) -> None:
    from halfbyte.io.model_dir import resolve_model_dir
    from halfbyte.io.tokenizer import Tokenizer
    from halfbyte.quant.evaluate import eval_windows, read_eval_text

    ids = Tokenizer(resolve_model_dir(None)).encode(read_eval_text(text), add_special_tokens=False)
    wins = eval_windows(ids, ctx, windows)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"text": Path(text).name, "ctx": ctx, "windows": wins}))
    print(f"{len(wins)} windows of {ctx} tokens from {text} -> {out}")


def fp16_reference(gguf: Path, work: Path) -> Path:
    """The GGUF imported by halfbyte (fp32 safetensors), then an fp16 copy for exllamav2."""
    from safetensors.torch import load_file, save_file

    from halfbyte.io.gguf_import import import_gguf

    f32, f16 = work / "ref_f32", work / "ref_f16"
    if not (f32 / "config.json").exists():
        import_gguf(gguf, f32)
    if not (f16 / "config.json").exists():
        f16.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (f32 / name).exists():
                (f16 / name).write_bytes((f32 / name).read_bytes())
        tensors = {k: v.half().contiguous() for k, v in load_file(str(f32 / "model.safetensors")).items()}
        save_file(tensors, str(f16 / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((f32 / "config.json").read_text())
        cfg["torch_dtype"] = "float16"
        (f16 / "config.json").write_text(json.dumps(cfg, indent=2))
    return f16


# exllamav2's converter imports pandas and fastparquet at the top for parquet calibration files,
# which this run does not use (its built-in calibration text); the GPU machine has neither and
# no package index. Placeholders that fail on first use stand in only where they are missing.
_CONVERT = """
import runpy, sys, types
import torch  # before the placeholders: torch's import inspects the loaded modules
for name in ("pandas", "fastparquet"):
    try:
        __import__(name)
    except ImportError:
        def missing(attr, name=name):
            if attr.startswith("__"):  # hasattr(module, "__file__") and the like
                raise AttributeError(attr)
            raise ImportError(name + " is not installed (needed only for parquet calibration files)")
        module = types.ModuleType(name)
        module.__getattr__ = missing
        sys.modules[name] = module
runpy.run_module("exllamav2.conversion.convert_exl2", run_name="__main__", alter_sys=True)
"""


def convert(ref: Path, work: Path, bits: float, head_bits: int, measurement: Path | None) -> tuple[Path, float, Path]:
    job, out = work / f"job_{bits}", work / f"exl2_{bits}"
    cmd = [sys.executable, "-c", _CONVERT, "-i", str(ref), "-o", str(job), "-cf", str(out),
           "-b", str(bits), "-hb", str(head_bits), "-nr"]
    if measurement is not None:
        cmd += ["-m", str(measurement)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    (work / f"convert_{bits}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not (out / "config.json").exists():
        raise SystemExit(f"exllamav2 convert at {bits} bpw failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    return out, seconds, job / "measurement.json"


def stored_bpw(model_dir: Path) -> float:
    """Bits stored by the decoder layers' matrices (q weights, scales, groups, permutations) over
    their weight count: the accounting of halfbyte's budget."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    per_layer = h * hd * (cfg["num_attention_heads"] * 2 + cfg["num_key_value_heads"] * 2) + 3 * h * inter
    bits = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k.startswith("model.layers.") and "layernorm" not in k:
                    t = st.get_tensor(k)
                    bits += t.numel() * t.element_size() * 8
    return bits / (per_layer * n)


class Scorer:
    """exllamav2 forward over whole windows, no cache: fp16 logits for every position."""

    def __init__(self, model_dir: Path, ctx: int) -> None:
        from exllamav2 import ExLlamaV2, ExLlamaV2Config

        config = ExLlamaV2Config(str(model_dir))
        config.max_seq_len = max(ctx, 2048)
        config.max_input_len = max(ctx, 2048)
        config.max_attention_size = max(ctx, 2048) ** 2
        self.model = ExLlamaV2(config)
        self.model.load()

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        logits = self.model.forward(torch.tensor([ids], dtype=torch.long), cache=None)
        return torch.log_softmax(logits[0].float(), dim=-1)

    def unload(self) -> None:
        self.model.unload()
        del self.model
        torch.cuda.empty_cache()


def score(model_dir: Path, windows: list[list[int]], ctx: int, ref: list[torch.Tensor] | None) -> tuple[dict[str, float], list[torch.Tensor]]:
    s = Scorer(model_dir, ctx)
    nll = kl = 0.0
    agree = count = predicted = 0
    outs = []
    for i, ids in enumerate(windows):
        lp = s.logprobs(ids)
        tgt = torch.tensor(ids[1:], device=lp.device)
        nll -= float(lp[:-1].double().gather(1, tgt[:, None]).sum())
        predicted += len(ids) - 1
        if ref is not None:
            r = ref[i]
            kl += float((r.double().exp() * (r.double() - lp.double())).sum())
            agree += int((r.argmax(-1) == lp.argmax(-1)).sum())
            count += len(ids)
        else:
            outs.append(lp)
    s.unload()
    res = {"ppl": math.exp(nll / predicted)}
    if ref is not None:
        res.update(kl=kl / count, top1=agree / count)
    return res, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-windows", metavar="TEXT", help="CPU side: write the token windows of TEXT to --out")
    ap.add_argument("--out", default=".evaltext/windows.json")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--gguf", help="the default model's GGUF (the reference)")
    ap.add_argument("--windows-json", default=".evaltext/windows.json")
    ap.add_argument("--budgets", default="4.25,3.25,2.5")
    ap.add_argument("--head-bits", type=int, default=8, help="exllamav2's head bits (halfbyte keeps the head dense)")
    ap.add_argument("--work", default="/tmp/exl2q")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.make_windows:
        return make_windows(args.make_windows, args.out, args.ctx, args.windows)

    def not_run(reason: str) -> None:
        print(f"exl2 quality: NOT RUN ({reason})")
        if args.json:
            Path(args.json).write_text(json.dumps({"not_run": reason}))

    if not torch.cuda.is_available():
        return not_run("no CUDA device")
    try:
        import exllamav2  # noqa: F401
    except Exception as e:
        return not_run(f"exllamav2 does not import: {type(e).__name__}: {e}")
    if not args.gguf or not Path(args.gguf).is_file() or not Path(args.windows_json).is_file():
        return not_run("the GGUF or the windows JSON is missing")
    data = json.loads(Path(args.windows_json).read_text())
    windows, ctx = data["windows"], data["ctx"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ref_dir = fp16_reference(Path(args.gguf), work)
    ref_res, ref_lp = score(ref_dir, windows, ctx, None)
    print(f"reference (exllamav2, fp16): ppl {ref_res['ppl']:.3f} over {len(windows)} x {ctx} tokens", flush=True)
    rows: list[dict[str, Any]] = []
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, exllamav2=exllamav2.__version__,
                  text=data.get("text"), windows=len(windows), ctx=ctx, head_bits=args.head_bits,
                  reference_ppl=ref_res["ppl"], rows=rows)
    measurement = None
    for b in (float(x) for x in args.budgets.split(",")):
        out, seconds, meas = convert(ref_dir, work, b, args.head_bits, measurement)
        measurement = measurement or meas
        res, _ = score(out, windows, ctx, ref_lp)
        row = dict(budget=b, stored_bpw=stored_bpw(out), seconds=seconds, **res,
                   dppl_pct=100 * (res["ppl"] / ref_res["ppl"] - 1))
        rows.append(row)
        print(f"exl2 {b}: stored {row['stored_bpw']:.3f} bpw, ppl {row['ppl']:.3f} ({row['dppl_pct']:+.1f}%), "
              f"KL {row['kl']:.4f}, top-1 {row['top1']:.3f}, convert {seconds:.0f} s", flush=True)
        if args.json:  # after every budget: a step timeout keeps the finished ones
            Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nexllamav2 {exllamav2.__version__} on SmolLM2 (reference ppl {ref_res['ppl']:.3f}, head {args.head_bits} bits)")
    print(f"{'budget':>7}{'stored':>8}{'ppl':>9}{'dppl':>8}{'KL':>8}{'top-1':>7}")
    for r in rows:
        print(f"{r['budget']:>7}{r['stored_bpw']:>8.3f}{r['ppl']:>9.3f}{r['dppl_pct']:>+7.1f}%{r['kl']:>8.4f}{r['top1']:>7.3f}")


if __name__ == "__main__":
    main()
