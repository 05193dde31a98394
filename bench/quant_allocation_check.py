"""Does the measurement pass's error model predict the model's loss? For a few per-matrix
settings (uniform ones, and the allocator's picks at some budgets) print the predicted total
stream error (the sum of the measured errors the allocator minimises) beside the perplexity and
KL really measured on held-out text; also uniform RTN beside uniform GPTQ at the same setting.

    .venv/bin/python bench/quant_allocation_check.py --measure /tmp/i3/qq/measure_cache/<digest> \
        --text lee_background.cor --windows 4

--measure is a converter measurement cache directory (calibration.json + measure/layer_*.json,
written by `halfbyte convert` / bench/quant_quality.py with a measure cache); its candidates are
read from the cache's settings.json (act-order allowed). GPTQ here is
the converter's quantization pass (true-sequential on the cache's calibration windows), done in
memory; the weights are swapped into the float model as dequantized values.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from halfbyte.engine.scoring import score_tokens
from halfbyte.io.model_dir import read_json, resolve_model_dir
from halfbyte.model.config import ModelConfig
from halfbyte.model.loader import load_pretrained
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.quant.convert import UNITS, TensorSource, _unit_shapes, read_layer, run_layer
from halfbyte.quant.evaluate import eval_windows, read_eval_text
from halfbyte.quant.measure import Candidate, allocate, quantize_candidate, storage_bits
from halfbyte.quant.rtn import quantize_rtn


def quantized_weights(model_dir: Path, windows: list[list[int]], choices: dict[str, Candidate], rtn: bool) -> dict[str, torch.Tensor]:
    """prefix -> dequantized weight: GPTQ true-sequential as the converter does, or RTN."""
    cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"))
    src = TensorSource(model_dir)
    out: dict[str, torch.Tensor] = {}
    if rtn:
        for i in range(cfg.num_layers):
            lw = read_layer(src, i)
            for u in UNITS:
                c = choices[f"model.layers.{i}.{u}"]
                out[f"model.layers.{i}.{u}"] = quantize_rtn(lw.matrices[u], c.parts[0][1], c.group_size).dequantize()
        return out
    rotary = RotaryEmbedding(cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                             torch.device("cpu"), torch.float32)
    stream = src.get("model.embed_tokens.weight")[torch.tensor([t for w in windows for t in w])].float()
    lengths = [len(w) for w in windows]
    for i in range(cfg.num_layers):
        lw = read_layer(src, i)

        def quantize(unit: str, h: torch.Tensor, w: torch.Tensor, i: int = i) -> torch.Tensor:
            qw, _ = quantize_candidate(w, h, choices[f"model.layers.{i}.{unit}"], act_order=True, clip_search=True)
            out[f"model.layers.{i}.{unit}"] = deq = qw.dequantize()
            return deq

        stream = run_layer(cfg, lw, stream, lengths, rotary, quantize)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--measure", required=True, help="measurement cache directory")
    ap.add_argument("--text", required=True)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--uniform", default="4b g64 seq,4b g128,4b g64,3b g32,3b g128",
                    help="candidate names (measure.default_candidates) to apply to every matrix")
    ap.add_argument("--budgets", default="4.25,4.5", help="allocator budgets")
    ap.add_argument("--rtn", default="4b g64 seq,4b g128 seq", help="uniform settings also scored with RTN")
    ap.add_argument("--json", default="allocation_check.json")
    args = ap.parse_args()

    model_dir = resolve_model_dir(args.model)
    cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"))
    mdir = Path(args.measure)
    calib = json.loads((mdir / "calibration.json").read_text())
    # the list the cache was measured with (a budget below 4 bpw measures extra candidates)
    cands = [Candidate.from_json(c) for c in json.loads((mdir / "settings.json").read_text())["candidates"]]
    by_name = {c.name: c for c in cands} | {c.name + " seq": Candidate(c.parts, c.group_size, False) for c in cands}
    shapes = _unit_shapes(cfg)
    prefixes, costs, errs = [], [], []
    for i in range(cfg.num_layers):
        measured = json.loads((mdir / "measure" / f"layer_{i:05d}.json").read_text())
        for u in UNITS:
            n, k = shapes[u]
            prefixes.append(f"model.layers.{i}.{u}")
            costs.append([storage_bits(c, n, k, True) for c in cands])
            errs.append(measured[u])
    total = cfg.num_layers * sum(n * k for n, k in shapes.values())

    configs: list[tuple[str, dict[str, int], bool]] = []  # (label, prefix -> candidate index, rtn)
    for name in filter(None, args.uniform.split(",")):
        j = cands.index(by_name[name])
        configs.append((f"gptq uniform {name}", dict.fromkeys(prefixes, j), False))
    for b in filter(None, args.budgets.split(",")):
        picks = allocate(costs, errs, float(b) * total)
        configs.append((f"gptq allocated {b}", dict(zip(prefixes, picks, strict=True)), False))
    for name in filter(None, args.rtn.split(",")):
        j = cands.index(by_name[name])
        configs.append((f"rtn uniform {name}", dict.fromkeys(prefixes, j), True))

    loaded = load_pretrained(model_dir, torch.float32, torch.device("cpu"))
    ids = loaded.tokenizer.encode(read_eval_text(args.text), add_special_tokens=False)
    windows = eval_windows(ids, args.ctx, args.windows)
    ref = [score_tokens(loaded.model, w).half() for w in windows]
    del loaded
    rows = []
    for label, pick, rtn in configs:
        t0 = time.perf_counter()
        bpw = sum(costs[l][pick[p]] for l, p in enumerate(prefixes)) / total
        predicted = sum(errs[l][pick[p]] for l, p in enumerate(prefixes)) if not rtn else float("nan")
        weights = quantized_weights(model_dir, calib, {p: cands[j] for p, j in pick.items()}, rtn)
        model = load_pretrained(model_dir, torch.float32, torch.device("cpu")).model
        for i, layer in enumerate(model.layers):
            for u in UNITS:
                block, name = u.split(".")
                lin = getattr(getattr(layer, block), name)
                w = weights[f"model.layers.{i}.{u}"]
                lin.weight.data.copy_(w.t() if lin.transposed else w)
        res = score_with(model, windows, ref)
        row = {"config": label, "bpw": bpw, "predicted": predicted, **res, "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"\n{'config':<30}{'bpw':>7}{'predicted':>11}{'ppl':>9}{'KL':>8}")
    for r in rows:
        print(f"{r['config']:<30}{r['bpw']:>7.3f}{r['predicted']:>11.4f}{r['perplexity']:>9.3f}{r['kl']:>8.4f}")


def score_with(model: torch.nn.Module, windows: list[list[int]], ref: list[torch.Tensor]) -> dict[str, float]:
    """bench.quant_quality.score on a model already in memory."""
    nll = kl = 0.0
    n_pred = n_pos = 0
    for w, ids in enumerate(windows):
        logits = score_tokens(model, ids)
        logp = torch.log_softmax(logits.double(), -1)
        nll -= float(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())
        n_pred += len(ids) - 1
        logp_r = torch.log_softmax(ref[w].double(), -1)
        kl += float((logp_r.exp() * (logp_r - logp)).sum())
        n_pos += len(ids)
    return {"perplexity": float(torch.tensor(nll / n_pred).exp()), "kl": kl / n_pos}


if __name__ == "__main__":
    main()
