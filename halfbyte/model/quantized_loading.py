"""Building a LlamaModel whose linear layers are stored quantized (config.json `quantization`).

The network is first built on the meta device (no memory), the quantized layers are swapped in
as QuantLinear, and only the remaining dense parameters (embeddings, norms, an unquantized head)
are allocated before loading: a 70B model never exists in dense form."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from halfbyte.errors import CorruptFileError
from halfbyte.model.config import ModelConfig
from halfbyte.model.llama import LlamaModel
from halfbyte.model.quant_linear import QuantLinear
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.model.weights import load_hf_weights
from halfbyte.quant.qtensor import QuantWeight


def module_name(prefix: str) -> str:
    """Checkpoint prefix -> LlamaModel submodule name ("model.layers.0.mlp.down_proj" -> "layers.0.mlp.down_proj")."""
    return prefix.removeprefix("model.")


def load_quantized_model(
    cfg: ModelConfig,
    quantization: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> LlamaModel:
    layers = quantization.get("layers")
    if quantization.get("quant_method") != "halfbyte" or not isinstance(layers, dict):
        raise CorruptFileError("config.json 'quantization' is not a halfbyte section with a 'layers' map")
    meta_device = torch.device("meta")
    model = LlamaModel(cfg, dtype, meta_device)
    known = dict(model.named_modules())
    for prefix in layers:
        if module_name(prefix) not in known:
            raise CorruptFileError(f"quantized layer {prefix!r} does not exist in this architecture")

    # split the stream: quantized layers' tensors are grouped per layer, the rest load densely
    grouped: dict[str, dict[str, torch.Tensor]] = {p: {} for p in layers}
    dense: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors:
        owner = next((p for p in layers if name.startswith(p + ".")), None)
        if owner is None:
            dense.append((name, tensor))
        else:
            grouped[owner][name] = tensor

    for prefix, meta in layers.items():
        weight = QuantWeight.from_state_dict(prefix, grouped[prefix], meta).to(device)
        bias = grouped[prefix].get(f"{prefix}.bias")
        model.set_submodule(module_name(prefix), QuantLinear(weight, bias.to(device) if bias is not None else None, dtype))

    # allocate what is still on the meta device, then fill it from the dense tensors
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                mod._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), False)
    model.device = device
    model.rotary = RotaryEmbedding(
        cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device, torch.float32
    )
    load_hf_weights(model, dense)
    model.prepare_for_inference()
    return model.eval()
