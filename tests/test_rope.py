"""RoPE and every scaling type against transformers (ROPE_INIT_FUNCTIONS, LlamaRotaryEmbedding),
plus config / CLI parsing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from halfbyte.errors import InvalidParameterError, UnsupportedModelError
from halfbyte.model.rope import RopeScaling, RotaryEmbedding, rope_frequencies

MAX_POS = 2048

# (rope_parameters without rope_theta, head_dim, base); yarn/llama3 originals below MAX_POS so
# the scaled region is exercised at the test positions
CASES: dict[str, tuple[dict[str, Any], int, float]] = {
    "default": ({"rope_type": "default"}, 64, 10000.0),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64, 10000.0),
    "linear-128": ({"rope_type": "linear", "factor": 2.5}, 128, 500000.0),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 64, 10000.0),
    "dynamic-128": ({"rope_type": "dynamic", "factor": 8.0}, 128, 500000.0),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 64, 10000.0),
    "yarn-mscale": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "mscale": 0.707,
         "mscale_all_dim": 1.0},
        128, 10000.0,
    ),
    "yarn-attention": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "attention_factor": 1.3,
         "beta_fast": 16.0, "beta_slow": 2.0},
        64, 1000000.0,
    ),
    "yarn-no-truncate": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "truncate": False},
        64, 10000.0,
    ),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
        128, 500000.0,
    ),
    "llama3-64": (
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
         "original_max_position_embeddings": 1024},
        64, 10000.0,
    ),
}


def _hf_config(params: dict[str, Any], head_dim: int, base: float) -> transformers.LlamaConfig:
    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
        rope_parameters={**params, "rope_theta": base},
    )
    assert cfg.head_dim == head_dim
    return cfg


def _hf_frequencies(cfg: transformers.LlamaConfig, seq_len: Any = None) -> tuple[torch.Tensor, float]:
    kind = cfg.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)


def _ours(name: str) -> tuple[RopeScaling, int, float]:
    params, head_dim, base = CASES[name]
    return RopeScaling.from_hf({"rope_parameters": {**params, "rope_theta": base}}), head_dim, base


def _assert_rel(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0), (ours - ref).abs().max()


@pytest.mark.parametrize("name", CASES)
def test_frequencies_match_transformers(name: str) -> None:
    scaling, head_dim, base = _ours(name)
    ref_inv, ref_att = _hf_frequencies(_hf_config(*CASES[name]))
    inv, att = rope_frequencies(scaling, head_dim, base, MAX_POS)
    _assert_rel(inv, ref_inv)
    assert att == pytest.approx(ref_att, rel=1e-6)
    if name != "default":  # the scaling changed something, so a no-op implementation would fail
        plain, _ = rope_frequencies(RopeScaling(), head_dim, base, MAX_POS)
        assert not torch.equal(inv, plain) or att != 1.0 or scaling.type == "dynamic"


@pytest.mark.parametrize("name", ["dynamic", "dynamic-128"])
@pytest.mark.parametrize("seq_len", [1, 100, MAX_POS - 1, MAX_POS, MAX_POS + 1, 3000, 5000, 20000])
def test_dynamic_frequencies_match_transformers(name: str, seq_len: int) -> None:
    scaling, head_dim, base = _ours(name)
    cfg = _hf_config(*CASES[name])
    inv, att = rope_frequencies(scaling, head_dim, base, MAX_POS, seq_len)
    for hf_seq_len in (seq_len, torch.tensor(seq_len)):  # python path (float64) and run-time path (float32)
        ref_inv, ref_att = _hf_frequencies(cfg, hf_seq_len)
        _assert_rel(inv, ref_inv)
        assert att == ref_att == 1.0
    plain, _ = rope_frequencies(RopeScaling(), head_dim, base, MAX_POS)
    assert torch.equal(inv, plain) == (seq_len <= MAX_POS)


@pytest.mark.parametrize("head_dim,base,alpha", [(64, 10000.0, 2.5), (128, 500000.0, 4.0), (128, 10000.0, 0.5)])
def test_static_ntk_is_transformers_default_with_a_new_base(head_dim: int, base: float, alpha: float) -> None:
    scaling = RopeScaling.parse(f"ntk:alpha={alpha}")
    new_base = base * alpha ** (head_dim / (head_dim - 2))
    cfg = _hf_config({"rope_type": "default"}, head_dim, new_base)
    ref_inv, _ = _hf_frequencies(cfg)
    inv, att = rope_frequencies(scaling, head_dim, base, MAX_POS)
    _assert_rel(inv, ref_inv)
    assert att == 1.0
    positions = torch.randint(0, 3 * MAX_POS, (3, 41), generator=torch.Generator().manual_seed(1))
    ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1), positions)
    cos, sin = RotaryEmbedding(scaling, head_dim, base, MAX_POS, "cpu", torch.float32).cos_sin(positions)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize("name", CASES)
def test_cos_sin_match_transformers_rotary(name: str, dtype: torch.dtype, atol: float) -> None:
    """Random positions past every scaled window, batched [3, 57]; a fresh module each draw,
    so dynamic sees its first length."""
    scaling, head_dim, base = _ours(name)
    ours = RotaryEmbedding(scaling, head_dim, base, MAX_POS, "cpu", dtype)
    gen = torch.Generator().manual_seed(0)
    for top in (MAX_POS // 2, 3 * MAX_POS, 9 * MAX_POS):
        positions = torch.randint(0, top, (3, 57), generator=gen)
        ref_cos, ref_sin = LlamaRotaryEmbedding(_hf_config(*CASES[name]))(torch.zeros(1, dtype=dtype), positions)
        fresh = RotaryEmbedding(scaling, head_dim, base, MAX_POS, "cpu", dtype)
        for rot in ((fresh, ours) if scaling.type != "dynamic" else (fresh,)):
            cos, sin = rot.cos_sin(positions)
            assert cos.shape == (3, 57, head_dim) and cos.dtype == dtype
            torch.testing.assert_close(cos, ref_cos, rtol=0, atol=atol)
            torch.testing.assert_close(sin, ref_sin, rtol=0, atol=atol)


@pytest.mark.parametrize("name", ["dynamic", "dynamic-128"])
def test_dynamic_follows_transformers_across_calls(name: str) -> None:
    """Prefill and decode steps whose lengths grow past the window, shrink while still past it
    (transformers keeps the longer length's frequencies), then fall inside it (reset)."""
    scaling, head_dim, base = _ours(name)
    ref = LlamaRotaryEmbedding(_hf_config(*CASES[name]))
    ours = RotaryEmbedding(scaling, head_dim, base, MAX_POS, "cpu", torch.float32)
    steps = [(0, 300), (300, 301), (300, 2047), (2047, 2048), (2048, 2049), (2049, 2050), (0, 3000),
             (2000, 2500), (2500, 2501), (4000, 5000), (0, 100), (100, 101), (2040, 2200)]
    stale_seen = False
    for start, end in steps:
        positions = torch.arange(start, end)[None]  # [1, T]
        ref_cos, ref_sin = ref(torch.zeros(1), positions)
        cos, sin = ours.cos_sin(positions[0], seq_len=end)  # a caller with a KV cache passes the length
        torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=1e-6)
        own_len, _ = rope_frequencies(scaling, head_dim, base, MAX_POS, end)
        stale_seen |= not torch.equal(own_len, ref.inv_freq)
    assert stale_seen  # the (2000, 2500) step used 3000's frequencies: stateless code would fail


