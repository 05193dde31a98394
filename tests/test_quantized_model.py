"""A model stored in the halfbyte quantized format loads and computes what its dequantized
weights compute, on the CPU path (and through the GPU kernels where CUDA exists)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from halfbyte.engine.scoring import score_tokens
from halfbyte.errors import CorruptFileError, QuantizationError
from halfbyte.io.model_dir import read_json
from halfbyte.model.config import ModelConfig
from halfbyte.model.loader import load_model
from halfbyte.quant.qtensor import concat_out
from halfbyte.quant.rtn import quantize_rtn

FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def _quantize_dir(src: Path, out: Path, bits: dict[str, int], group: int) -> Path:
    """Quantize every projection of an HF checkpoint with RTN into the halfbyte layout, and write
    a dense twin whose weights are exactly the dequantized ones."""
    tensors = load_file(src / "model.safetensors")
    cfg = read_json(src / "config.json")
    layers: dict[str, dict] = {}
    qtensors: dict[str, torch.Tensor] = {}
    dense_twin: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{i}"
        mods = {"self_attn.o_proj": ("o_proj",), "mlp.down_proj": ("down_proj",), **FUSED}
        for fused, parts in mods.items():
            group_dir = fused.split(".")[0]
            names = [f"{base}.{group_dir}.{p}.weight" for p in parts]
            qws = [quantize_rtn(tensors.pop(n), bits[fused], group) for n in names]
            qw = concat_out(qws) if len(qws) > 1 else qws[0]
            prefix = f"{base}.{fused}"
            layers[prefix] = qw.meta()
            qtensors.update(qw.to_state_dict(prefix))
            for n, part in zip(names, qws):
                dense_twin[n] = part.dequantize()
    rest = {k: v.contiguous() for k, v in tensors.items()}
    for d, payload, extra in ((out / "q", {**rest, **qtensors}, True), (out / "dense", {**rest, **dense_twin}, False)):
        d.mkdir(parents=True)
        save_file(payload, d / "model.safetensors")
        c = dict(cfg)
        if extra:
            c["quantization"] = {"quant_method": "halfbyte", "format_version": 1, "layers": layers}
        (d / "config.json").write_text(json.dumps(c))
    return out


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    out = tmp_path_factory.mktemp("hf") / "m"
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("bits", [{"self_attn.qkv_proj": 4, "self_attn.o_proj": 3, "mlp.gate_up_proj": 2, "mlp.down_proj": 8}])
def test_quantized_equals_dequantized_dense(tiny_hf: Path, tmp_path: Path, bits: dict[str, int]) -> None:
    out = _quantize_dir(tiny_hf, tmp_path, bits, group=32)
    cfg = ModelConfig.from_hf(read_json(out / "q" / "config.json"))
    q_model = load_model(out / "q", cfg, torch.float32, torch.device("cpu"))
    d_model = load_model(out / "dense", cfg, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert (score_tokens(q_model, ids) - score_tokens(d_model, ids)).abs().max().item() <= 1e-4


def test_bad_quantization_metadata_is_a_clear_error(tiny_hf: Path, tmp_path: Path) -> None:
    out = _quantize_dir(tiny_hf, tmp_path, dict.fromkeys(["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"], 4), group=32)
    cfg_path = out / "q" / "config.json"
    raw = json.loads(cfg_path.read_text())
    cfg = ModelConfig.from_hf(raw)
    raw["quantization"]["layers"]["model.layers.0.mlp.down_proj"]["slices"][0]["bits"] = 7
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(QuantizationError, match="model.layers.0.mlp.down_proj.*bits 7"):
        load_model(out / "q", cfg, torch.float32, torch.device("cpu"))
    raw["quantization"]["layers"]["model.layers.9.mlp.down_proj"] = raw["quantization"]["layers"].pop("model.layers.0.mlp.down_proj")
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(CorruptFileError, match="model.layers.9"):
        load_model(out / "q", cfg, torch.float32, torch.device("cpu"))
