"""Random-weight models of named shapes, built directly on the device (no download, nothing
large in the tree). Random weights are fine for speed; correctness is checked on real shapes."""

from __future__ import annotations

import torch
from torch import nn

from halfbyte.model.config import ModelConfig
from halfbyte.model.llama import LlamaModel
from halfbyte.model.quant_linear import QuantLinear
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.quant.packing import packed_rows
from halfbyte.quant.qtensor import QuantSlice, QuantWeight

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0),
}


def shape_config(name: str, max_position_embeddings: int = 8192) -> ModelConfig:
    return ModelConfig(architecture="llama", rms_norm_eps=1e-5, max_position_embeddings=max_position_embeddings,
                       **SHAPES[name])  # type: ignore[arg-type]


def random_quant_weight(n: int, k: int, bits: int, group: int, device: torch.device) -> QuantWeight:
    qweight = torch.randint(-(2**31), 2**31 - 1, (packed_rows(k, bits), n), dtype=torch.int32, device=device)
    groups = -(-k // group)
    # scales ~ what RTN gives a unit-variance weight of this fan-in, so activations stay sane
    scale = 4.0 / (2**bits) / k**0.5
    scales = torch.full((groups, n), scale, dtype=torch.float16, device=device)
    mins = torch.full((groups, n), -scale * (2**bits - 1) / 2, dtype=torch.float16, device=device)
    return QuantWeight(n, k, [QuantSlice(0, k, bits, group, qweight, scales, mins)])


def random_model(name: str, bits: int, group: int, dtype: torch.dtype, device: torch.device,
                 max_position_embeddings: int = 8192, head_bits: int | None = None) -> LlamaModel:
    """A quantized model of the named shape with random weights; LM head dense in `dtype`, or
    quantized to head_bits (untied, as the converter's --head-bits writes it)."""
    cfg = shape_config(name, max_position_embeddings)
    model = LlamaModel(cfg, dtype, torch.device("meta"))
    for i, layer in enumerate(model.layers):
        for path, (n, k) in {
            "self_attn.qkv_proj": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
            "self_attn.o_proj": (cfg.hidden_size, cfg.q_size),
            "mlp.gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
            "mlp.down_proj": (cfg.hidden_size, cfg.intermediate_size),
        }.items():
            layer.set_submodule(path, QuantLinear(random_quant_weight(n, k, bits, group, device), None, dtype))
    if head_bits is not None:
        model.lm_head = QuantLinear(random_quant_weight(cfg.vocab_size, cfg.hidden_size, head_bits, group, device),
                                    None, dtype)
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                t = torch.randn(p.shape, dtype=dtype, device=device) * (0.02 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0)
                mod._parameters[pname] = nn.Parameter(t, False)
    model.device = device
    model.rotary = RotaryEmbedding(cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                                   device, torch.float32)
    model.prepare_for_inference()
    return model.eval()
