"""Loading one rank's shard straight from safetensors: every tensor is read through
safe_open's slices, so a rank reads its rows / columns only and never holds the full model."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from halfbyte.distributed.collectives import Collectives
from halfbyte.distributed.plan import RankPlan, RowSplit, TensorParallelPlan
from halfbyte.errors import CorruptFileError
from halfbyte.io.model_dir import read_json
from halfbyte.io.safetensors_files import safetensors_files
from halfbyte.model.config import ModelConfig
from halfbyte.model.parallel_linear import RowParallelQuantLinear
from halfbyte.model.parallel_llama import ParallelLlamaModel
from halfbyte.model.quant_linear import QuantLinear
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.model.weights import load_hf_weights
from halfbyte.quant.packing import BLOCK_K
from halfbyte.quant.qtensor import QuantSlice, QuantWeight
from halfbyte.quant.scale_codes import ScaleCodes
from halfbyte.quant.table_codes import TableCodes, unpack_indices

Range = tuple[int, int]
_LAYER = re.compile(r"^model\.layers\.\d+\.(.+?)\.(weight|bias)$")


class ShardReader:
    """Named tensors of a checkpoint, read by row / column ranges."""

    def __init__(self, model_dir: Path, stack: contextlib.ExitStack) -> None:
        self.where: dict[str, Any] = {}
        for path in safetensors_files(model_dir):
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():
                self.where[name] = f

    def names(self) -> list[str]:
        return list(self.where)

    def rows(self, name: str, ranges: list[Range] | None = None) -> torch.Tensor:
        if name not in self.where:
            raise CorruptFileError(f"checkpoint lacks tensor {name!r}")
        f = self.where[name]
        if ranges is None:
            whole: torch.Tensor = f.get_tensor(name)
            return whole
        part = f.get_slice(name)
        return torch.cat([part[a:b] for a, b in ranges])

    def cols(self, name: str, ranges: list[Range]) -> torch.Tensor:
        part = self.where[name].get_slice(name)
        return torch.cat([part[:, a:b] for a, b in ranges], dim=1)


def _ranges(cfg: ModelConfig, rp: RankPlan) -> dict[str, list[Range]]:
    """Output ranges (rows of a dense weight) of each column-parallel matrix on this rank."""
    d = cfg.head_dim
    (h0, h1), (k0, k1) = rp.heads, rp.kv_heads
    i0, i1 = rp.intermediate
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "self_attn.q_proj": [(h0 * d, h1 * d)],
        "self_attn.k_proj": [(k0 * d, k1 * d)],
        "self_attn.v_proj": [(k0 * d, k1 * d)],
        "self_attn.qkv_proj": [(h0 * d, h1 * d), (q + k0 * d, q + k1 * d), (q + kv + k0 * d, q + kv + k1 * d)],
        "mlp.gate_proj": [(i0, i1)],
        "mlp.up_proj": [(i0, i1)],
        "mlp.gate_up_proj": [(i0, i1), (inter + i0, inter + i1)],
        "o_in": [(h0 * d, h1 * d)],  # o_proj's input columns
        "down_in": [(i0, i1)],
    }


def _dense_stream(
    reader: ShardReader, cfg: ModelConfig, rp: RankPlan, skip: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    ranges = _ranges(cfg, rp)
    vocab = [rp.vocab]
    for name in reader.names():
        if any(name.startswith(p + ".") for p in skip):
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            yield name, reader.rows(name, vocab)
            continue
        m = _LAYER.match(name)
        module, kind = (m.group(1), m.group(2)) if m else ("", "")
        if module in ranges:
            yield name, reader.rows(name, ranges[module])
        elif module == "self_attn.o_proj" and kind == "weight":
            yield name, reader.cols(name, ranges["o_in"])
        elif module == "mlp.down_proj" and kind == "weight":
            yield name, reader.cols(name, ranges["down_in"])
        else:
            yield name, reader.rows(name)


def _codes(reader: ShardReader, prefix: str, i: int, s: dict[str, Any], out: list[Range] | None) -> ScaleCodes | None:
    """A coded slice's per-column steps: the rank's output columns (`out`) or all of them."""
    if not s.get("scale_codes"):
        return None
    names = (f"{prefix}.scale_step.{i}", f"{prefix}.min_step.{i}")
    return ScaleCodes(*(reader.rows(n, out) if out is not None else reader.rows(n) for n in names))


def _table_values(reader: ShardReader, prefix: str, i: int, s: dict[str, Any], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A table-coded slice's decoded fp16 scales and mins [G, N], all columns (the packed indices
    are one bitstream; they are small beside the weights)."""
    where = f"{prefix} slice {i}"
    groups = -(-(s["k_end"] - s["k_start"]) // s["group_size"])
    si, mi = unpack_indices(reader.rows(f"{prefix}.codes.{i}"), groups, n, s["scale_bits"], s["min_bits"], where)
    codes = TableCodes(s["scale_bits"], s["min_bits"], reader.rows(f"{prefix}.scale_base.{i}"),
                       reader.rows(f"{prefix}.scale_table.{i}"), reader.rows(f"{prefix}.min_table.{i}"), si, mi)
    codes.validate(groups, n, where)
    return codes.decode()


def _column_quant(reader: ShardReader, prefix: str, meta: dict[str, Any], out: list[Range]) -> QuantWeight:
    slices = []
    for i, s in enumerate(meta["slices"]):
        if s.get("scale_codes") == "table":  # decoded whole, then this rank's columns as fp16
            scales, mins = _table_values(reader, prefix, i, s, meta["out_features"])
            cols = torch.cat([torch.arange(a, b) for a, b in out])
            slices.append(QuantSlice.from_stored(
                s["k_start"], s["k_end"], s["bits"], s["group_size"], reader.cols(f"{prefix}.qweight.{i}", out),
                scales[:, cols].contiguous(), mins[:, cols].contiguous(), None, prefix,
            ))
            continue
        codes = _codes(reader, prefix, i, s, out)
        slices.append(QuantSlice.from_stored(
            s["k_start"], s["k_end"], s["bits"], s["group_size"],
            reader.cols(f"{prefix}.qweight.{i}", out),
            reader.cols(f"{prefix}.scales.{i}", out),
            reader.cols(f"{prefix}.mins.{i}", out), codes, prefix,
        ))
    perm = reader.rows(f"{prefix}.perm") if meta.get("act_order") else None
    return QuantWeight(sum(b - a for a, b in out), meta["in_features"], slices, perm)


def _row_quant(reader: ShardReader, prefix: str, meta: dict[str, Any], k_range: Range) -> QuantWeight | None:
    """The stored-order K range k_range of the weight, without permutation (cut on group boundaries)."""
    k0, k1 = k_range
    slices = []
    for i, s in enumerate(meta["slices"]):
        a, b = max(k0, s["k_start"]), min(k1, s["k_end"])
        if a >= b:
            continue
        bits, gs, base = s["bits"], s["group_size"], s["k_start"]
        words = [((a - base) // BLOCK_K * bits, (b - base) // BLOCK_K * bits)]
        groups = [((a - base) // gs, -(-(b - base) // gs))]
        if s.get("scale_codes") == "table":
            scales, mins = _table_values(reader, prefix, i, s, meta["out_features"])
            g0, g1 = groups[0]
            slices.append(QuantSlice.from_stored(
                a - k0, b - k0, bits, gs, reader.rows(f"{prefix}.qweight.{i}", words),
                scales[g0:g1].contiguous(), mins[g0:g1].contiguous(), None, prefix,
            ))
            continue
        slices.append(QuantSlice.from_stored(
            a - k0, b - k0, bits, gs,
            reader.rows(f"{prefix}.qweight.{i}", words),
            reader.rows(f"{prefix}.scales.{i}", groups),
            reader.rows(f"{prefix}.mins.{i}", groups), _codes(reader, prefix, i, s, None), prefix,
        ))
    if not slices:
        return None
    return QuantWeight(meta["out_features"], k1 - k0, slices, None)


def _quant_module(
    reader: ShardReader, cfg: ModelConfig, plan: TensorParallelPlan, rank: int, prefix: str, meta: dict[str, Any],
    dtype: torch.dtype, device: torch.device, comm: Collectives,
) -> nn.Module:
    rp = plan[rank]
    unit = prefix.split(".", 3)[-1] if prefix.startswith("model.layers.") else prefix
    bias_name = f"{prefix}.bias"
    has_bias = bias_name in reader.where
    if unit in ("self_attn.o_proj", "mlp.down_proj"):
        split: RowSplit = rp.row_splits[prefix]
        w = _row_quant(reader, prefix, meta, split.k_range)
        inner = QuantLinear(w.to(device), None, dtype) if w is not None else None
        if unit == "self_attn.o_proj":
            widths = [(h1 - h0) * cfg.head_dim for h0, h1 in plan.head_ranges]
        else:
            widths = [b - a for a, b in plan.intermediate_ranges]
        perm = reader.rows(f"{prefix}.perm").to(device) if meta.get("act_order") else None
        bias = reader.rows(bias_name).to(device) if has_bias else None
        return RowParallelQuantLinear(inner, meta["out_features"], bias, split, widths, perm, comm, dtype)
    found = [rp.vocab] if unit == "lm_head" else _ranges(cfg, rp).get(unit)
    if found is None:
        raise CorruptFileError(f"quantized layer {prefix!r} cannot be split for tensor parallelism")
    out = found
    w = _column_quant(reader, prefix, meta, out).to(device)
    bias = reader.rows(bias_name, out).to(device) if has_bias else None
    return QuantLinear(w, bias, dtype)


def load_shard(
    model_dir: Path, cfg: ModelConfig, plan: TensorParallelPlan, rank: int, dtype: torch.dtype,
    device: torch.device, comm: Collectives,
) -> ParallelLlamaModel:
    """Rank `rank`'s ParallelLlamaModel, its weights read from model_dir's safetensors."""
    quantization = read_json(model_dir / "config.json").get("quantization")
    layers: dict[str, Any] = quantization["layers"] if quantization else {}
    with contextlib.ExitStack() as stack:
        reader = ShardReader(model_dir, stack)
        if not layers:
            model = ParallelLlamaModel(cfg, plan, rank, dtype, device, comm)
            load_hf_weights(model, _dense_stream(reader, cfg, plan[rank], []))
        else:
            model = ParallelLlamaModel(cfg, plan, rank, dtype, torch.device("meta"), comm)
            for prefix, meta in layers.items():
                module = _quant_module(reader, cfg, plan, rank, prefix, meta, dtype, device, comm)
                model.set_submodule(prefix.removeprefix("model."), module)
            for mod in model.modules():  # allocate what is still on the meta device
                for pname, p in list(mod._parameters.items()):
                    if p is not None and p.device.type == "meta":
                        mod._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), False)
            model.device = device
            model.rotary = RotaryEmbedding(
                cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device, torch.float32
            )
            load_hf_weights(model, _dense_stream(reader, cfg, plan[rank], list(layers)))
    model.prepare_for_inference()
    return model.eval()


def shard_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of a (shard of a) model."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
