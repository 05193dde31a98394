"""One decoder layer of a float checkpoint over the calibration tokens: reading its weights
(fused qkv and gate_up, fp32) one tensor at a time, and running it true-sequentially so that a
callback sees each matrix's Hessian before the matrix is used."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from halfbyte.errors import CorruptFileError
from halfbyte.io.safetensors_files import safetensors_files
from halfbyte.kernels.activation import silu_and_mul
from halfbyte.kernels.attention import AttentionMetadata
from halfbyte.kernels.rms_norm import rms_norm
from halfbyte.model.config import ModelConfig
from halfbyte.model.llama import Attention
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.quant.gptq import CrossAccumulator, HessianAccumulator

UNITS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
_PAGE = 16
_ROWS = 4096  # tokens per chunk of the big per-token matmuls (bounds [rows, 2 * intermediate])


def _unit_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    return {
        UNITS[0]: (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
        UNITS[1]: (cfg.hidden_size, cfg.q_size),
        UNITS[2]: (2 * cfg.intermediate_size, cfg.hidden_size),
        UNITS[3]: (cfg.hidden_size, cfg.intermediate_size),
    }



# --- checkpoint access ------------------------------------------------------------------------


class WeightSource(Protocol):
    """Where a conversion reads the float model's tensors: a checkpoint (TensorSource) or a view
    of one (rotation.RotatedSource)."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...

    def get_optional(self, name: str) -> torch.Tensor | None: ...


class TensorSource:
    """Single tensors of a (sharded) safetensors checkpoint. Every read opens and closes its
    file: no mapping of the whole checkpoint stays resident while layers are processed."""

    def __init__(self, model_dir: Path) -> None:
        self.where: dict[str, Path] = {}
        for path in safetensors_files(model_dir):
            with self._open(path) as f:
                for name in f.keys():
                    self.where[name] = path

    @staticmethod
    def _open(path: Path) -> Any:
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CorruptFileError(f"{path} is truncated or corrupt ({str(e).splitlines()[0]})") from None

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CorruptFileError(f"checkpoint lacks tensor {name!r}")
        try:
            with self._open(self.where[name]) as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CorruptFileError(f"{self.where[name]} is truncated or corrupt ({str(e).splitlines()[0]})") from None

    def get_optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None


@dataclass
class LayerWeights:
    """One decoder layer: fused fp32 matrices and biases, norms in the checkpoint's dtype."""

    matrices: dict[str, torch.Tensor]  # unit -> [N, K] fp32
    biases: dict[str, torch.Tensor | None]
    input_norm: torch.Tensor
    post_norm: torch.Tensor


def read_layer(src: WeightSource, i: int) -> LayerWeights:
    base = f"model.layers.{i}"
    matrices: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor | None] = {}
    for unit, parts in _PARTS.items():
        matrices[unit] = torch.cat([src.get(f"{base}.{p}.weight").float() for p in parts])
        bs = [b for p in parts if (b := src.get_optional(f"{base}.{p}.bias")) is not None]
        biases[unit] = torch.cat(bs) if len(bs) == len(parts) else None
    return LayerWeights(
        matrices, biases, src.get(f"{base}.input_layernorm.weight"), src.get(f"{base}.post_attention_layernorm.weight")
    )


# --- one decoder layer over the calibration tokens ---------------------------------------------


def _hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[1])
    for chunk in x.split(_ROWS):
        acc.add_batch(chunk)
    return acc.hessian


def _cross(x_float: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    acc = CrossAccumulator(x.shape[1])
    for cf, c in zip(x_float.split(_ROWS), x.split(_ROWS), strict=True):
        acc.add_batch(cf, c)
    return acc.cross


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b.float() if b is not None else None)


def _attention_batches(lengths: list[int], max_tokens: int) -> Iterator[tuple[int, int, list[int]]]:
    """(first row, end row, sequence lengths) of consecutive sequences up to max_tokens."""
    start, row = 0, 0
    group: list[int] = []
    for n in lengths:
        if group and sum(group) + n > max_tokens:
            yield start, row, group
            start, group = row, []
        group.append(n)
        row += n
    if group:
        yield start, row, group


