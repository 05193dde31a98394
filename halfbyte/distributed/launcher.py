"""Rank 0's side of tensor parallelism: validate the plan, start the other ranks (spawned, or
already launched by torchrun), load rank 0's shard, and broadcast each step to the workers.

The engine keeps its scheduler, runner and sampler on rank 0. Rank 0's model shard calls this
object (its driver) before each forward and logits call, which broadcasts the call to the
workers; KV page copies the pool makes (prefix cache, copy-on-write) are mirrored the same way."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from halfbyte.distributed.collectives import SINGLE, Collectives
from halfbyte.distributed.plan import TensorParallelPlan, check_world_size, make_plan
from halfbyte.distributed.process_group import (
    check_devices, destroy_groups, free_port, init_groups, launched_by_torchrun, rank_device,
)
from halfbyte.distributed.shard_loading import load_shard
from halfbyte.distributed.step_messages import (
    COPY, LOGITS, POOL, STEP, STOP, broadcast, broadcast_rows, gather_to_all, pack_step,
)
from halfbyte.distributed.worker import ShardSpec, load_status, memory_report, worker_main
from halfbyte.engine.kv_cache import PagePool
from halfbyte.io.model_dir import read_json
from halfbyte.kernels.attention import AttentionMetadata
from halfbyte.model.config import ModelConfig
from halfbyte.model.parallel_llama import ParallelLlamaModel


def plan_for(model_dir: Path, cfg: ModelConfig, n: int, device: torch.device) -> TensorParallelPlan:
    """The split, or a HalfbyteError naming the bad size: called before any weight is read."""
    check_world_size(n)
    check_devices(n, device)
    quantization = read_json(model_dir / "config.json").get("quantization") or {}
    return make_plan(cfg, n, quantization.get("layers"))


class TensorParallelGroup:
    """The N ranks of one engine, seen from rank 0."""

    def __init__(self, model_dir: Path, cfg: ModelConfig, n: int, dtype: torch.dtype, device: torch.device,
                 timed: bool = False) -> None:
        self.plan = plan_for(model_dir, cfg, n, device)
        self.world_size = n
        self.procs: list[mp.process.BaseProcess] = []
        self.memory: list[dict[str, Any]] = []
        spec = ShardSpec(model_dir, cfg, self.plan, dtype, device, timed)
        self.device = rank_device(device, 0)
        if n == 1:  # the parallel code path on one rank: no process group, no-op collectives
            self.groups = None
            self.comm = Collectives(None, 0, 1, timed) if timed else SINGLE
            self.model: ParallelLlamaModel = load_shard(model_dir, cfg, self.plan, 0, dtype, self.device, self.comm)
            return
        if launched_by_torchrun():
            rank = int(os.environ["RANK"])
            if int(os.environ["WORLD_SIZE"]) != n:
                from halfbyte.errors import InvalidParameterError

                raise InvalidParameterError(
                    f"tensor_parallel_size {n} differs from torchrun's WORLD_SIZE {os.environ['WORLD_SIZE']}"
                )
            if rank != 0:  # this process is a worker: serve rank 0's steps, then leave
                worker_main(rank, n, None, spec)
                raise SystemExit(0)
            init_method = None
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            ctx = mp.get_context("spawn")
            for rank in range(1, n):
                p = ctx.Process(target=worker_main, args=(rank, n, init_method, spec), daemon=True,
                                name=f"halfbyte-tp-rank{rank}")
                p.start()
                self.procs.append(p)
        try:
            self.groups = init_groups(0, n, self.device, init_method)
            model, errors = load_status(spec, self.groups, self.device)
        except BaseException:
            self._stop_processes()
            raise
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            self._stop_processes()
            raise failed
        assert model is not None
        self.model = model
        self.comm = model.comm
        model.driver = self

    @property
    def local_config(self) -> ModelConfig:
        """Rank 0's shard config: its KV heads size its KV-cache pages."""
        return self.model.cfg

    def start_pool(self, pool: PagePool) -> list[dict[str, Any]]:
        """Every rank allocates the same pages for its own KV heads; returns the per-rank memory report."""
        mine = memory_report(0, self.model, pool, self.device)
        if self.groups is None:
            self.memory = [mine]
        else:
            broadcast((POOL, pool.num_pages, pool.page_size), self.groups.control)
            self.memory = gather_to_all(mine, self.groups.control)
        return self.memory

    # --- the driver: rank 0's model announces its calls ------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        assert self.groups is not None
        broadcast((STEP, pack_step(input_ids, positions, meta)), self.groups.control)

    def logits(self, hidden: torch.Tensor) -> None:
        assert self.groups is not None
        shape = (hidden.shape[0], hidden.shape[1])
        broadcast((LOGITS, shape), self.groups.control)
        broadcast_rows(hidden, shape, hidden.dtype, hidden.device, self.groups.compute)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        if self.groups is not None and src:
            broadcast((COPY, src, dst), self.groups.control)

    def shutdown(self) -> None:
        if self.groups is not None:
            try:
                broadcast((STOP,), self.groups.control)
                dist.barrier(group=self.groups.control)  # every rank leaves the loop before any tears down
            finally:
                self._stop_processes()
                self.groups = None

    def _stop_processes(self, wait_s: float = 30.0) -> None:
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.procs = []
        destroy_groups()


def format_memory(report: list[dict[str, Any]]) -> str:
    gib = 1 << 30
    lines = []
    for r in report:
        line = f"rank {r['rank']}: weights {r['weights_bytes'] / gib:.3f} GiB, KV cache {r['kv_cache_bytes'] / gib:.3f} GiB"
        if "cuda_allocated_bytes" in r:
            line += f", CUDA allocated {r['cuda_allocated_bytes'] / gib:.3f} GiB"
        lines.append(line)
    return "\n".join(lines)
