"""Tensor-parallel decode speed: tokens/s and the time spent in collectives per step.

Single GPU (issue 8's check): the plain LlamaModel and tensor_parallel_size 1 through the
tensor-parallel code path (ParallelLlamaModel, row-parallel layers, vocab-parallel ends), the
same random weights, interleaved in one run:
    python bench/tensor_parallel.py --shape llama3-8b --bits 4 --group 128
Several GPUs (issue 9), one process per GPU, each rank building its random shard directly:
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 2 \
        bench/tensor_parallel.py --shape llama3-70b --bits 4 --group 128
The CPU works too (gloo; --device cpu --shape smollm2-135m) for a smoke run.
One GPU, one rank's share of the work (what a single GPU can say about N-GPU scaling): the
whole model beside rank 0's shard at tensor_parallel_size N with the collectives left out
(identity), interleaved in one run:
    python bench/tensor_parallel.py --shape llama3-70b --shard-of 2
The shard's step time is the floor of the N-GPU step; its ratio to the whole model's bounds the
scaling before any time in all-reduces.

Ranks run the decode loop SPMD (same inputs, the all-gathered logits pick the same token on
every rank), so rank 0's step broadcast of the engine is not in these numbers."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_model import random_model, random_quant_weight, shape_config  # noqa: E402

from halfbyte.distributed.collectives import Collectives  # noqa: E402
from halfbyte.distributed.plan import RowSplit, make_plan  # noqa: E402
from halfbyte.distributed.process_group import destroy_groups, init_groups, launched_by_torchrun  # noqa: E402
from halfbyte.engine.cuda_graphs import CudaGraphDecoder  # noqa: E402
from halfbyte.engine.kv_cache import PagePool  # noqa: E402
from halfbyte.kernels.attention import AttentionMetadata  # noqa: E402
from halfbyte.model.config import ModelConfig  # noqa: E402
from halfbyte.model.llama import LlamaModel  # noqa: E402
from halfbyte.model.parallel_linear import RowParallelQuantLinear  # noqa: E402
from halfbyte.model.parallel_llama import ParallelLlamaModel  # noqa: E402
from halfbyte.model.quant_linear import QuantLinear  # noqa: E402
from halfbyte.model.rope import RotaryEmbedding  # noqa: E402

PAGE = 16


def _finish(model: LlamaModel, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, src: LlamaModel | None) -> None:
    for name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                if src is not None:  # same weights as the plain model
                    t = src.get_submodule(name).get_parameter(pname) if name else src.get_parameter(pname)
                else:
                    t = torch.randn(p.shape, dtype=dtype, device=device) * (0.02 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0)
                mod._parameters[pname] = nn.Parameter(t, False)
    model.device = device
    model.rotary = RotaryEmbedding(cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device, torch.float32)


def parallel_model(cfg: ModelConfig, bits: int, group: int, dtype: torch.dtype, device: torch.device,
                   rank: int, world: int, comm: Collectives, src: LlamaModel | None = None) -> ParallelLlamaModel:
    """Rank `rank`'s shard with random weights (or, for one rank, src's weights moved over)."""
    plan = make_plan(cfg, world)
    model = ParallelLlamaModel(cfg, plan, rank, dtype, torch.device("meta"), comm)
    local = model.cfg
    o_widths = [(b - a) * cfg.head_dim for a, b in plan.head_ranges]
    d_widths = [b - a for a, b in plan.intermediate_ranges]
    cuts = [b * cfg.head_dim for _, b in plan.head_ranges[:-1]] + [b for _, b in plan.intermediate_ranges[:-1]]
    if any(c % group for c in cuts):
        raise SystemExit(f"{world} ranks cut {cfg.num_heads} heads / {cfg.intermediate_size} off {group}-groups")
    for i, layer in enumerate(model.layers):
        s = src.layers[i] if src is not None else None

        def quant(path: str, n: int, k: int) -> QuantLinear:
            if s is not None:
                inner = s.get_submodule(path)
                return inner
            return QuantLinear(random_quant_weight(n, k, bits, group, device), None, dtype)

        layer.self_attn.qkv_proj = quant("self_attn.qkv_proj", local.q_size + 2 * local.kv_size, cfg.hidden_size)
        layer.mlp.gate_up_proj = quant("mlp.gate_up_proj", 2 * local.intermediate_size, cfg.hidden_size)
        o = quant("self_attn.o_proj", cfg.hidden_size, local.q_size)
        down = quant("mlp.down_proj", cfg.hidden_size, local.intermediate_size)
        layer.self_attn.o_proj = RowParallelQuantLinear(
            o, cfg.hidden_size, None, RowSplit(False, (0, local.q_size)), o_widths, None, comm, dtype)
        layer.mlp.down_proj = RowParallelQuantLinear(
            down, cfg.hidden_size, None, RowSplit(False, (0, local.intermediate_size)), d_widths, None, comm, dtype)
    _finish(model, cfg, dtype, device, src)
    if src is None:
        model.prepare_for_inference()
    elif src.lm_head is not None:
        model.lm_head = src.lm_head
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode(model: LlamaModel, pool: PagePool, graphs: CudaGraphDecoder | None, context: int, steps: int,
           profile_label: str = "") -> float:
    """Batch-1 decode tokens/s after a `context`-token prefill. profile_label: also print the GPU
    time per step by kernel (torch profiler; CUDA-graph replays included) under that label."""
    dev = model.device
    table = list(range(-(-(context + steps) // PAGE)))
    tables = torch.tensor([table], dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(0)  # the same prompt on every rank
    ids = torch.randint(0, model.global_cfg.vocab_size if hasattr(model, "global_cfg") else model.cfg.vocab_size,
                        (context,), generator=gen).to(dev)
    pos = torch.arange(context, device=dev)
    slots = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(context)], device=dev)
    hidden = model(ids, pos, pool.kv_caches, AttentionMetadata([0, context], [context], tables, slots))
    token = model.compute_logits(hidden[-1:]).argmax(-1)
    _sync(dev)
    prof = None
    if profile_label and dev.type == "cuda":  # kernels inside graph replays too (CUPTI)
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    start = time.perf_counter()
    for i in range(steps):
        p = context + i
        pos = torch.tensor([p], device=dev)
        slot = torch.tensor([table[p // PAGE] * PAGE + p % PAGE], device=dev)
        seq_lens = torch.tensor([p + 1], dtype=torch.int32, device=dev)
        if graphs is not None:
            logits = graphs.run(token, pos, slot, tables, seq_lens)
        else:
            meta = AttentionMetadata([0, 1], [p + 1], tables, slot, seq_lens)
            logits = model.compute_logits(model(token, pos, pool.kv_caches, meta))
        token = logits.argmax(-1)
    _sync(dev)
    elapsed = time.perf_counter() - start
    if prof is not None:
        prof.__exit__(None, None, None)
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        busy = sum(e.device_time_total for e in events) / steps
        print(f"{profile_label}: {1e6 * elapsed / steps:.0f} us per step (profiled), kernels busy {busy:.0f} us; per step:")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:12]:
            print(f"  {e.device_time_total / steps:8.1f} us  {e.count / steps:6.1f} x  {e.key[:90]}")
    return steps / elapsed


def _setup(model: LlamaModel, context: int, steps: int, dtype: torch.dtype, use_graphs: bool,
           kv_tokens: int = 0) -> tuple[PagePool, CudaGraphDecoder | None]:
    """The KV pool holds max(kv_tokens, context + steps) tokens (each rank: its KV heads)."""
    pool = PagePool(model.cfg, -(-max(kv_tokens, context + steps) // PAGE) + 1, PAGE, dtype, model.device)
    graphs = None
    if use_graphs and model.device.type == "cuda":
        graphs = CudaGraphDecoder(model, pool.kv_caches, 1, context + steps + PAGE, pool.scratch_page)
    return pool, graphs


def best_interleaved(runs: dict[str, tuple[LlamaModel, PagePool, CudaGraphDecoder | None]],
                     args: argparse.Namespace) -> dict[str, float]:
    """Each run's best decode tokens/s over args.repeats rounds, the runs interleaved per round."""
    best = {k: 0.0 for k in runs}
    for _ in range(args.repeats):
        for name, (m, pool, graphs) in runs.items():
            best[name] = max(best[name], decode(m, pool, graphs, args.context, args.steps))
    return best


