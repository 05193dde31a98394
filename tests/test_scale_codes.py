"""8-bit coded scales and mins (quant/scale_codes.py): exact round trips through the file, the
bit accounting, GPTQ on a weight that already sits on a 4-bit group-32 grid, the converter end
to end (and the tensor-parallel shard reader), and clear errors for bad codes."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from halfbyte.distributed.shard_loading import ShardReader, _column_quant, _row_quant
from halfbyte.errors import QuantizationError
from halfbyte.quant.convert import convert
from halfbyte.quant.gptq import gptq_quantize
from halfbyte.quant.measure import Candidate, storage_bits
from halfbyte.quant.qtensor import QuantWeight, concat_out
from halfbyte.quant.scale_codes import decode, encode, snap, steps_for
from tests.test_convert import _logits, _opts, calib, make_model  # noqa: F401  (calib is a fixture)


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight on a Q4_1 grid: every group of 32 spans q = 0..15 with fp16 d and m."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[:, :, 0], q[:, :, 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.002).half().float()
    m = (-7.5 * d + torch.randn(n, k // 32, 1, generator=g) * 0.003).half().float()
    return (q * d + m).view(n, k)


def test_codes_round_trip_exactly_and_snap_lands_on_codes() -> None:
    g = torch.Generator().manual_seed(1)
    scales = (torch.rand(9, 40, generator=g) * 0.05 + 1e-4).half()
    mins = (torch.randn(9, 40, generator=g) * 0.1).half()
    codes = steps_for(scales.float(), mins.float())
    assert codes.scale_step.dtype == torch.float16 and codes.scale_step.shape == (40,)
    s, m = snap(scales.float(), mins.float(), codes)
    s8, m8 = encode(s.half(), m.half(), codes, "w")
    assert s8.dtype == torch.uint8 and m8.dtype == torch.int8 and int(s8.min()) >= 1
    back_s, back_m = decode(s8, m8, codes)
    assert torch.equal(back_s, s.half()) and torch.equal(back_m, m.half())
    # the largest scale of each column keeps the top code (the step was rounded up, not down)
    assert bool((s8.max(0).values >= 254).all())
    # each value moves at most half a step (plus fp16 rounding); below one step it becomes the step
    step = codes.scale_step.float()[None, :].expand_as(s)
    big = scales.float() >= step
    assert bool(((s - scales.float()).abs()[big] <= 0.5 * step[big] * 1.01 + 1e-3 * s[big]).all())
    assert torch.equal(s[~big], step[~big].half().float())


def test_gptq_holds_a_q4_1_grid_nearly_exactly_at_fewer_bits() -> None:
    w = q4_1_weight(64, 256)
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(2))
    h = 2 * x.t() @ x / 512
    exact, _ = gptq_quantize(w, h, 4, 32)
    coded, _ = gptq_quantize(w, h, 4, 32, scale_codes=True)
    g64, _ = gptq_quantize(w, h, 4, 64)
    err = {name: float((qw.dequantize() - w).norm() / w.norm()) for name, qw in
           (("exact", exact), ("coded", coded), ("g64", g64))}
    assert err["exact"] == 0.0
    assert err["coded"] < 0.02 and err["coded"] < err["g64"] / 3, err
    assert coded.bits_per_weight() == pytest.approx(4 + 16 / 32 + 32 / 256)
    assert exact.bits_per_weight() == 5.0
    cand = Candidate(((1.0, 4),), 32, act_order=False, scale_codes=True)
    assert coded.storage_bits() == storage_bits(cand, 64, 256, act_order=True)


def test_coded_weight_survives_the_state_dict_and_fusion() -> None:
    w = q4_1_weight(32, 128, seed=3)
    h = torch.eye(128)
    a, _ = gptq_quantize(w, h, 4, 32, scale_codes=True)
    b, _ = gptq_quantize(w[:16] * 2, h, 4, 32, scale_codes=True)
    state = a.to_state_dict("p")
    assert state["p.scales.0"].dtype == torch.uint8 and state["p.mins.0"].dtype == torch.int8
    assert a.meta()["slices"][0]["scale_codes"] == 8
    back = QuantWeight.from_state_dict("p", state, json.loads(json.dumps(a.meta())))
    assert torch.equal(back.dequantize(), a.dequantize()) and back.storage_bits() == a.storage_bits()
    fused = concat_out([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert fused.storage_bits() == a.storage_bits() + b.storage_bits()
    plain, _ = gptq_quantize(w, h, 4, 32)
    with pytest.raises(QuantizationError, match="different slices"):
        concat_out([a, plain])


def test_bad_codes_are_clear_errors() -> None:
    w = q4_1_weight(16, 64, seed=4)
    qw, _ = gptq_quantize(w, torch.eye(64), 4, 32, scale_codes=True)
    state, meta = qw.to_state_dict("layer.x"), qw.meta()
    wrong_dtype = {**state, "layer.x.scales.0": state["layer.x.scales.0"].half()}
    with pytest.raises(QuantizationError, match="layer.x.*uint8"):
        QuantWeight.from_state_dict("layer.x", wrong_dtype, meta)
    missing = {k: v for k, v in state.items() if "min_step" not in k}
    with pytest.raises(QuantizationError, match="missing tensor 'layer.x.min_step.0'"):
        QuantWeight.from_state_dict("layer.x", missing, meta)
    bad_meta = json.loads(json.dumps(meta))
    bad_meta["slices"][0]["scale_codes"] = 6
    with pytest.raises(QuantizationError, match="scale_codes must be 8"):
        QuantWeight.from_state_dict("layer.x", state, bad_meta)
    step = qw.slices[0].codes.scale_step[0].float()  # type: ignore[union-attr]
    qw.slices[0].scales[0, 0] = (qw.slices[0].scales[0, 0].float() - 0.37 * step).half()  # between two codes
    with pytest.raises(QuantizationError, match="not exact 8-bit codes"):
        qw.to_state_dict("layer.x")


def test_converter_writes_coded_layers_that_load_and_shard(calib: Path, tmp_path: Path) -> None:  # noqa: F811
    tiny = make_model(tmp_path / "m")
    coded = (Candidate(((1.0, 4),), 32, act_order=False, scale_codes=True),)
    out = tmp_path / "q"
    result = convert(tiny, out, _opts(calib, 5.0, candidates=coded))
    layers = json.loads((out / "config.json").read_text())["quantization"]["layers"]
    assert all(m["slices"][0].get("scale_codes") == 8 for m in layers.values())
    # 64-wide inputs: 4 + 16 / 32 + 32 / 64 = 5 bits; the 128-wide down projection 4 + 0.5 + 0.25
    assert 4.75 < result.bits_per_weight < 5.0
    ids = list(range(3, 40))
    ref = _logits(tiny, ids)
    assert float((_logits(out, ids) - ref).abs().max()) < 0.4 * float(ref.abs().max())
    # the tensor-parallel reader: a rank's output columns and a K range decode like the whole
    from safetensors.torch import load_file

    prefix = "model.layers.0.mlp.gate_up_proj"
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update({k: v for k, v in load_file(str(f)).items() if k.startswith(prefix + ".")})
    whole = QuantWeight.from_state_dict(prefix, tensors, layers[prefix]).dequantize()
    with contextlib.ExitStack() as stack:
        reader = ShardReader(out, stack)
        cols = _column_quant(reader, prefix, layers[prefix], [(8, 40), (200, 232)])
        rows = _row_quant(reader, prefix, layers[prefix], (32, 64))
    assert torch.equal(cols.dequantize(), torch.cat([whole[8:40], whole[200:232]]))
    assert rows is not None and torch.equal(rows.dequantize(), whole[:, 32:64])


def test_act_order_by_whole_groups_keeps_the_energetic_groups_on_their_grid() -> None:
    from halfbyte.quant.gptq import activation_order
    from halfbyte.quant.measure import quantize_candidate

    energy = torch.tensor([1.0, 5.0, 2.0, 9.0, 0.5, 0.5, 3.0, 3.0])
    assert activation_order(energy, 2).tolist() == [2, 3, 0, 1, 6, 7, 4, 5]  # sums 6, 11, 1, 6: ties stay in order
    assert activation_order(energy, 1).tolist() == torch.argsort(energy, descending=True, stable=True).tolist()
    with pytest.raises(QuantizationError, match="blocks of 3"):
        activation_order(energy, 3)
    w = q4_1_weight(48, 256, seed=5)
    scale = torch.ones(256)
    scale[64:128] = 30.0  # groups 2 and 3 carry the energy
    x = torch.randn(2048, 256, generator=torch.Generator().manual_seed(6)) * scale
    h = 2 * x.t() @ x / 2048
    cand = Candidate(((0.25, 4), (0.75, 3)), 32, scale_codes=True, order_block=32)
    qw, _ = quantize_candidate(w, h, cand)
    assert qw.perm is not None and sorted(qw.perm[:64].tolist()) == list(range(64, 128))
    err = (qw.dequantize() - w).abs()
    hot, cold = err[:, 64:128].norm() / w[:, 64:128].norm(), err[:, :64].norm() / w[:, :64].norm()
    assert hot < 0.02 and cold > 3 * hot, (hot, cold)
    assert qw.storage_bits() == storage_bits(cand, 48, 256, act_order=True)
    assert Candidate.from_json(json.loads(json.dumps(cand.to_json()))) == cand
