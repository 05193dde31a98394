"""Offline rotations (quant/rotation.py): the rotated checkpoint computes the same function, and
a conversion through them writes a loadable model with an untied head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from halfbyte.model.config import ModelConfig
from halfbyte.quant.convert import convert
from halfbyte.quant.layer_forward import TensorSource
from halfbyte.quant.rotation import RotatedSource, random_orthogonal
from tests.test_convert import _logits, _opts, calib, make_tokenizer  # noqa: F401  (calib: a fixture)


def test_random_orthogonal_is_orthogonal_and_seeded() -> None:
    q = random_orthogonal(48, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(48, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(q, random_orthogonal(48, seed=3))
    assert not torch.allclose(q, random_orthogonal(48, seed=4))


def _model(out: Path, bias: bool) -> Path:
    """A tied GQA Llama with non-trivial norm weights (so that folding them is tested)."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        attention_bias=bias, mlp_bias=bias,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 1.5 + 0.25)
            elif p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer(out)
    return out


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "biases"])
def test_rotated_checkpoint_computes_the_same_logits(tmp_path: Path, bias: bool) -> None:
    src_dir = _model(tmp_path / "m", bias)
    cfg_json = json.loads((src_dir / "config.json").read_text())
    src = TensorSource(src_dir)
    rotated = RotatedSource(src, ModelConfig.from_hf(cfg_json), seed=5)
    names = [*load_file(src_dir / "model.safetensors"), "lm_head.weight"]
    out = tmp_path / "r"
    out.mkdir()
    tensors = {n: rotated.get(n).contiguous() for n in names}
    assert all(t.dtype == torch.float32 for t in tensors.values())
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg_json, "tie_word_embeddings": False}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src_dir / f, out / f)
    # the rotation really moved the weights, and the norms are now folded in
    w0 = load_file(src_dir / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert float((tensors["model.layers.0.mlp.up_proj.weight"] - w0).abs().max()) > 0.1 * float(w0.abs().max())
    assert torch.equal(tensors["model.layers.1.input_layernorm.weight"], torch.ones(64))
    ids = list(range(3, 40))
    ref, got = _logits(src_dir, ids), _logits(out, ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 * float(ref.abs().max()))


def test_conversion_through_rotations_tracks_the_float_model(tmp_path: Path, calib: Path) -> None:
    src_dir = _model(tmp_path / "m", bias=False)
    ids = list(range(3, 60))
    ref = _logits(src_dir, ids)
    errs = {}
    for rotate in (True, False):
        out = tmp_path / f"q{rotate}"
        convert(src_dir, out, _opts(calib, 6.0, rotate=rotate))
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is not rotate  # the rotated head is its own tensor
        assert ("rotation" in cfg["quantization"]) is rotate
        errs[rotate] = float((_logits(out, ids) - ref).abs().max())
    scale = float(ref.abs().max())
    assert errs[True] < 0.05 * scale and errs[False] < 0.05 * scale, (errs, scale)

