"""The measurement pass's error model (block output error per candidate) and exactness on
weights that already sit on a 4-bit group-32 grid, like SmolLM2's Q4_1-imported reference."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from halfbyte.model.config import ModelConfig
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.quant.block_error import measure_layer, subsample
from halfbyte.quant.convert import UNITS, TensorSource, read_layer, run_layer
from halfbyte.quant.gptq import HessianAccumulator, gptq_quantize
from halfbyte.quant.measure import Candidate, allocate, candidate_weights, default_candidates, measure_candidates, storage_bits
from halfbyte.quant.rtn import _rounding_error, group_params, quantize_rtn
from tests.test_convert import make_model

G32_SEQ = Candidate(((1.0, 4),), 32, act_order=False)


def _q41_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """w = q * d + m with q in 0..15 per group of 32 along K and fp16 d, m, every group using
    both ends of its range (as llama.cpp's Q4_1 quantizer does)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    q[:, 0::32], q[:, 1::32] = 0, 15
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    return q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)


def _hessian(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    acc = HessianAccumulator(k)
    acc.add_batch(torch.randn(512, 16, generator=g) @ torch.randn(16, k, generator=g) + 0.2 * torch.randn(512, k, generator=g))
    return acc.hessian


def test_grid_aligned_weight_is_exact_at_4_bit_group_32_in_column_order() -> None:
    w, h = _q41_weight(40, 96, seed=1), _hessian(96, seed=2)
    assert torch.equal(quantize_rtn(w, 4, 32).dequantize(), w)
    for clip in (False, True):  # the clip search keeps the full range on ties
        gq, loss = gptq_quantize(w, h, 4, 32, act_order=False, clip_search=clip)
        assert torch.equal(gq.dequantize(), w) and loss == 0.0
    cands = default_candidates()
    deq = candidate_weights(w, h, cands, act_order=True, clip_search=True)
    err = measure_candidates(w, h, cands, act_order=True, clip_search=True)
    for c, d, e in zip(cands, deq, err, strict=True):
        if c == G32_SEQ:
            assert torch.equal(d, w) and e == 0.0
        else:  # act-order regroups the columns, other widths and groups move the grid
            assert e > 0.0, c.name
    # 4 bits + an fp16 scale and min per 32 weights: exactly 5 bits per weight
    assert storage_bits(G32_SEQ, 40, 96, act_order=True) == 5 * 40 * 96
    # so from a budget of 5 bpw on, the allocator takes it everywhere: nothing has less error
    costs = [storage_bits(c, 40, 96, act_order=True) for c in cands]
    for budget in (5.0, 6.0, 8.0):
        picks = allocate([costs] * 3, [err] * 3, budget * 3 * 40 * 96)
        assert all(cands[p] == G32_SEQ for p in picks), budget


@pytest.fixture(scope="module")
def layer(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, object, torch.Tensor, list[int], RotaryEmbedding]:
    d = make_model(tmp_path_factory.mktemp("be") / "m", layers=1)
    cfg = ModelConfig.from_hf(json.loads((Path(d) / "config.json").read_text()))
    lw = read_layer(TensorSource(Path(d)), 0)
    g = torch.Generator().manual_seed(0)
    lengths = [24, 40, 32]
    stream = torch.randn(sum(lengths), cfg.hidden_size, generator=g)
    stream[0] *= 30  # an "attention sink" token with a much larger residual norm
    rotary = RotaryEmbedding(cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                             torch.device("cpu"), torch.float32)
    return cfg, lw, stream, lengths, rotary


def test_measured_error_is_the_attention_blocks_output_error(layer) -> None:  # type: ignore[no-untyped-def]
    """With the MLP switched off (down_proj = 0) the layer's output is stream + attention block,
    so replacing qkv or o_proj by a candidate's weight and running the whole layer must change
    its output by exactly the measured relative error."""
    cfg, lw0, stream, lengths, rotary = layer
    lw = dataclasses.replace(lw0, matrices={**lw0.matrices, UNITS[3]: torch.zeros_like(lw0.matrices[UNITS[3]])})
    cands = [Candidate(((1.0, 2),), 32), Candidate(((1.0, 4),), 64, act_order=False)]
    errors, after = measure_layer(cfg, lw, stream, lengths, rotary, cands, act_order=True, damp=0.01, max_tokens=10**6)
    hessians: dict[str, torch.Tensor] = {}

    def keep(unit: str, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        hessians[unit] = h
        return w

    assert torch.allclose(run_layer(cfg, lw, stream, lengths, rotary, keep), after)
    for unit in UNITS[:2]:
        deq = candidate_weights(lw.matrices[unit], hessians[unit], cands, act_order=True)
        for c in range(len(cands)):
            out = run_layer(cfg, lw, stream, lengths, rotary, lambda u, h, w, c=c, unit=unit: deq[c] if u == unit else w)
            direct = float(((out - after).square().sum(1) / stream.square().sum(1)).mean())
            assert errors[unit][c] == pytest.approx(direct, rel=1e-3), (unit, cands[c].name)
    for unit in UNITS[:2]:
        assert errors[unit][0] > errors[unit][1] > 0, unit  # 2 bits hurt more than 4
    assert errors[UNITS[2]] == [0.0, 0.0]  # gate_up errors cannot reach the output through down = 0


def test_mlp_errors_are_relative_to_the_stream_entering_the_mlp(layer) -> None:  # type: ignore[no-untyped-def]
    """down_proj's candidate error is linear: the layer output with it replaced differs by
    exactly the measured error times the MLP input stream's power, token by token."""
    cfg, lw, stream, lengths, rotary = layer
    cands = [Candidate(((1.0, 3),), 32), Candidate(((1.0, 8),), 128, act_order=False)]
    errors, after = measure_layer(cfg, lw, stream, lengths, rotary, cands, act_order=True, damp=0.01, max_tokens=10**6)
    hessians: dict[str, torch.Tensor] = {}
    mlp_in: list[torch.Tensor] = []

    def keep(unit: str, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        hessians[unit] = h
        return w

    run_layer(cfg, lw, stream, lengths, rotary, keep)
    no_mlp = dataclasses.replace(lw, matrices={**lw.matrices, UNITS[3]: torch.zeros_like(lw.matrices[UNITS[3]])})
    mlp_in.append(run_layer(cfg, no_mlp, stream, lengths, rotary, lambda u, h, w: w))  # stream + attention
    deq = candidate_weights(lw.matrices[UNITS[3]], hessians[UNITS[3]], cands, act_order=True)
    for c in range(len(cands)):
        out = run_layer(cfg, lw, stream, lengths, rotary, lambda u, h, w, c=c: deq[c] if u == UNITS[3] else w)
        direct = float(((out - after).square().sum(1) / mlp_in[0].square().sum(1)).mean())
        assert errors[UNITS[3]][c] == pytest.approx(direct, rel=1e-3), cands[c].name
    for unit in UNITS:
        assert errors[unit][0] > errors[unit][1] > 0, unit  # 3 bits hurt more than 8


def test_subsample_takes_whole_leading_sequences() -> None:
    assert subsample([24, 40, 32], 70) == (64, [24, 40])
    assert subsample([24, 40, 32], 10) == (24, [24])  # at least one sequence
    assert subsample([24, 40, 32], 1000) == (96, [24, 40, 32])


def test_clip_search_never_rounds_worse_than_the_full_range() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g)
    w[:, 5] *= 6  # an outlier column: clipping it pays off unless its weight says otherwise
    for bits in (2, 3, 4):
        for col_weight in (None, torch.rand(32, generator=g) + 0.01):
            full = group_params(w, bits)
            clipped = group_params(w, bits, clip_search=True, col_weight=col_weight)
            e_full = _rounding_error(w, *full, (1 << bits) - 1, col_weight)
            e_clip = _rounding_error(w, *clipped, (1 << bits) - 1, col_weight)
            assert bool((e_clip <= e_full).all())
            if col_weight is None and bits < 4:  # at few bits clipping the outlier pays clearly
                assert float(e_clip.sum()) < 0.9 * float(e_full.sum()), bits


def test_clip_search_over_a_batch_of_groups_picks_each_rows_best_grid(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """group_params on [C, N, G] (several candidates' groups at once, the factors in chunks)
    equals one group at a time, and each row's grid is the first of the least-error ones."""
    import halfbyte.quant.rtn as rtn

    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 40, 32, generator=g)
    w[:, :, 7] *= 5
    cw = torch.rand(32, generator=g) + 0.01
    monkeypatch.setattr(rtn, "_CLIP_TRIAL_ELEMENTS", 3 * w.numel())  # factors in chunks of 3
    s, m = group_params(w, 3, clip_search=True, col_weight=cw)
    for c in range(3):
        sc, mc = group_params(w[c], 3, clip_search=True, col_weight=cw)
        assert torch.equal(s[c], sc) and torch.equal(m[c], mc)
        # every listed grid, one at a time: none rounds a row better than the chosen one
        lo, hi = w[c].amin(1), w[c].amax(1)
        chosen = _rounding_error(w[c], sc, mc, 7, cw)
        for f in (1.0, *rtn.CLIP_FACTORS):
            fs = (2 * f * (hi - lo) / 2 / 7).clamp_min(2.0**-24).half().float()
            fm = ((hi + lo) / 2 - f * (hi - lo) / 2).half().float()
            assert bool((chosen <= _rounding_error(w[c], fs, fm, 7, cw)).all()), f