def test_table_grows_by_doubling_and_decode_gathers() -> None:
    scaling, head_dim, base = _ours("llama3")
    rot = RotaryEmbedding(scaling, head_dim, base, MAX_POS, "cpu", torch.float32)
    assert rot.capacity == 0  # nothing is built before it is needed
    rot.cos_sin(torch.arange(100), seq_len=100)
    assert rot.capacity == 128
    table = rot._cos
    for n in range(100, 128):  # decode steps inside the table: no rebuild
        cos, _ = rot.cos_sin(torch.tensor([n]), seq_len=n + 1)
    assert rot._cos is table
    rot.cos_sin(torch.tensor([128]), seq_len=129)
    assert rot.capacity == 256
    rot.cos_sin(torch.tensor([5]), seq_len=1000)
    assert rot.capacity == 1024
    # the gathered rows equal a direct computation
    inv, att = rope_frequencies(scaling, head_dim, base, MAX_POS)
    angles = torch.arange(1024).float()[:, None] * inv
    torch.testing.assert_close(rot._cos, torch.cat((angles, angles), -1).cos() * att, rtol=0, atol=1e-6)
    with pytest.raises(InvalidParameterError, match="seq_len"):
        rot.cos_sin(torch.tensor([10]), seq_len=10)


ROUND_TRIP = [
    RopeScaling(),
    RopeScaling(type="linear", factor=2.0),
    RopeScaling(type="ntk", alpha=2.5),
    RopeScaling(type="dynamic", factor=4.0),
    RopeScaling(type="dynamic", factor=4.0, original_max_position_embeddings=4096),
    RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=32768),
    RopeScaling(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0,
                mscale=1.0, mscale_all_dim=0.5, truncate=False),
    RopeScaling(type="yarn", factor=2.0, original_max_position_embeddings=4096, attention_factor=1.1),
    RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192),
]


