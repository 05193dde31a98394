"""Mapping Hugging Face tensor names onto LlamaModel's (fused) parameters."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from halfbyte.errors import CorruptFileError, UnsupportedModelError
from halfbyte.model.llama import LlamaModel

# checkpoint matrix -> (our fused parameter, index of its shard along out_features)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _shard_sizes(model: LlamaModel, fused: str) -> list[int]:
    cfg = model.cfg
    if fused.endswith("qkv_proj"):
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [cfg.intermediate_size, cfg.intermediate_size]


def _target(model: LlamaModel, params: dict[str, torch.nn.Parameter], name: str) -> tuple[str, torch.Tensor]:
    """(our parameter name, the slice of it this checkpoint tensor fills)."""
    m = _LAYER.match(name)
    if m:
        layer, rest = m.group(1), m.group(2)
        rest = rest.removesuffix(".weight") if rest.endswith("layernorm.weight") else rest
        module, _, kind = rest.rpartition(".")
        if module in _FUSED:
            fused, shard = _FUSED[module]
            ours = f"layers.{layer}.{fused}.{kind}"
            if ours not in params:
                raise UnsupportedModelError(f"unexpected tensor {name!r} for this config")
            sizes = _shard_sizes(model, fused)
            start = sum(sizes[:shard])
            return ours, params[ours].data[start : start + sizes[shard]]
        ours = f"layers.{layer}.{rest}"
    elif name == "model.embed_tokens.weight":
        ours = "embed_tokens"
    elif name == "model.norm.weight":
        ours = "norm"
    elif name == "lm_head.weight":
        ours = "lm_head.weight"
    else:
        ours = name
    if ours not in params:
        raise UnsupportedModelError(f"unexpected tensor {name!r} for this config")
    return ours, params[ours].data


def load_hf_weights(model: LlamaModel, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every checkpoint tensor into place; every parameter must be filled exactly once."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for name, tensor in tensors:
        if _IGNORED.search(name):
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the checkpoint may carry a copy of the embedding
        ours, dest = _target(model, params, name)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise CorruptFileError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        filled[ours] = filled.get(ours, 0) + tensor.numel()
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CorruptFileError(f"checkpoint lacks weights for {shown}")
