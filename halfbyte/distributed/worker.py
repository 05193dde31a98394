"""A worker rank (1..N-1): load its shard, then run every step rank 0 broadcasts, until STOP."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from halfbyte.distributed.collectives import Collectives
from halfbyte.distributed.plan import TensorParallelPlan
from halfbyte.distributed.process_group import Groups, destroy_groups, init_groups, rank_device
from halfbyte.distributed.shard_loading import load_shard, shard_bytes
from halfbyte.distributed.step_messages import (
    COPY, LOGITS, POOL, STEP, STOP, broadcast, broadcast_rows, gather_to_all, unpack_step,
)
from halfbyte.engine.kv_cache import PagePool
from halfbyte.model.config import ModelConfig
from halfbyte.model.parallel_llama import ParallelLlamaModel


@dataclass
class ShardSpec:
    """Everything a rank needs to load its shard; picklable for spawned workers."""

    model_dir: Path
    cfg: ModelConfig
    plan: TensorParallelPlan
    dtype: torch.dtype
    device: torch.device  # the engine's device; a rank's own is rank_device(device, rank)
    timed: bool = False


def load_status(spec: ShardSpec, groups: Groups, device: torch.device) -> tuple[ParallelLlamaModel | None, list[Any]]:
    """Load this rank's shard; every rank learns every rank's outcome (an error text or None),
    so that a failure on one rank fails all of them instead of hanging the others."""
    comm = Collectives.for_ranks(groups.compute, groups.rank, groups.world_size, device, spec.dtype, spec.timed)
    model: ParallelLlamaModel | None = None
    error: Any = None
    try:
        model = load_shard(spec.model_dir, spec.cfg, spec.plan, groups.rank, spec.dtype, device, comm)
    except Exception as e:  # reported to rank 0, which raises it
        error = e if _picklable(e) else RuntimeError(f"rank {groups.rank}: {traceback.format_exc()}")
    return model, gather_to_all(error, groups.control)


def _picklable(e: Exception) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:
        return False


def memory_report(rank: int, model: ParallelLlamaModel, pool: PagePool | None, device: torch.device) -> dict[str, Any]:
    kv = sum(t.numel() * t.element_size() for pair in (pool.kv_caches if pool else []) for t in pair)
    report = {"rank": rank, "weights_bytes": shard_bytes(model), "kv_cache_bytes": kv}
    if device.type == "cuda":
        report["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
    return report


@torch.inference_mode()
def serve(model: ParallelLlamaModel, groups: Groups, device: torch.device) -> None:
    pool: PagePool | None = None
    while True:
        msg = broadcast(None, groups.control)
        kind = msg[0]
        if kind == STOP:
            torch.distributed.barrier(group=groups.control)
            return
        if kind == POOL:
            _, num_pages, page_size = msg
            pool = PagePool(model.cfg, num_pages, page_size, model.dtype, device)
            gather_to_all(memory_report(groups.rank, model, pool, device), groups.control)
        elif kind == STEP:
            assert pool is not None, "a step before the KV-cache pool"
            input_ids, positions, meta = unpack_step(msg[1], device)
            model(input_ids, positions, pool.kv_caches, meta)
        elif kind == LOGITS:  # rank 0's rows: every rank holds the same hidden states
            rows = broadcast_rows(None, msg[1], model.dtype, device, groups.compute)
            model.compute_logits(rows)  # joins the logits all-gather; rank 0 samples
        elif kind == COPY:
            assert pool is not None
            src = torch.tensor(msg[1], device=device)
            dst = torch.tensor(msg[2], device=device)
            for k, v in pool.kv_caches:
                k[dst] = k[src]
                v[dst] = v[src]


def worker_main(rank: int, world_size: int, init_method: str | None, spec: ShardSpec) -> None:
    """Entry of a spawned worker process (or of a torchrun rank other than 0)."""
    device = rank_device(spec.device, rank)
    torch.set_num_threads(max(1, torch.get_num_threads() // world_size)) if device.type == "cpu" else None
    groups = init_groups(rank, world_size, device, init_method)
    try:
        model, errors = load_status(spec, groups, device)
        if any(e is not None for e in errors):
            return
        assert model is not None
        serve(model, groups, device)
    finally:
        destroy_groups()