@pytest.mark.parametrize("scaling", ROUND_TRIP, ids=lambda s: s.type)
def test_from_hf_to_hf_round_trip(scaling: RopeScaling) -> None:
    hf = scaling.to_hf()
    assert (hf is None) == (scaling.type == "default")
    if scaling.type == "dynamic":  # transformers ignores a dynamic dict's original length, so from_hf does
        hf = {k: v for k, v in (hf or {}).items() if k != "original_max_position_embeddings"}
        scaling = RopeScaling(type="dynamic", factor=scaling.factor)
    assert RopeScaling.from_hf({"rope_scaling": hf, "rope_theta": 1e4}) == scaling
    assert RopeScaling.from_hf({"rope_parameters": {**(hf or {}), "rope_theta": 1e4}}) == scaling
    if hf is not None:
        assert RopeScaling.from_hf({"rope_scaling": RopeScaling.from_hf({"rope_scaling": hf}).to_hf()}) == scaling


# raw config.json dicts: from_hf must read them as transformers does
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1 (tf4)": {"rope_theta": 500000.0, "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "llama-3.1 (tf5)": {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8, "low_freq_factor": 1,
        "high_freq_factor": 4, "original_max_position_embeddings": 8192}},
    "legacy type key": {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2}},
    "qwen yarn": {"rope_theta": 1000000.0, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
    "yarn without original": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
    "dynamic with original": {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}},
    "plain": {"rope_theta": 10000.0, "rope_scaling": None},
}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_from_hf_reads_configs_as_transformers(name: str) -> None:
    raw = {"max_position_embeddings": MAX_POS, "hidden_size": 512, "num_attention_heads": 4, **HF_CONFIGS[name]}
    cfg = transformers.LlamaConfig(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()})
    scaling = RopeScaling.from_hf(raw)
    base = cfg.rope_parameters["rope_theta"]
    for seq_len in (None, 3 * MAX_POS):
        ref_inv, ref_att = _hf_frequencies(cfg, seq_len)
        inv, att = rope_frequencies(scaling, 128, base, MAX_POS, seq_len)
        _assert_rel(inv, ref_inv)
        assert att == pytest.approx(ref_att, rel=1e-6)


