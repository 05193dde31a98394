"""ModelConfig: the network's shape, read once from a Hugging Face config.json and validated."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from halfbyte.errors import UnsupportedModelError
from halfbyte.model.rope import RopeScaling

# Architectures that are all "llama with knobs": the knobs are the fields below.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # qwen2 / llama attention_bias
    o_bias: bool = False  # llama attention_bias also biases o_proj; qwen2 does not
    mlp_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_rope_scaling(self, scaling: RopeScaling) -> ModelConfig:
        return replace(self, rope_scaling=scaling)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:  # some exporters write only model_type
            by_type = {family: a for a, family in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(cfg.get("model_type", ""))
        if arch is None:
            name = archs[0] if archs else cfg.get("model_type", "<none>")
            raise UnsupportedModelError(
                f"unsupported architecture {name!r}; halfbyte runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in cfg:
                raise UnsupportedModelError(f"config.json lacks {key!r}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = family == "qwen2" or attention_bias
        o_bias = family != "qwen2" and attention_bias
        sliding = cfg.get("sliding_window")
        if family == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_params = cfg.get("rope_parameters") or {}
        theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        return cls(
            architecture=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            rope_scaling=RopeScaling.from_hf(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
