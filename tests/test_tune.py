"""End-to-end tuning (halfbyte/quant/tune.py): its forward is the model's, it lowers the KL it
optimises while every quantized value stays, and the converter stage resumes byte-identically."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from halfbyte.io.model_dir import read_json
from halfbyte.model.config import ModelConfig
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.quant.convert import ConvertOptions, convert
from halfbyte.quant.layer_forward import UNITS, TensorSource, read_layer
from halfbyte.quant.measure import Candidate
from halfbyte.quant.tune import Layer, TunableModel, _kl, forward_hidden, tune
# test_convert's tiny model and calibration file fixtures, shared (module scope: built once here)
from tests.test_convert import CORPUS, _files, _logits, calib, tiny  # noqa: F401

CODED = Candidate(((1.0, 3),), 32, act_order=True, scale_codes=True)
FP16 = Candidate(((1.0, 3),), 64, act_order=False)


def _opts(calib: Path, **kw: object) -> ConvertOptions:
    base: dict[str, object] = dict(calib_files=(str(calib),), seq_len=64, num_windows=6, show_progress=False, tune_steps=0)
    base.update(kw)
    return ConvertOptions(bits=5.0, **base)  # type: ignore[arg-type]


def _setup(model_dir: Path) -> tuple[ModelConfig, RotaryEmbedding, TensorSource]:
    cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"))
    rotary = RotaryEmbedding(cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                             torch.device("cpu"), torch.float32)
    return cfg, rotary, TensorSource(model_dir)


def _float_layers(src: TensorSource, n: int) -> list[Layer]:
    out = []
    for i in range(n):
        lw = read_layer(src, i)
        out.append(Layer(lw.matrices, lw.biases, lw.input_norm.float(), lw.post_norm.float()))
    return out


def _ids(model_dir: Path, text: str) -> list[int]:
    from halfbyte.io.tokenizer import Tokenizer

    return Tokenizer(model_dir).encode(text, add_special_tokens=False)


def test_forward_is_the_models_forward(tiny: Path) -> None:
    cfg, rotary, src = _setup(tiny)
    ids = _ids(tiny, CORPUS[:400])[:48]
    emb = src.get("model.embed_tokens.weight").float()
    with torch.no_grad():
        h = forward_hidden(cfg, _float_layers(src, cfg.num_layers), src.get("model.norm.weight").float(), emb[torch.tensor(ids)], rotary)
    torch.testing.assert_close(h @ emb.t(), _logits(tiny, ids), rtol=1e-4, atol=1e-4)


def _quantized(out: Path, n: int) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, object]], torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    layers = json.loads((out / "config.json").read_text())["quantization"]["layers"]
    per_layer = [{k: v for k, v in tensors.items() if k.startswith(f"model.layers.{i}.")} for i in range(n)]
    metas = [{u: layers[f"model.layers.{i}.{u}"] for u in UNITS} for i in range(n)]
    return per_layer, metas, tensors["model.norm.weight"]


@dataclass
class _Setup:
    """A tiny model converted with one candidate, its float reference on 4 windows, and the
    quantized layers to tune."""

    cfg: ModelConfig
    rotary: RotaryEmbedding
    emb: torch.Tensor
    windows: list[list[int]]
    ref: list[torch.Tensor]
    per_layer: list[dict[str, torch.Tensor]]
    metas: list[dict[str, Any]]
    final_norm: torch.Tensor

    def model(self) -> TunableModel:
        return TunableModel(self.per_layer, self.metas, self.final_norm)

    def kl(self, model: TunableModel) -> float:
        """Mean KL against the reference over the windows."""
        layers, fn = model.layers()
        with torch.no_grad():
            return sum(float(_kl(forward_hidden(self.cfg, layers, fn, self.emb[torch.tensor(w)], self.rotary) @ self.emb.t(),
                                 r @ self.emb.t())) for w, r in zip(self.windows, self.ref, strict=True)) / len(self.windows)

    def tune(self, model: TunableModel) -> None:
        tune(self.cfg, model, self.rotary, self.emb, self.emb, self.emb, self.windows, self.ref, steps=24,
             lr_norm=1e-2, lr_scale=2e-3)


def _converted(tiny: Path, calib: Path, out: Path, cand: Candidate) -> _Setup:
    convert(tiny, out, _opts(calib, candidates=(cand,)))
    cfg, rotary, src = _setup(tiny)
    per_layer, metas, final_norm = _quantized(out, cfg.num_layers)
    emb = src.get("model.embed_tokens.weight").float()
    ids = _ids(tiny, CORPUS)
    windows = [ids[i * 64:(i + 1) * 64] for i in range(4)]
    with torch.no_grad():
        ref = [forward_hidden(cfg, _float_layers(src, cfg.num_layers), src.get("model.norm.weight").float(),
                              emb[torch.tensor(w)], rotary) for w in windows]
    return _Setup(cfg, rotary, emb, windows, ref, per_layer, metas, final_norm)


@pytest.mark.parametrize("cand", [CODED, FP16], ids=["coded", "fp16"])
def test_tuning_lowers_the_kl_and_keeps_every_quantized_value(tiny: Path, calib: Path, tmp_path: Path, cand: Candidate) -> None:
    su = _converted(tiny, calib, tmp_path / "q", cand)
    model = su.model()
    before = su.kl(model)
    assert before > 1e-3  # 3 bits leave a visible error to tune away
    su.tune(model)
    after = su.kl(model)
    assert after < 0.9 * before, (before, after)
    tuned, tuned_norm = model.state_dicts()
    assert not torch.equal(tuned_norm, su.final_norm)
    for i, (old, new) in enumerate(zip(su.per_layer, tuned, strict=True)):
        assert set(old) == set(new)
        for key, t in old.items():
            assert new[key].dtype == t.dtype and new[key].shape == t.shape, key
            if ".qweight." in key or key.endswith(".perm") or (cand.scale_codes and (".scales." in key or ".mins." in key)):
                assert torch.equal(new[key], t), key  # q, the permutation and the 8-bit codes stay
        assert not torch.equal(new[f"model.layers.{i}.input_layernorm.weight"], old[f"model.layers.{i}.input_layernorm.weight"])
        moved = "scale_step" if cand.scale_codes else "scales"
        assert not torch.equal(new[f"model.layers.{i}.mlp.down_proj.{moved}.0"], old[f"model.layers.{i}.mlp.down_proj.{moved}.0"])


def test_resume_during_tuning_gives_identical_files(tiny: Path, calib: Path, tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    convert(tiny, straight, _opts(calib, candidates=(CODED, FP16), tune_steps=6))
    untuned = tmp_path / "untuned"
    convert(tiny, untuned, _opts(calib, candidates=(CODED, FP16)))
    assert _files(straight) != _files(untuned)  # the stage ran and changed the output

    class Killed(Exception):
        pass

    def kill(pass_name: str, i: int) -> None:
        if (pass_name, i) == ("tune", 3):
            raise Killed

    out = tmp_path / "resumed"
    with pytest.raises(Killed):
        convert(tiny, out, _opts(calib, candidates=(CODED, FP16), tune_steps=6, after_layer=kill))
    assert not out.exists() and (tmp_path / "resumed.partial").is_dir()
    calls: list[tuple[str, int]] = []
    convert(tiny, out, _opts(calib, candidates=(CODED, FP16), tune_steps=6, after_layer=lambda p, i: calls.append((p, i))))
    assert calls == [("tune", s) for s in range(6)]  # no layer quantized again; tuning from its start
    assert _files(out) == _files(straight)


def test_bad_tune_steps_is_a_clear_error(tiny: Path, calib: Path, tmp_path: Path) -> None:
    from halfbyte.quant.convert import ConversionError

    with pytest.raises(ConversionError, match="tune-steps"):
        convert(tiny, tmp_path / "q", _opts(calib, tune_steps=-1))
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def test_default_tuning_only_where_it_pays_and_fits(tiny: Path) -> None:
    """Below 4 bpw for small decoders, with more calibration and more steps; never by
    default for one too large to hold for a backward pass (the converter's one-layer memory
    bound); explicit options override every default."""
    from halfbyte.quant.convert import (
        CALIB_WINDOWS, SAMPLE_PROMPTS, TUNE_MAX_PARAMS, TUNE_SAMPLE_PROMPTS, TUNE_STEPS,
        resolve_defaults, tunes_by_default,
    )

    small = ModelConfig.from_hf(read_json(tiny / "config.json"))
    assert tunes_by_default(3.25, small) and not tunes_by_default(4.25, small)
    low = resolve_defaults(ConvertOptions(bits=3.25), small)
    assert (low.sample_prompts, low.num_windows, low.steps()) == (
        TUNE_SAMPLE_PROMPTS, CALIB_WINDOWS, TUNE_STEPS)
    high = resolve_defaults(ConvertOptions(bits=4.25), small)
    assert (high.sample_prompts, high.num_windows, high.steps()) == (SAMPLE_PROMPTS, CALIB_WINDOWS, 0)
    assert SAMPLE_PROMPTS < TUNE_SAMPLE_PROMPTS  # the reason for the split
    untuned = resolve_defaults(ConvertOptions(bits=3.25, tune_steps=0), small)  # --no-tune: the plain calibration
    assert (untuned.sample_prompts, untuned.num_windows, untuned.steps()) == (SAMPLE_PROMPTS, CALIB_WINDOWS, 0)
    forced = resolve_defaults(ConvertOptions(bits=4.25, tune_steps=5, num_windows=7, sample_prompts=3), small)
    assert (forced.sample_prompts, forced.num_windows, forced.steps()) == (3, 7, 5)
    # asymmetric GPTQ below 4 bpw, tuned or not; never by default at 4.25 (exact grids stay reachable)
    assert low.asymmetric and untuned.asymmetric and not high.asymmetric
    assert resolve_defaults(ConvertOptions(bits=4.25, asymmetric=True), small).asymmetric
    big = ModelConfig.from_hf({**read_json(tiny / "config.json"), "num_hidden_layers": 80, "hidden_size": 8192,
                               "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8})
    assert 80 * 8192 * 28672 * 3 > TUNE_MAX_PARAMS
    assert not tunes_by_default(2.5, big)
    assert resolve_defaults(ConvertOptions(bits=2.5), big).steps() == 0
    assert ConvertOptions(bits=2.5, tune_steps=5).steps() == 5