def test_from_hf_values() -> None:
    s = RopeScaling.from_hf(HF_CONFIGS["llama-3.1 (tf5)"])
    assert s == RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
    assert isinstance(s.factor, float) and isinstance(s.original_max_position_embeddings, int)
    y = RopeScaling.from_hf({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert y.original_max_position_embeddings == 4096
    implied = RopeScaling.from_hf({"max_position_embeddings": 16384, "rope_scaling": {
        "rope_type": "yarn", "original_max_position_embeddings": 4096}})
    assert implied.factor == 4.0  # transformers: max_position_embeddings / original


@pytest.mark.parametrize("rope,needle", [
    ({"rope_type": "longrope", "factor": 2.0}, "longrope"),
    ({"type": "mrope"}, "mrope"),
    ({"rope_type": "su"}, "su"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_from_hf_rejects_unsupported(rope: dict[str, Any], needle: str) -> None:
    with pytest.raises(UnsupportedModelError, match=needle):
        RopeScaling.from_hf({"rope_scaling": rope})


def test_parse_accepts_the_cli_examples() -> None:
    assert RopeScaling.parse("none") == RopeScaling() == RopeScaling.parse(" default ")
    assert RopeScaling.parse("linear:factor=2") == RopeScaling(type="linear", factor=2.0)
    assert RopeScaling.parse("ntk:alpha=2.5") == RopeScaling(type="ntk", alpha=2.5)
    assert RopeScaling.parse("dynamic:factor=4") == RopeScaling(type="dynamic", factor=4.0)
    assert RopeScaling.parse("yarn:factor=4,original_max_position_embeddings=8192") == RopeScaling(
        type="yarn", factor=4.0, original_max_position_embeddings=8192)
    assert RopeScaling.parse(
        "llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192"
    ) == RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
    assert RopeScaling.parse("yarn: factor = 4 , original_max_position_embeddings=512, truncate=false").truncate is False


@pytest.mark.parametrize("spec,needle", [
    ("yarn:factor=abc", "factor"),
    ("yarn:factor=abc,original_max_position_embeddings=8192", "factor"),
    ("bogus", "bogus"),
    ("bogus:factor=2", "bogus"),
    ("linear:factor=0.5", "factor"),
    ("linear:factor=nan", "factor"),
    ("linear:speed=2", "speed"),
    ("linear:factor", "factor"),
    ("linear:factor=2,factor=3", "factor"),
    ("ntk:factor=2", "factor"),
    ("ntk:alpha=0", "alpha"),
    ("none:factor=2", "factor"),
    ("yarn:factor=2", "original_max_position_embeddings"),
    ("yarn:factor=2,original_max_position_embeddings=8192.5", "original_max_position_embeddings"),
    ("yarn:factor=2,original_max_position_embeddings=0", "original_max_position_embeddings"),
    ("yarn:factor=2,original_max_position_embeddings=64,truncate=maybe", "truncate"),
    ("yarn:factor=2,original_max_position_embeddings=64,attention_factor=-1", "attention_factor"),
    ("llama3:factor=8,low_freq_factor=4,high_freq_factor=1,original_max_position_embeddings=8192",
     "high_freq_factor"),
    ("", "type"),
])
def test_parse_rejects_bad_specs(spec: str, needle: str) -> None:
    with pytest.raises(InvalidParameterError, match=needle):
        RopeScaling.parse(spec)


def test_constructor_validates() -> None:
    with pytest.raises(InvalidParameterError, match="type"):
        RopeScaling(type="longrope")
    with pytest.raises(InvalidParameterError, match="alpha"):
        RopeScaling(type="linear", factor=2.0, alpha=2.0)  # alpha would be silently ignored
    with pytest.raises(InvalidParameterError, match="factor"):
        RopeScaling(type="dynamic", factor="2")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="head_dim"):
        rope_frequencies(RopeScaling(), 63, 1e4, MAX_POS)
