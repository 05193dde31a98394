"""halfbyte's reference network against transformers on the same weights, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from halfbyte.engine.scoring import score_tokens
from halfbyte.io.model_dir import read_json
from halfbyte.model.config import ModelConfig
from halfbyte.model.loader import load_model

BASE = dict(
    vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
)
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
}
CASES = [
    ("llama", dict(num_key_value_heads=2), "default"),  # GQA
    ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True), "default"),  # MHA, tied
    ("llama", dict(attention_bias=True, mlp_bias=True), "linear"),
    ("llama", dict(num_key_value_heads=1, head_dim=32), "dynamic"),  # MQA, head_dim != hidden/heads
    ("llama", dict(), "yarn"),
    ("llama", dict(tie_word_embeddings=True), "llama3"),
    ("qwen2", dict(tie_word_embeddings=False), "default"),  # qkv bias, no o bias
    ("mistral", dict(sliding_window=24), "default"),
]


def _make_hf(tmp_path: Path, family: str, extra: dict, rope: str, seed: int) -> Path:
    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[family]
    kwargs = {**BASE, **extra}
    if family == "mistral":
        kwargs.pop("mlp_bias", None)
    cfg = cls(**kwargs)
    if ROPES[rope] is not None:
        cfg.rope_parameters = {**ROPES[rope], "rope_theta": 10000.0}
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[family]
    hf = model_cls(cfg).float().eval()
    with torch.no_grad():  # default init leaves biases at zero and norms at one: perturb them
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / f"{family}-{rope}-{seed}"
    hf.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("family,extra,rope", CASES, ids=[f"{f}-{r}-{i}" for i, (f, _, r) in enumerate(CASES)])
def test_logits_match_transformers(tmp_path: Path, family: str, extra: dict, rope: str) -> None:
    model_dir = _make_hf(tmp_path, family, extra, rope, seed=hash((family, rope)) % 1000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"))
    ours = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    # past max_position_embeddings (128): dynamic NTK switches on; yarn/llama3 pass their original window
    ids = torch.randint(0, BASE["vocab_size"], (1, 150), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    got = score_tokens(ours, ids[0].tolist())
    assert (got - ref).abs().max().item() <= 1e-4
    if rope != "dynamic":  # dynamic NTK changes frequencies with the length seen: chunks differ by design
        chunked = score_tokens(ours, ids[0].tolist(), chunk=17)
        assert (chunked - ref).abs().max().item() <= 1e-4


def test_config_rejects_unknown_architecture() -> None:
    from halfbyte.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
