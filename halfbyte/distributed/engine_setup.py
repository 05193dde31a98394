"""What LLMEngine calls for tensor_parallel_size: the model's config and tokenizer as usual,
the weights as rank 0's shard with the other ranks started beside it."""

from __future__ import annotations

from pathlib import Path

import torch

from halfbyte.distributed.launcher import TensorParallelGroup
from halfbyte.distributed.plan import check_world_size
from halfbyte.engine.kv_cache import PagePool
from halfbyte.engine.runner import ModelRunner
from halfbyte.io.model_dir import read_json
from halfbyte.io.tokenizer import Tokenizer
from halfbyte.model.config import ModelConfig
from halfbyte.model.loader import LoadedModel
from halfbyte.model.rope import RopeScaling


def load_tensor_parallel(
    model_dir: Path, n: int, dtype: torch.dtype, device: torch.device, rope_scaling: RopeScaling | str | None,
    timed: bool = False,
) -> tuple[LoadedModel, TensorParallelGroup]:
    check_world_size(n)
    cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"))
    if rope_scaling is not None:
        cfg = cfg.with_rope_scaling(RopeScaling.parse(rope_scaling) if isinstance(rope_scaling, str) else rope_scaling)
    tokenizer = Tokenizer(model_dir)
    group = TensorParallelGroup(model_dir, cfg, n, dtype, device, timed)  # validates before loading
    return LoadedModel(model_dir, cfg, tokenizer, group.model), group


def attach(group: TensorParallelGroup, pool: PagePool, runner: ModelRunner) -> None:
    """Workers allocate the same KV pages for their heads and mirror the pool's page copies.
    CUDA graphs stay for one rank only: a graph replayed on rank 0 alone would skip the driver
    and desynchronize the collectives (capturing them on every rank is the GPU half, not done)."""
    group.start_pool(pool)
    if group.world_size > 1:
        runner.graphs = None
        copies = getattr(pool, "apply_copies", None)
        if copies is not None:  # the paged engine's prefix cache / copy-on-write

            def apply_copies_on_every_rank() -> None:
                pending = list(getattr(pool, "pending_copies", []))
                group.copy_pages([c[0] for c in pending], [c[1] for c in pending])
                copies()

            pool.apply_copies = apply_copies_on_every_rank  # type: ignore[method-assign]
