"""One rank's shard of a LlamaModel under tensor parallelism.

Built from the rank's local config (its heads, KV heads, intermediate and vocabulary ranges;
plan.py), the network runs unchanged on its shard: q/k/v and gate/up are column-parallel by
construction, o_proj and down_proj become row-parallel (parallel_linear.py), and the two
vocabulary ends are overridden here: the embedding looks up its rows and all-reduces, the LM
head computes its logits and all-gathers them.

On rank 0 a `driver` (distributed/launcher.py) announces every forward and logits call to the
worker ranks before running it, so the workers make the same calls (and join the same
collectives) whatever the engine's runner does between them: the runner needs no change."""

from __future__ import annotations

import torch

from typing import Protocol

from halfbyte.distributed.collectives import Collectives
from halfbyte.distributed.plan import RankPlan, TensorParallelPlan
from halfbyte.kernels.attention import AttentionMetadata
from halfbyte.kernels.embedding import embedding
from halfbyte.model.config import ModelConfig
from halfbyte.model.llama import DecoderLayer, KVCache, LlamaModel
from halfbyte.model.parallel_linear import RowParallelLinear


class Driver(Protocol):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None: ...
    def logits(self, hidden: torch.Tensor) -> None: ...


class ParallelLlamaModel(LlamaModel):
    def __init__(
        self, cfg: ModelConfig, plan: TensorParallelPlan, rank: int, dtype: torch.dtype, device: torch.device,
        comm: Collectives,
    ) -> None:
        local = plan[rank].local_config(cfg)
        super().__init__(local, dtype, device)
        self.global_cfg = cfg
        self.plan = plan
        self.rank_plan: RankPlan = plan[rank]
        self.comm = comm
        self.driver: Driver | None = None  # rank 0 of several: tells the workers what to run
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(local.q_size, cfg.hidden_size, cfg.o_bias, dtype, device, comm)
            mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device, comm)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.driver is not None:
            self.driver.forward(input_ids, positions, meta)
        return super().forward(input_ids, positions, kv_caches, meta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        v0, v1 = self.rank_plan.vocab
        mine = (input_ids >= v0) & (input_ids < v1)
        local = embedding((input_ids - v0).clamp(0, v1 - v0 - 1), self.embed_tokens)  # [T, hidden]
        local = local * mine.unsqueeze(-1).to(local.dtype)
        return self.comm.all_reduce(local)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab] (every rank gets the whole row)."""
        if hidden.shape[0] == 0:  # no sequence samples this step: nothing to gather
            return torch.empty(0, self.global_cfg.vocab_size, dtype=torch.float32, device=hidden.device)
        if self.driver is not None:
            self.driver.logits(hidden)
        local = super().compute_logits(hidden)
        return self.comm.all_gather_last(local, [b - a for a, b in self.plan.vocab_ranges])
