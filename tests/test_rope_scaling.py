"""RoPE scaling types against transformers' definitions, and the CLI / config parsing."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from halfbyte.errors import InvalidParameterError, UnsupportedModelError
from halfbyte.model.rope import RopeScaling, RotaryEmbedding, rope_frequencies

HEAD_DIM, BASE, MAX_POS = 64, 10000.0, 2048

CASES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "attention_factor": 1.3, "beta_fast": 16.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
]


def _hf_config(params: dict) -> transformers.LlamaConfig:
    cfg = transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POS)
    cfg.rope_parameters = {**params, "rope_theta": BASE}
    return cfg


@pytest.mark.parametrize("params", CASES, ids=[c["rope_type"] + str(i) for i, c in enumerate(CASES)])
@pytest.mark.parametrize("seq_len", [None, 1000, 5000])
def test_frequencies_match_transformers(params: dict, seq_len: int | None) -> None:
    ref_inv, ref_att = ROPE_INIT_FUNCTIONS[params["rope_type"]](_hf_config(params), "cpu", seq_len=seq_len)
    scaling = RopeScaling.from_hf({"rope_scaling": params})
    inv, att = rope_frequencies(scaling, HEAD_DIM, BASE, MAX_POS, seq_len)
    assert torch.allclose(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert att == pytest.approx(ref_att, rel=1e-6)


def test_static_ntk_is_a_base_change() -> None:
    """NTK-aware alpha scaling is transformers' default RoPE with base * alpha^(d/(d-2))."""
    alpha = 2.5
    inv, att = rope_frequencies(RopeScaling(type="ntk", alpha=alpha), HEAD_DIM, BASE, MAX_POS)
    cfg = _hf_config({"rope_type": "linear", "factor": 1.0})  # linear with factor 1 is the default RoPE
    cfg.rope_parameters["rope_theta"] = BASE * alpha ** (HEAD_DIM / (HEAD_DIM - 2))
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    assert torch.allclose(inv, ref.float(), rtol=1e-6, atol=0) and att == 1.0


@pytest.mark.parametrize("params", CASES[:1] + CASES[2:], ids=lambda p: p["rope_type"])
def test_cos_sin_match_transformers_rotary(params: dict) -> None:
    cfg = _hf_config(params)
    ref_rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    positions = torch.randint(0, 6000, (1, 50), generator=torch.Generator().manual_seed(0))
    ref_cos, ref_sin = ref_rot(torch.zeros(1, dtype=torch.float32), positions)
    ours = RotaryEmbedding(RopeScaling.from_hf({"rope_scaling": params}), HEAD_DIM, BASE, MAX_POS, "cpu", torch.float32)
    cos, sin = ours.cos_sin(positions[0], seq_len=6000)
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)


def test_parse_and_round_trip() -> None:
    assert RopeScaling.parse("none") == RopeScaling()
    assert RopeScaling.parse("linear:factor=2").factor == 2.0
    assert RopeScaling.parse("ntk:alpha=2.5").alpha == 2.5
    y = RopeScaling.parse("yarn:factor=4,original_max_position_embeddings=8192")
    assert y.type == "yarn" and y.original_max_position_embeddings == 8192
    l3 = RopeScaling.parse("llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192")
    assert RopeScaling.from_hf({"rope_scaling": l3.to_hf()}) == l3
    assert RopeScaling.from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}) == RopeScaling()


@pytest.mark.parametrize("spec,needle", [("yarn:factor=abc,original_max_position_embeddings=8", "factor"),
                                         ("bogus", "bogus"), ("linear:factor=0.5", "factor"),
                                         ("linear:speed=2", "speed"), ("yarn:factor=2", "original_max_position_embeddings")])
def test_parse_rejects_bad_specs(spec: str, needle: str) -> None:
    with pytest.raises(InvalidParameterError, match=needle):
        RopeScaling.parse(spec)


def test_unknown_config_type_is_unsupported() -> None:
    with pytest.raises(UnsupportedModelError, match="longrope"):
        RopeScaling.from_hf({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
