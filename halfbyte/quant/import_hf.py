"""Hugging Face GPTQ / AWQ model directories -> halfbyte quantized model directories.

Quantized layers are found by their `.qweight` tensors; GPTQ layers read with
import_gptq.gptq_to_quant_weight, AWQ (GEMM) layers with import_awq.awq_to_quant_weight; q/k/v
and gate/up are fused as import_checkpoint describes. Every other tensor is copied as stored, and
small non-weight files (tokenizer, generation config, chat templates) are copied along."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from halfbyte.errors import CorruptFileError, HalfbyteError, ModelNotFoundError, QuantizationError, UnsupportedModelError
from halfbyte.quant.import_awq import awq_min_rounding, awq_to_quant_weight
from halfbyte.quant.import_checkpoint import (
    FOREIGN_METHODS, IMPORTER_VERSION, ImportReport, LayerReport, ShardWriter, bits_per_weight, emit_layer,
    finish_config, plan_layers, progress, quantization_config, read_json, write_atomically,
)
from halfbyte.quant.import_gptq import gptq_to_quant_weight, max_min_rounding
from halfbyte.quant.qtensor import QuantWeight

_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
_SKIP_FILES = {"config.json", "model.safetensors.index.json", "quantize_config.json", "quant_config.json"}


def _int_field(qc: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        if key in qc:
            v = qc[key]
            if not isinstance(v, int) or isinstance(v, bool):
                raise QuantizationError(f"quantization_config.{key} must be an integer, got {v!r}")
            return v
    if default is None:
        raise QuantizationError(f"quantization_config lacks {keys[0]!r}")
    return default


class _TensorSource:
    """Random access to the tensors of a (sharded) safetensors directory, with clear errors."""

    def __init__(self, model_dir: Path) -> None:
        from halfbyte.io.safetensors_files import safetensors_files

        self.where: dict[str, Path] = {}
        for path in safetensors_files(model_dir):
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        self.where[name] = path
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise CorruptFileError(f"{path} is truncated or corrupt ({_first_line(e)})") from None

    def get(self, name: str) -> torch.Tensor:
        path = self.where.get(name)
        if path is None:
            raise CorruptFileError(f"checkpoint lacks tensor {name!r}")
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise CorruptFileError(f"{path} is truncated or corrupt ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _hf_layer_reader(qc: dict[str, Any], src: _TensorSource) -> tuple[str, Any]:
    """(description, prefix -> (QuantWeight, LayerReport)) for a GPTQ or AWQ config."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in FOREIGN_METHODS:
        raise UnsupportedModelError(
            f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported; halfbyte imports {', '.join(FOREIGN_METHODS)}"
        )
    bits = _int_field(qc, "bits", "w_bit")
    group = _int_field(qc, "group_size", "q_group_size", default=-1)
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        if qc.get("dynamic"):
            raise UnsupportedModelError("GPTQ 'dynamic' per-module bits/group sizes are not supported")
        offset = 1 if fmt == "gptq" else 0

        def read(prefix: str) -> tuple[QuantWeight, LayerReport]:
            g_idx = src.get(f"{prefix}.g_idx") if f"{prefix}.g_idx" in src.where else None
            qzeros, scales = src.get(f"{prefix}.qzeros"), src.get(f"{prefix}.scales")
            qw = gptq_to_quant_weight(src.get(f"{prefix}.qweight"), qzeros, scales, g_idx, bits, group, offset, prefix)
            err = max_min_rounding(qzeros, scales, bits, offset)
            return qw, _zero_point_report(prefix, f"gptq {bits}-bit g{group}" + (" act-order" if qw.perm is not None else ""), err)

        return f"GPTQ {bits}-bit g{group} ({fmt})", read
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModelError(f"AWQ version {qc.get('version')!r} is not supported (only the GEMM layout)")

    def read_awq(prefix: str) -> tuple[QuantWeight, LayerReport]:
        qzeros, scales = src.get(f"{prefix}.qzeros"), src.get(f"{prefix}.scales")
        qw = awq_to_quant_weight(src.get(f"{prefix}.qweight"), qzeros, scales, group, bits, prefix)
        return qw, _zero_point_report(prefix, f"awq {bits}-bit g{group}", awq_min_rounding(qzeros, scales))

    return f"AWQ {bits}-bit g{group} (GEMM)", read_awq


def _zero_point_report(prefix: str, source: str, err: float) -> LayerReport:
    """The min-form rounding |fp16(-z s) + z s|: the only difference from (q - z) * s besides one
    fp32 rounding of q s + min."""
    return LayerReport(prefix, source, err == 0.0, err, "" if err == 0.0 else "mins = fp16(-z*s) rounded")


def import_hf_quantized(
    src: Path, out: Path, *, overwrite: bool = False, unfusable: str = "dense", show_progress: bool = False
) -> ImportReport:
    """A Hugging Face GPTQ/AWQ model directory -> a halfbyte quantized model directory."""
    src, out = Path(src), Path(out)
    if unfusable not in ("dense", "separate", "error"):
        raise HalfbyteError(f"unfusable must be 'dense', 'separate' or 'error', not {unfusable!r}")
    if not (src / "config.json").is_file():
        raise ModelNotFoundError(f"{src} has no config.json; is it a model directory?")
    cfg = read_json(src / "config.json")
    qc = quantization_config(src)
    if qc is None:
        raise QuantizationError(f"{src} has no quantization_config: not a GPTQ/AWQ checkpoint")
    tensors = _TensorSource(src)
    description, read = _hf_layer_reader(qc, tensors)
    report = ImportReport(description, out)
    prefixes = [n.removesuffix(".qweight") for n in tensors.where if n.endswith(".qweight")]
    if not prefixes:
        raise CorruptFileError(f"{src}: no '.qweight' tensors although quantization_config says {qc.get('quant_method')}")
    quant_names = {f"{p}.{s}" for p in prefixes for s in ("qweight", "qzeros", "scales", "g_idx", "bias")}
    plan = plan_layers(prefixes)

    def fill(tmp: Path) -> None:
        writer, layers, written = ShardWriter(tmp), {}, []  # type: ignore[var-annotated]
        for fused_prefix, members in progress(plan, f"importing {src.name}", show_progress):
            parts = []
            for p in members:
                qw, rep = read(p)
                report.layers.append(rep)
                written.append(qw)
                bias = tensors.get(f"{p}.bias") if f"{p}.bias" in tensors.where else None
                parts.append((p, qw, bias))
            emit_layer(writer, layers, report, fused_prefix, parts, unfusable)
        for name in tensors.where:
            if name not in quant_names:
                writer.add(name, tensors.get(name))
        writer.close()
        report.bits_per_weight = bits_per_weight(iter(written))
        source = {"format": str(qc.get("quant_method")), "importer_version": IMPORTER_VERSION, "path": str(src)}
        (tmp / "config.json").write_text(json.dumps(finish_config(cfg, layers, report.bits_per_weight, source), indent=2))
        _copy_aux_files(src, tmp)

    write_atomically(out, overwrite, fill)
    return report


def _copy_aux_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat templates: every small non-weight file."""
    for f in src.iterdir():
        if f.is_file() and f.name not in _SKIP_FILES and not f.name.endswith(_WEIGHT_FILES):
            shutil.copy2(f, dst / f.name)

