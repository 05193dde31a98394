"""The tensor-parallel split plan, checked without processes: every query head is placed once
with the KV head it reads, local GQA ratios are whole, ranges tile their dimension, quantized
row-parallel layers are cut on group boundaries (gathered when act-order or misaligned), and
sizes no rule covers are refused."""

from __future__ import annotations

import pytest
import torch

from halfbyte.distributed.plan import balanced, make_plan
from halfbyte.distributed.process_group import check_devices
from halfbyte.errors import InvalidParameterError
from halfbyte.model.config import ModelConfig

SMOLLM2 = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=2048,
)
LLAMA3_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=8192,
)


def _tiles(ranges: list[tuple[int, int]], total: int) -> bool:
    return ranges[0][0] == 0 and ranges[-1][1] == total and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("cfg", [SMOLLM2, LLAMA3_8B], ids=["smollm2", "llama3-8b"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9])
def test_every_query_head_sits_with_its_kv_head(cfg: ModelConfig, n: int) -> None:
    plan = make_plan(cfg, n)
    g = cfg.num_heads // cfg.num_kv_heads
    assert _tiles(plan.head_ranges, cfg.num_heads)
    assert _tiles(plan.intermediate_ranges, cfg.intermediate_size)
    assert _tiles(plan.vocab_ranges, cfg.vocab_size)
    for rp in plan.ranks:
        (h0, h1), (k0, k1) = rp.heads, rp.kv_heads
        assert h1 > h0 and k1 > k0
        local = rp.local_config(cfg)
        assert local.num_heads % local.num_kv_heads == 0  # the kernels' GQA mapping holds locally
        ratio = local.num_heads // local.num_kv_heads
        for i, h in enumerate(range(h0, h1)):
            assert k0 + i // ratio == h // g  # local head i reads the KV head global head h reads
    if n <= cfg.num_kv_heads:  # whole groups: no KV head is held twice
        assert sum(k1 - k0 for k0, k1 in (r.kv_heads for r in plan.ranks)) == cfg.num_kv_heads


def test_uneven_splits_are_balanced() -> None:
    plan = make_plan(SMOLLM2, 2)
    assert plan.head_ranges == [(0, 6), (6, 9)]  # 3 KV groups on 2 ranks: 2 + 1
    assert [r.kv_heads for r in plan.ranks] == [(0, 2), (2, 3)]
    assert balanced(100, 3) == [(0, 33), (33, 67), (67, 100)]
    assert balanced(96, 2, 32) == [(0, 64), (64, 96)]


def _layer_meta(k: int, n_out: int, group: int, act_order: bool, slices: list[tuple[int, int, int]] | None = None) -> dict:
    spans = slices or [(0, k, group)]
    return {
        "out_features": n_out, "in_features": k, "act_order": act_order,
        "slices": [{"k_start": a, "k_end": b, "bits": 4, "group_size": gs} for a, b, gs in spans],
    }


def _quant_layers(cfg: ModelConfig, group: int, act_order: bool = False) -> dict:
    return {
        "model.layers.0.self_attn.o_proj": _layer_meta(cfg.q_size, cfg.hidden_size, group, act_order),
        "model.layers.0.mlp.down_proj": _layer_meta(cfg.intermediate_size, cfg.hidden_size, group, act_order),
    }


def _boundaries(meta: dict) -> set[int]:
    return {b for s in meta["slices"] for b in [*range(s["k_start"], s["k_end"], s["group_size"]), s["k_end"]]}


@pytest.mark.parametrize("n,act_order,o_gathered", [(2, False, False), (3, False, True), (3, True, True), (2, True, True)])
def test_quantized_row_parallel_cuts_fall_on_group_boundaries(n: int, act_order: bool, o_gathered: bool) -> None:
    layers = _quant_layers(SMOLLM2, 128, act_order)
    plan = make_plan(SMOLLM2, n, layers)
    o, down = "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"
    # 3 ranks hold 3 heads = 192 columns of o_proj: not a multiple of 128, so o_proj gathers
    assert plan[0].row_splits[o].gathered == o_gathered
    assert plan[0].row_splits[down].gathered == act_order  # 1536 / n is a multiple of 128
    for prefix in (o, down):
        ks = [plan[r].row_splits[prefix].k_range for r in range(n)]
        assert _tiles(ks, layers[prefix]["in_features"])
        assert all(a in _boundaries(layers[prefix]) for a, _ in ks)
        if not plan[0].row_splits[prefix].gathered:
            inputs = plan.intermediate_ranges if prefix == down else [(a * 64, b * 64) for a, b in plan.head_ranges]
            assert ks == inputs


def test_per_channel_slice_is_never_split() -> None:
    layers = {"model.layers.0.mlp.down_proj": _layer_meta(1536, 576, 0, False, [(0, 512, 128), (512, 1536, 1024)])}
    plan = make_plan(SMOLLM2, 2, layers)
    ks = [plan[r].row_splits["model.layers.0.mlp.down_proj"].k_range for r in range(2)]
    assert all(a in (0, 128, 256, 384, 512, 1536) for a, _ in ks)


@pytest.mark.parametrize("n", [0, -2, 10, 2.0, True])
def test_sizes_no_rule_covers_are_refused(n: object) -> None:
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        make_plan(SMOLLM2, n)  # type: ignore[arg-type]


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidParameterError, match="needs 2 CUDA devices; 1 visible"):
        check_devices(2, torch.device("cuda"))
    check_devices(1, torch.device("cuda"))
