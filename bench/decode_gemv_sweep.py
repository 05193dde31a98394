"""gemv_w4 tile configs judged by the decode step itself, not by a chain of identical GEMVs.

bench/gemv.py times one shape's GEMV back to back with itself; in a decode step each GEMV sits
between small dependent kernels, and configs that win the chain can lose there (the 70B
tensor-parallel-2 shard: the chain's winners made the step 9.8 ms, the whole model's configs
8.3 ms; BENCHMARKS.md). Here, for a random-weight model (or one rank's shard at
--shard-of N, collectives left out), each layer matrix in turn tries every candidate config with
the others at their best so far (one pass of coordinate descent); every variant recaptures the
CUDA graph and times batch-1 decode, in two rounds (the second in reverse order), mean of the two.

    python bench/decode_gemv_sweep.py --shape llama3-8b [--shard-of 2] [--json OUT]
Prints the step time with the current table and with the best configs, and the table entries."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tensor_parallel as tp  # noqa: E402
from random_model import random_model, shape_config  # noqa: E402

from halfbyte.distributed.collectives import Collectives  # noqa: E402
from halfbyte.kernels import gemv_w4  # noqa: E402

Config = tuple[int, int, int | None, int, int, bool]  # block_n, block_kw, split_k, stages, warps, pair_rows
# the winners of earlier sweeps, chained and in the decode step, for Llama 8B / 70B shapes and shards
CANDIDATES: list[Config] = [
    (512, 16, None, 2, 4, False), (256, 16, None, 2, 4, False), (256, 16, 16, 2, 4, False),
    (128, 64, None, 4, 4, False), (64, 64, None, 2, 8, True), (64, 64, 8, 2, 8, True), (64, 64, 4, 2, 8, True),
    (64, 32, 8, 2, 4, True), (64, 32, None, 2, 4, True), (64, 16, 16, 4, 4, False), (256, 16, 8, 4, 4, True),
    (64, 32, 8, 4, 4, False),
]


def layer_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """(N, K) of the first layer's four matrices as gemv_w4 sees them."""
    layer = model.layers[0]  # type: ignore[index]
    mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}
    out = {}
    for name, m in mods.items():
        inner = getattr(m, "inner", m)  # row-parallel wrappers hold the QuantLinear
        out[name] = (inner.out_features, inner.in_features)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--shard-of", type=int, default=1, help="rank 0's shard at this tensor_parallel_size")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = shape_config(args.shape, max_position_embeddings=8192)
    dev = torch.device("cuda", 0)
    if args.shard_of > 1:
        model = tp.parallel_model(cfg, 4, 128, torch.float16, dev, 0, args.shard_of, Collectives(None, 0, 1))
    else:
        model = random_model(args.shape, 4, 128, torch.float16, dev, cfg.max_position_embeddings)
    shapes = layer_shapes(model)
    # the plain table is what this searches: its Hopper entries (cluster / staged) would shadow it
    gemv_w4._M1_TUNED_HOPPER.clear()
    start = {k: gemv_w4._M1_TUNED.get(v) for k, v in shapes.items()}  # None: the untuned default

    def step_ms(table: dict[str, Config | None]) -> float:
        for k, v in table.items():
            if v is None:
                gemv_w4._M1_TUNED.pop(shapes[k], None)
            else:
                gemv_w4._M1_TUNED[shapes[k]] = v
        pool, graphs = tp._setup(model, args.context, args.steps, torch.float16, True)
        ms = 1000 / max(tp.decode(model, pool, graphs, args.context, args.steps) for _ in range(2))
        del pool, graphs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # ~100 graphs and pools, one after another
        return ms

    best = dict(start)
    log = []
    for name in ("gate_up", "down", "qkv", "o"):
        variants = [best[name]] + [c for c in CANDIDATES if c != best[name]]
        times: dict[int, list[float]] = {i: [] for i in range(len(variants))}
        for order in (range(len(variants)), reversed(range(len(variants)))):
            for i in order:
                times[i].append(step_ms({**best, name: variants[i]}))
        mean = {i: sum(t) / len(t) for i, t in times.items()}
        pick = min(mean, key=mean.__getitem__)
        log.append({"matrix": name, "shape": shapes[name], "tried": [(variants[i], mean[i]) for i in mean]})
        print(f"{name} {shapes[name]}: {variants[0]} {mean[0]:.3f} ms -> {variants[pick]} {mean[pick]:.3f} ms", flush=True)
        best[name] = variants[pick]
    before = [step_ms(start), step_ms(best), step_ms(start), step_ms(best)]
    result = {"shape": args.shape, "shard_of": args.shard_of, "device": torch.cuda.get_device_name(),
              "step_ms_table": (before[0] + before[2]) / 2, "step_ms_best": (before[1] + before[3]) / 2,
              "best": {k: [shapes[k], v] for k, v in best.items()}, "log": log}
    print(f"{args.shape} shard of {args.shard_of}: step {result['step_ms_table']:.3f} ms with the table -> "
          f"{result['step_ms_best']:.3f} ms with the best (alternating, two each)")
    for k, v in best.items():
        print(f"    {shapes[k]}: {v},  # {k}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