def shard_speed(args: argparse.Namespace, cfg: ModelConfig, dtype: torch.dtype, base: torch.device,
                use_graphs: bool, results: dict[str, object]) -> None:
    """The whole model and rank 0's shard at tensor_parallel_size args.shard_of, each its own
    random weights, decode interleaved; the shard's collectives are identities (a world of one)."""
    dev = base if base.type == "cpu" else torch.device("cuda", 0)
    whole = random_model(args.shape, args.bits, args.group, dtype, dev, cfg.max_position_embeddings)
    shard = parallel_model(cfg, args.bits, args.group, dtype, dev, 0, args.shard_of, Collectives(None, 0, 1))
    runs = {"whole": (whole, *_setup(whole, args.context, args.steps, dtype, use_graphs)),
            "shard": (shard, *_setup(shard, args.context, args.steps, dtype, use_graphs))}
    best = best_interleaved(runs, args)
    results.update({"shard_of": args.shard_of, "whole_tok_s": round(best["whole"], 2),
                    "shard_tok_s": round(best["shard"], 2),
                    "whole_ms_per_step": round(1000 / best["whole"], 3), "shard_ms_per_step": round(1000 / best["shard"], 3),
                    "scaling_bound_without_collectives": round(best["shard"] / best["whole"], 3)})
    if args.profile:
        for name, (m, pool, graphs) in runs.items():
            decode(m, pool, graphs, args.context, 16, profile_label=name)
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the best of each is reported")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode only")
    ap.add_argument("--kv-tokens", type=int, default=0, help="size the KV pool for this many tokens (memory per rank)")
    ap.add_argument("--profile", action="store_true", help="with --shard-of: GPU time by kernel of both, per step")
    ap.add_argument("--shard-of", type=int, default=0,
                    help="one GPU: the whole model vs rank 0's shard at this tensor_parallel_size, no collectives")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = torch.device(args.device)
    dtype = torch.float16 if base.type == "cuda" else torch.float32
    cfg = shape_config(args.shape, max_position_embeddings=max(8192, args.context + args.steps + PAGE))
    use_graphs = not args.no_graphs and base.type == "cuda"
    results: dict[str, object] = {"shape": args.shape, "bits": args.bits, "group": args.group,
                                  "all_reduce": os.environ.get("HALFBYTE_TP_ALLREDUCE", "nccl"),
                                  "nccl_proto": os.environ.get("NCCL_PROTO", "default"),
                                  "context": args.context, "steps": args.steps, "graphs": use_graphs}

    if args.shard_of > 1 and not launched_by_torchrun():
        shard_speed(args, cfg, dtype, base, use_graphs, results)
        return
    if not launched_by_torchrun():  # one device: plain vs tensor_parallel_size 1, same weights
        dev = base if base.type == "cpu" else torch.device("cuda", 0)
        plain = random_model(args.shape, args.bits, args.group, dtype, dev, cfg.max_position_embeddings)
        timed = Collectives(None, 0, 1, timed=False)
        tp1 = parallel_model(cfg, args.bits, args.group, dtype, dev, 0, 1, timed, src=plain)
        runs = {"plain": (plain, *_setup(plain, args.context, args.steps, dtype, use_graphs)),
                "tp1": (tp1, *_setup(tp1, args.context, args.steps, dtype, use_graphs))}
        with torch.inference_mode():  # the same weights: the two paths must agree
            ids = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(1)).to(dev)
            tables = torch.tensor([list(range(4))], dtype=torch.int32, device=dev)
            meta = lambda: AttentionMetadata([0, 64], [64], tables, torch.arange(64, device=dev))  # noqa: E731
            la = plain.compute_logits(plain(ids, torch.arange(64, device=dev), runs["plain"][1].kv_caches, meta()))
            lb = tp1.compute_logits(tp1(ids, torch.arange(64, device=dev), runs["tp1"][1].kv_caches, meta()))
            results["tp1_vs_plain_max_abs_logit_diff"] = float((la - lb).abs().max())
        best = best_interleaved(runs, args)
        results.update({f"{k}_tok_s": round(v, 2) for k, v in best.items()})
        results["tp1_over_plain"] = round(best["tp1"] / best["plain"], 4)
        print(json.dumps(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = base if base.type == "cpu" else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    groups = init_groups(rank, world, dev, None)
    comm = Collectives.for_ranks(groups.compute, rank, world, dev, dtype)
    model = parallel_model(cfg, args.bits, args.group, dtype, dev, rank, world, comm)
    pool, graphs = _setup(model, args.context, args.steps, dtype, use_graphs, args.kv_tokens)
    kv_bytes = sum(t.numel() * t.element_size() for layer in pool.kv_caches for t in layer)
    best = max(decode(model, pool, graphs, args.context, args.steps) for _ in range(args.repeats))
    comm.timed = True  # an eager pass with synchronized timing around each collective
    comm.reset()
    timed_steps = min(args.steps, 32)
    decode(model, pool, None, args.context, timed_steps)
    seconds, calls = comm.reset()
    mem = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, {"rank": rank, "peak_bytes": mem, "kv_bytes": kv_bytes},
                                        group=groups.control)
    if rank == 0:
        results.update({"tensor_parallel_size": world, "tok_s": round(best, 2),
                        "symm_all_reduce_active": comm.symm is not None,  # else NCCL (the fallback)
                        # the timed pass includes prefill's collectives: per decode step, roughly
                        "collective_ms_per_step": round(1000 * seconds / (timed_steps + 1), 3),
                        "collectives_per_step": round(calls / (timed_steps + 1), 1),
                        "kv_pool_tokens": (pool.num_pages - 1) * PAGE,
                        "kv_pool_gib_per_rank": [round(r["kv_bytes"] / 2**30, 2) for r in per_rank],
                        "peak_memory_gib_per_rank": [round(r["peak_bytes"] / 2**30, 2) for r in per_rank]})
        print(json.dumps(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    # graphs that captured NCCL calls go before the communicator does: a 2-GPU run on the H200s
    # printed its result and then hung until killed (2026-12-04)
    del graphs, pool
    _sync(dev)
    torch.distributed.barrier(group=groups.control)
    destroy_groups()


if __name__ == "__main__":
    main()