Process = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
# (unit, H of the quantized model's input X, D = 2 (X_f - X)^T X / n, float W) -> the weight used
PairProcess = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_core(
    cfg: ModelConfig,
    lw: LayerWeights,
    x1: torch.Tensor,  # [T, hidden] normed input of the attention block
    lengths: list[int],
    rotary: RotaryEmbedding,
    w_qkv: torch.Tensor,
) -> torch.Tensor:
    """o_proj's input [T, q_size]: causal attention of every calibration sequence with the
    fused qkv weight w_qkv (float or dequantized)."""
    attn = Attention(cfg, torch.float32, torch.device("cpu"))
    attn.qkv_proj.weight = nn.Parameter(w_qkv, False)
    qkv_bias = lw.biases[UNITS[0]]
    attn.qkv_proj.bias = nn.Parameter(qkv_bias.float(), False) if qkv_bias is not None else None
    attn.o_proj = nn.Identity()  # type: ignore[assignment]  # we want o_proj's input
    o_in = torch.empty(x1.shape[0], cfg.q_size)  # [T, q_size]
    with torch.no_grad():
        for r0, r1, seqs in _attention_batches(lengths, _ROWS):
            pages = [-(-n // _PAGE) for n in seqs]
            shape = (sum(pages), _PAGE, cfg.num_kv_heads, cfg.head_dim)
            kv = (torch.zeros(shape), torch.zeros(shape))
            tables = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
            slots, positions, p0 = [], [], 0
            for b, (n, np_) in enumerate(zip(seqs, pages, strict=True)):
                tables[b, :np_] = torch.arange(p0, p0 + np_, dtype=torch.int32)
                slots.append(torch.arange(n) + p0 * _PAGE)
                positions.append(torch.arange(n))
                p0 += np_
            pos = torch.cat(positions)
            starts = [0]
            for n in seqs:
                starts.append(starts[-1] + n)
            meta = AttentionMetadata(query_start=starts, seq_lens=list(seqs), block_tables=tables, slot_mapping=torch.cat(slots))
            cos, sin = rotary.cos_sin(pos, seq_len=max(seqs))
            o_in[r0:r1] = attn(x1[r0:r1], cos, sin, kv, meta)
    return o_in


def mlp_act(lw: LayerWeights, x2: torch.Tensor, w_gu: torch.Tensor) -> torch.Tensor:
    """down_proj's input [T, intermediate]: silu(gate) * up of the normed MLP input x2."""
    return torch.cat([silu_and_mul(_linear(c, w_gu, lw.biases[UNITS[2]])) for c in x2.split(_ROWS)])


def run_layer(
    cfg: ModelConfig,
    lw: LayerWeights,
    stream: torch.Tensor,  # [T, hidden] fp32 residual stream entering the layer
    lengths: list[int],
    rotary: RotaryEmbedding,
    process: Process,
) -> torch.Tensor:
    """The layer on every calibration token, true-sequential: before each matrix is used,
    process(unit, H, W) sees its Hessian and returns the weight to compute with (the float one
    when measuring, the dequantized one when quantizing). Returns the stream after the layer."""
    eps = cfg.rms_norm_eps
    x1 = rms_norm(stream, lw.input_norm.float(), eps)
    w_qkv = process(UNITS[0], _hessian(x1), lw.matrices[UNITS[0]])
    o_in = attention_core(cfg, lw, x1, lengths, rotary, w_qkv)
    del x1
    w_o = process(UNITS[1], _hessian(o_in), lw.matrices[UNITS[1]])
    h2 = stream + _linear(o_in, w_o, lw.biases[UNITS[1]])
    del o_in
    x2 = rms_norm(h2, lw.post_norm.float(), eps)
    w_gu = process(UNITS[2], _hessian(x2), lw.matrices[UNITS[2]])
    act = mlp_act(lw, x2, w_gu)  # [T, inter]
    del x2
    w_d = process(UNITS[3], _hessian(act), lw.matrices[UNITS[3]])
    return h2 + _linear(act, w_d, lw.biases[UNITS[3]])


def run_layer_pair(
    cfg: ModelConfig,
    lw: LayerWeights,
    stream: torch.Tensor,  # [T, hidden] the quantized model's residual stream entering the layer
    float_stream: torch.Tensor,  # [T, hidden] the float model's
    lengths: list[int],
    rotary: RotaryEmbedding,
    process: PairProcess,
) -> tuple[torch.Tensor, torch.Tensor]:
    """run_layer for the quantized model with the float model's layer beside it: process also
    sees how the float model's input to each matrix differs from the quantized model's
    (gptq.asymmetric_target). Returns both streams after the layer."""
    eps = cfg.rms_norm_eps
    w = lw.matrices
    x1, x1f = rms_norm(stream, lw.input_norm.float(), eps), rms_norm(float_stream, lw.input_norm.float(), eps)
    w_qkv = process(UNITS[0], _hessian(x1), _cross(x1f, x1), w[UNITS[0]])
    o_in = attention_core(cfg, lw, x1, lengths, rotary, w_qkv)
    o_in_f = attention_core(cfg, lw, x1f, lengths, rotary, w[UNITS[0]])
    del x1, x1f
    w_o = process(UNITS[1], _hessian(o_in), _cross(o_in_f, o_in), w[UNITS[1]])
    h2 = stream + _linear(o_in, w_o, lw.biases[UNITS[1]])
    h2f = float_stream + _linear(o_in_f, w[UNITS[1]], lw.biases[UNITS[1]])
    del o_in, o_in_f
    x2, x2f = rms_norm(h2, lw.post_norm.float(), eps), rms_norm(h2f, lw.post_norm.float(), eps)
    w_gu = process(UNITS[2], _hessian(x2), _cross(x2f, x2), w[UNITS[2]])
    act, act_f = mlp_act(lw, x2, w_gu), mlp_act(lw, x2f, w[UNITS[2]])
    del x2, x2f
    w_d = process(UNITS[3], _hessian(act), _cross(act_f, act), w[UNITS[3]])
    return h2 + _linear(act, w_d, lw.biases[UNITS[3]]), h2f + _linear(act_f, w[UNITS[3]], lw.biases[UNITS[3]])
