"""Quantization quality: perplexity and KL(ref || quantized) on held-out text, halfbyte's GPTQ
converter (measured mixed bits) beside round-to-nearest at the same bits-per-weight budget.

    .venv/bin/python bench/quant_quality.py --text lee_background.cor --work /tmp/qq [--calib wiki_sample.txt]

The reference is the float model (default: the embedded SmolLM2-135M-Instruct directory). RTN
at a budget is the uniform setting (bits, group size, no act-order) with the most bits that
fits the budget, counting every stored bit. One calibration + measurement is shared by all
budgets (--measure-cache). Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from halfbyte.engine.scoring import score_tokens
from halfbyte.io.model_dir import read_json, resolve_model_dir
from halfbyte.model.config import ModelConfig
from halfbyte.model.loader import load_pretrained
from halfbyte.quant.convert import UNITS, ConvertOptions, TensorSource, _unit_shapes, convert, read_layer
from halfbyte.quant.evaluate import eval_windows, read_eval_text
from halfbyte.quant.measure import Candidate, storage_bits
from halfbyte.quant.packing import SUPPORTED_BITS
from halfbyte.quant.rtn import quantize_rtn


def _cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def rtn_setting(cfg: ModelConfig, budget: float) -> tuple[int, int, float]:
    """(bits, group size, bpw) of the uniform RTN setting with the most bits within budget."""
    shapes = list(_unit_shapes(cfg).values())
    weights = sum(n * k for n, k in shapes)
    best = None
    for bits in SUPPORTED_BITS:
        for gs in (128, 64, 32):
            cand = Candidate(((1.0, bits),), gs)
            bpw = sum(storage_bits(cand, n, k, act_order=False) for n, k in shapes) / weights
            if bpw <= budget and (best is None or (bits, -gs) > (best[0], -best[1])):
                best = (bits, gs, bpw)
    if best is None:
        raise SystemExit(f"no uniform RTN setting fits {budget} bpw")
    return best


def rtn_convert(model_dir: Path, out: Path, bits: int, group_size: int) -> None:
    """A halfbyte directory with every decoder matrix RTN-quantized (one file; bench only)."""
    hf_cfg = read_json(model_dir / "config.json")
    cfg = ModelConfig.from_hf(hf_cfg)
    src = TensorSource(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    layers = {}
    for i in range(cfg.num_layers):
        lw = read_layer(src, i)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = lw.input_norm
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = lw.post_norm
        for unit in UNITS:
            prefix = f"model.layers.{i}.{unit}"
            qw = quantize_rtn(lw.matrices[unit], bits, group_size)
            tensors.update(qw.to_state_dict(prefix))
            layers[prefix] = qw.meta()
            if lw.biases[unit] is not None:
                tensors[f"{prefix}.bias"] = lw.biases[unit]  # type: ignore[assignment]
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        if src.has(name):
            tensors[name] = src.get(name)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    hf_cfg["quantization"] = {"quant_method": "halfbyte", "format_version": 1, "layers": layers}
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "chat_template.jinja"):
            shutil.copyfile(f, out / f.name)


def score(model_dir: Path, windows: list[list[int]], ref: list[torch.Tensor] | None) -> dict[str, float]:
    """Perplexity, and against reference logits: mean KL(ref || model) and top-1 agreement."""
    model = load_pretrained(model_dir, torch.float32, torch.device("cpu")).model
    nll = kl = agree = 0.0
    n_pred = n_pos = 0
    for w, ids in enumerate(windows):
        logits = score_tokens(model, ids)
        logp = torch.log_softmax(logits.double(), -1)
        nll -= float(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())
        n_pred += len(ids) - 1
        if ref is not None:
            logp_r = torch.log_softmax(ref[w].double(), -1)
            kl += float((logp_r.exp() * (logp_r - logp)).sum())
            agree += float((ref[w].float().argmax(-1) == logits.argmax(-1)).sum())
            n_pos += len(ids)
    out = {"perplexity": float(torch.tensor(nll / n_pred).exp())}
    if ref is not None:
        out.update(kl=kl / n_pos, top1=agree / n_pos)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="float reference model directory (default: the embedded model)")
    ap.add_argument("--text", required=True, help="held-out English text (UTF-8)")
    ap.add_argument("--work", required=True, help="directory for the converted models")
    ap.add_argument("--budgets", default="4.25,3.25,2.5,5,6,8", help="the first one is timed as a full conversion")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--no-rtn", action="store_true")
    ap.add_argument("--no-tune", action="store_true", help="convert without the end-to-end tuning stage")
    ap.add_argument("--calib", action="append", default=None, metavar="FILE",
                    help="calibration text for the converter (default: text sampled from the model); "
                    "bench/eval_texts.py writes a Wikipedia sample")
    ap.add_argument("--calib-windows", type=int, default=None, help="calibration windows (converter default: 32)")
    ap.add_argument("--tune-steps", type=int, default=None, help="end-to-end tuning steps (converter default)")
    ap.add_argument("--json", default="quant_quality.json")
    args = ap.parse_args()

    model_dir = resolve_model_dir(args.model)
    cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    budgets = [float(b) for b in args.budgets.split(",")]
    extra: dict[str, object] = {"tune_steps": 0} if args.no_tune else {}
    if args.tune_steps is not None and not args.no_tune:
        extra["tune_steps"] = args.tune_steps
    if args.calib:
        extra["calib_files"] = tuple(args.calib)
    if args.calib_windows is not None:
        extra["num_windows"] = args.calib_windows
    # the first budget first, before anything else is loaded: its time and peak RSS are the converter's
    first = work / f"gptq_{budgets[0]}"
    timing: dict[str, float] = {}
    if not first.exists():
        t0, c0 = time.perf_counter(), _cpu_seconds()
        convert(model_dir, first, ConvertOptions(bits=budgets[0], measure_cache=work / "measure_cache", show_progress=False, **extra))
        # CPU time (user + sys, all threads) beside wall time: on a shared machine the wall time
        # is inflated, CPU time / cores estimates the wall time on a quiet one
        timing = {"convert_s": time.perf_counter() - t0, "cpu_s": _cpu_seconds() - c0,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        print(f"convert at {budgets[0]} bpw: {timing}", file=sys.stderr)
    loaded = load_pretrained(model_dir, torch.float32, torch.device("cpu"))
    ids = loaded.tokenizer.encode(read_eval_text(args.text), add_special_tokens=False)
    windows = eval_windows(ids, args.ctx, args.windows)
    ref_logits = [score_tokens(loaded.model, w).half() for w in windows]  # fp16 keeps 8 windows in < 1 GB
    del loaded
    rows: list[dict[str, object]] = [{"method": "reference", "bpw": 32.0, **score(model_dir, windows, None)}]
    print(f"reference: perplexity {rows[0]['perplexity']:.4f}", file=sys.stderr)

    meta = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "model": str(model_dir), "text": args.text, "ctx": args.ctx, "windows": len(windows),
        "tokens": sum(len(w) for w in windows), "first_conversion": timing, "calib": args.calib or "self-sampled",
    }
    for budget in budgets:
        out = work / f"gptq_{budget}"
        if not out.exists():
            t0 = time.perf_counter()
            res = convert(model_dir, out, ConvertOptions(bits=budget, measure_cache=work / "measure_cache", show_progress=False, **extra))
            seconds = time.perf_counter() - t0
            bpw = res.bits_per_weight
        else:
            seconds, bpw = float("nan"), json.loads((out / "config.json").read_text())["quantization"]["bits_per_weight"]
        row = {"method": "gptq-mixed", "budget": budget, "bpw": bpw, "convert_s": seconds, **score(out, windows, ref_logits)}
        rows.append(row)
        print(row, file=sys.stderr)
        if not args.no_rtn:
            bits, gs, rbpw = rtn_setting(cfg, budget)
            rout = work / f"rtn_{budget}"
            if not rout.exists():
                rtn_convert(model_dir, rout, bits, gs)
            row = {"method": f"rtn {bits}b g{gs}", "budget": budget, "bpw": rbpw, **score(rout, windows, ref_logits)}
            rows.append(row)
            print(row, file=sys.stderr)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))  # after every budget

    ref_ppl = float(rows[0]["perplexity"])  # type: ignore[arg-type]
    print(f"\n{'method':<16}{'budget':>8}{'bpw':>8}{'ppl':>10}{'Δppl':>9}{'KL':>10}{'top-1':>8}")
    for r in rows:
        budget_s = f"{r['budget']:.2f}" if "budget" in r else "-"
        kl = f"{r['kl']:.4f}" if "kl" in r else "-"
        top1 = f"{r['top1']:.3f}" if "top1" in r else "-"
        d = (float(r["perplexity"]) / ref_ppl - 1) * 100  # type: ignore[arg-type]
        print(f"{r['method']:<16}{budget_s:>8}{float(r['bpw']):>8.3f}{float(r['perplexity']):>10.3f}{d:>+8.1f}%{kl:>10}{top1:>8}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
