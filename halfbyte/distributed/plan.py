"""The split plan: which rows and columns of each matrix every rank owns.

Decided from config.json alone (and its quantization section), so that a bad tensor-parallel
size fails before any weight is read. The rules:

- attention, by KV-head groups (one KV head and the query heads that read it):
  N <= num_kv_heads: each rank holds whole groups, as evenly as possible (3 groups on 2 ranks:
  2 and 1); N > num_kv_heads: the ranks are spread over the groups, each rank holds query heads
  of one group and a replica of that group's KV head. Either way a rank's local GQA ratio is a
  whole number, so the attention kernels run unchanged on the local heads.
- MLP intermediate and vocabulary: contiguous, balanced ranges; the intermediate cuts are
  rounded to the largest group size that leaves no rank empty, so quantized down_proj groups
  rarely straddle ranks.
- row-parallel quantized layers (o_proj, down_proj) whose groups do straddle the input shards,
  or that carry an act-order permutation, run "gathered": the input is all-gathered and each
  rank takes a K range of the stored (permuted) order cut on group boundaries. No group is
  ever split.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from halfbyte.errors import InvalidParameterError
from halfbyte.model.config import ModelConfig


def balanced(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering [0, total), cuts on multiples of `unit` (the last range
    takes the remainder), as even as the unit allows."""
    cuts = [0]
    for r in range(1, parts):
        ideal = total * r / parts
        cut = min(total, max(cuts[-1], round(ideal / unit) * unit))
        cuts.append(cut)
    cuts.append(total)
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass(frozen=True)
class RowSplit:
    """How one row-parallel layer is cut. local: the rank's K range is its input shard (no
    gather); gathered: the full input is gathered and the rank owns stored-order K [k0, k1)."""

    gathered: bool
    k_range: tuple[int, int]  # in stored order; for local, equal to the input shard


@dataclass(frozen=True)
class RankPlan:
    rank: int
    world_size: int
    heads: tuple[int, int]  # query heads [h0, h1)
    kv_heads: tuple[int, int]  # KV heads [k0, k1) (a replica when shared with other ranks)
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    # per quantized row-parallel layer prefix ("model.layers.0.self_attn.o_proj"): its split
    row_splits: dict[str, RowSplit] = field(default_factory=dict)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config whose shapes are this rank's shard: LlamaModel built from it is the shard."""
        return replace(
            cfg,
            num_heads=self.heads[1] - self.heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0],
        )


@dataclass(frozen=True)
class TensorParallelPlan:
    world_size: int
    ranks: tuple[RankPlan, ...]

    def __getitem__(self, rank: int) -> RankPlan:
        return self.ranks[rank]

    @property
    def head_ranges(self) -> list[tuple[int, int]]:
        return [r.heads for r in self.ranks]

    @property
    def intermediate_ranges(self) -> list[tuple[int, int]]:
        return [r.intermediate for r in self.ranks]

    @property
    def vocab_ranges(self) -> list[tuple[int, int]]:
        return [r.vocab for r in self.ranks]


def check_world_size(n: object) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidParameterError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    return n


def _attention_split(cfg: ModelConfig, n: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    h, hkv = cfg.num_heads, cfg.num_kv_heads
    g = h // hkv
    if n <= hkv:  # whole groups per rank
        return [((k0 * g, k1 * g), (k0, k1)) for k0, k1 in balanced(hkv, n)]
    # more ranks than KV heads: group j gets n // hkv (+1 for the first n % hkv) ranks
    out = []
    for j, (r0, r1) in enumerate(balanced(n, hkv)):
        if r1 - r0 > g:
            raise InvalidParameterError(
                f"tensor_parallel_size {n} would give a rank no query head: KV group {j} has {g} "
                f"query heads for {r1 - r0} ranks (at most num_attention_heads = {h} ranks)"
            )
        for a, b in balanced(g, r1 - r0):
            out.append(((j * g + a, j * g + b), (j, j + 1)))
    return out


def _group_boundaries(meta: dict[str, Any]) -> set[int]:
    """Every K (stored order) where a quantization group starts or a slice ends."""
    out: set[int] = set()
    for s in meta["slices"]:
        k0, k1, gs = s["k_start"], s["k_end"], s["group_size"]
        out.update(range(k0, k1, gs))
        out.add(k1)
    return out


def _row_split(meta: dict[str, Any], shards: list[tuple[int, int]], rank: int) -> RowSplit:
    bounds = _group_boundaries(meta)
    if not meta.get("act_order") and all(a in bounds and b in bounds for a, b in shards):
        return RowSplit(False, shards[rank])
    # gathered: cut the stored order at the group boundaries nearest an even split
    k = meta["in_features"]
    ordered = sorted(bounds | {0})
    cuts = [0]
    for r in range(1, len(shards)):
        ideal = k * r / len(shards)
        cuts.append(max(cuts[-1], min(ordered, key=lambda b: abs(b - ideal))))
    cuts.append(k)
    return RowSplit(True, (cuts[rank], cuts[rank + 1]))


def make_plan(cfg: ModelConfig, n: int, quant_layers: dict[str, Any] | None = None) -> TensorParallelPlan:
    """The whole split for N ranks; raises InvalidParameterError for sizes no rule covers."""
    check_world_size(n)
    if n > cfg.num_heads:
        raise InvalidParameterError(
            f"tensor_parallel_size {n} exceeds the model's {cfg.num_heads} attention heads"
        )
    if n > cfg.intermediate_size or n > cfg.vocab_size:
        raise InvalidParameterError(f"tensor_parallel_size {n} exceeds the MLP or vocabulary width")
    attention = _attention_split(cfg, n)
    quant_layers = quant_layers or {}
    # intermediate cuts on the largest group size that leaves every rank some columns
    sizes = {s["group_size"] for p, m in quant_layers.items() if p.endswith("down_proj") for s in m["slices"]}
    unit = next(
        (u for u in sorted({*sizes, 32, 1}, reverse=True)
         if all(b > a for a, b in balanced(cfg.intermediate_size, n, u))),
        1,
    )
    inter = balanced(cfg.intermediate_size, n, unit)
    vocab = balanced(cfg.vocab_size, n)
    d = cfg.head_dim
    o_shards = [(h0 * d, h1 * d) for (h0, h1), _ in attention]
    ranks = []
    for r in range(n):
        splits = {}
        for prefix, meta in quant_layers.items():
            if prefix.endswith("self_attn.o_proj"):
                splits[prefix] = _row_split(meta, o_shards, r)
            elif prefix.endswith("mlp.down_proj"):
                splits[prefix] = _row_split(meta, inter, r)
        ranks.append(RankPlan(r, n, attention[r][0], attention[r][1], inter[r], vocab[r], splits))
    return TensorParallelPlan(n, tuple(ranks))
