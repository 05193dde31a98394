"""Quantized checkpoints from elsewhere -> a halfbyte quantized model directory, never through
float weights (except where a layer cannot be stored quantized; the report says so).

Sources: a Hugging Face GPTQ or AWQ model directory (config.json `quantization_config`, or the
older quantize_config.json / quant_config.json) and llama GGUF files. The output is the layout
of docs/format.md that `halfbyte.model.loader.load_model` reads: q/k/v fused into
`self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj` with `concat_out`, every other tensor
dense under its Hugging Face name, written atomically (temporary directory, then rename).

Fusing needs one bits/group size/act-order permutation for the parts. Bits and group sizes are
unified exactly (q widened to the largest bits, scales repeated down to the smallest group).
Permutations cannot be: parts whose act-order permutations differ are written unfused, either
dense float32 holding exactly their dequantized values (`unfusable="dense"`: loads with today's
loader and computes what the quantized parts would, at 32 bits per weight) or quantized under
their own names (`unfusable="separate"`: needs the loader to accept unfused parts). GPTQ derives
act-order from the diagonal of the layer input's Hessian, which q/k/v (and gate/up) share, so
their g_idx normally agree and they fuse.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from halfbyte.errors import CorruptFileError, HalfbyteError, ModelNotFoundError, QuantizationError, UnsupportedModelError
from halfbyte.quant.packing import pack, unpack
from halfbyte.quant.qtensor import FORMAT_VERSION, QuantSlice, QuantWeight, concat_out

IMPORTER_VERSION = 1
FUSED = {"self_attn": (("q_proj", "k_proj", "v_proj"), "qkv_proj"), "mlp": (("gate_proj", "up_proj"), "gate_up_proj")}
FOREIGN_METHODS = ("gptq", "awq")
SHARD_BYTES = 4 << 30


@dataclass
class LayerReport:
    prefix: str
    source: str  # e.g. "gptq 4-bit g128 act-order", "Q4_K"
    exact: bool
    max_abs_err: float = 0.0  # vs the source format's own dequantization
    note: str = ""


@dataclass
class ImportReport:
    source_format: str
    out_dir: Path
    layers: list[LayerReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bits_per_weight: float = 0.0

    def summary(self) -> str:
        exact = sum(r.exact for r in self.layers)
        worst = max((r.max_abs_err for r in self.layers), default=0.0)
        lines = [
            f"{self.source_format} -> {self.out_dir}: {len(self.layers)} quantized tensors, {exact} exact, "
            f"max |error| {worst:.3g}, {self.bits_per_weight:.3f} bits per weight"
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def progress(items: list[Any], description: str, show: bool) -> Any:
    """`items`, tracked by a transient rich progress bar when `show`."""
    if not show:
        return items
    from rich.progress import track

    return track(items, description=description, transient=True)


# --- fusing -------------------------------------------------------------------------------------


def _regroup(w: QuantWeight, bits: int, group_size: int) -> QuantWeight:
    """The same values with q widened to `bits` and each group split into groups of `group_size`
    sharing its scale and min: exact."""
    (s,) = w.slices
    if s.bits == bits and s.group_size == group_size:
        return w
    q = unpack(s.qweight, s.bits, s.width)
    source_of = torch.arange(-(-s.width // group_size)) * group_size // s.group_size
    new = QuantSlice(0, s.width, bits, group_size, pack(q, bits), s.scales[source_of].contiguous(), s.mins[source_of].contiguous())
    return QuantWeight(w.out_features, w.in_features, [new], w.perm)


def fuse(parts: list[QuantWeight]) -> tuple[QuantWeight | None, str]:
    """concat_out after unifying bits and group sizes; (None, why) when the permutations differ."""
    first = parts[0].perm
    if any(p.perm is not first and (p.perm is None or first is None or not torch.equal(p.perm, first)) for p in parts):
        return None, "act-order permutations differ"
    if any(len(p.slices) != 1 for p in parts):
        return concat_out(parts), ""
    bits = max(p.slices[0].bits for p in parts)
    group = min(p.slices[0].group_size for p in parts)
    widened = [_regroup(p, bits, group) for p in parts]
    changed = [i for i, (a, b) in enumerate(zip(parts, widened)) if a is not b]
    note = f"parts {changed} stored at {bits} bits g{group} to share one layout (exact)" if changed else ""
    return concat_out(widened), note


# --- writing ------------------------------------------------------------------------------------


class ShardWriter:
    """Collects output tensors and writes safetensors shards of about SHARD_BYTES."""

    def __init__(self, out: Path) -> None:
        self.out, self.pending, self.size, self.shards = out, {}, 0, []  # type: ignore[var-annotated]
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.weight_map or name in self.pending:
            raise CorruptFileError(f"tensor {name!r} would be written twice")
        self.pending[name] = t.contiguous()
        self.size += t.numel() * t.element_size()
        if self.size >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        save_file(self.pending, str(self.out / name), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.shards.append(name)
        self.pending, self.size = {}, 0

    def close(self) -> None:
        self._flush()
        if len(self.shards) == 1:
            os.replace(self.out / self.shards[0], self.out / "model.safetensors")
        elif self.shards:
            index = {"metadata": {}, "weight_map": self.weight_map}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_atomically(out: Path, overwrite: bool, fill: Any) -> None:
    if out.exists() and not overwrite:
        raise HalfbyteError(f"{out} already exists; remove it or choose another output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        if out.exists():  # overwrite: move the old one aside first, so a crash leaves one of them
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def quantization_config(model_dir: Path) -> dict[str, Any] | None:
    """The foreign quantization config of an HF directory (None if it has none)."""
    cfg = read_json(model_dir / "config.json")
    qc = cfg.get("quantization_config")
    if qc is None and (model_dir / "quantize_config.json").is_file():  # older AutoGPTQ
        qc = {"quant_method": "gptq", **read_json(model_dir / "quantize_config.json")}
    if qc is None and (model_dir / "quant_config.json").is_file():  # older AutoAWQ
        qc = {"quant_method": "awq", **read_json(model_dir / "quant_config.json")}
    if qc is not None and not isinstance(qc, dict):
        raise CorruptFileError(f"{model_dir / 'config.json'}: quantization_config is not an object")
    return qc


def read_json(path: Path) -> dict[str, Any]:
    from halfbyte.io.model_dir import read_json

    return read_json(path)


def _split_prefix(prefix: str) -> tuple[str, str, str] | None:
    """'model.layers.3.self_attn.q_proj' -> ('model.layers.3', 'self_attn', 'q_proj')."""
    parts = prefix.rsplit(".", 2)
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else None


def plan_layers(prefixes: list[str]) -> list[tuple[str, list[str]]]:
    """Output layers in order: (fused prefix, its part prefixes) for complete q/k/v and gate/up
    sets, (prefix, [prefix]) for the rest."""
    todo = set(prefixes)
    out: list[tuple[str, list[str]]] = []
    for p in prefixes:
        if p not in todo:
            continue
        split = _split_prefix(p)
        if split and split[1] in FUSED and split[2] in FUSED[split[1]][0]:
            names, fused = FUSED[split[1]]
            members = [f"{split[0]}.{split[1]}.{n}" for n in names]
            if all(m in todo for m in members):
                out.append((f"{split[0]}.{split[1]}.{fused}", members))
                todo.difference_update(members)
                continue
        out.append((p, [p]))
        todo.discard(p)
    return out


def emit_layer(
    writer: ShardWriter, layers: dict[str, Any], report: ImportReport, fused_prefix: str,
    parts: list[tuple[str, QuantWeight, torch.Tensor | None]], unfusable: str,
) -> None:
    """Write one output layer (fused when it has several parts) and its bias."""
    weights = [w for _, w, _ in parts]
    qw: QuantWeight | None
    if len(parts) == 1:
        qw, note = weights[0], ""
    else:
        qw, note = fuse(weights)
    if qw is not None:
        layers[fused_prefix] = qw.meta()
        for name, t in qw.to_state_dict(fused_prefix).items():
            writer.add(name, t)
        biases = [b for _, _, b in parts]
        if any(b is not None for b in biases):
            filled = [b if b is not None else torch.zeros(w.out_features) for b, w in zip(biases, weights)]
            dtype = next(b for b in biases if b is not None).dtype
            writer.add(f"{fused_prefix}.bias", torch.cat([b.to(dtype) for b in filled]))
        if note:
            report.notes.append(f"{fused_prefix}: {note}")
        return
    if unfusable == "error":
        raise QuantizationError(f"{fused_prefix}: parts cannot be fused ({note}); pass unfusable='dense' or 'separate'")
    for prefix, w, b in parts:
        if unfusable == "dense":
            writer.add(f"{prefix}.weight", w.dequantize(torch.float32))
        else:
            layers[prefix] = w.meta()
            for name, t in w.to_state_dict(prefix).items():
                writer.add(name, t)
        if b is not None:
            writer.add(f"{prefix}.bias", b)
    how = "dense float32 (their dequantized values)" if unfusable == "dense" else "quantized under their own names"
    report.notes.append(f"{fused_prefix}: {note}; parts written unfused, {how}")


def finish_config(cfg: dict[str, Any], layers: dict[str, Any], bpw: float, source: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in cfg.items() if k != "quantization_config"}
    out["quantization"] = {
        "quant_method": "halfbyte", "format_version": FORMAT_VERSION, "bits_per_weight": round(bpw, 4),
        "source": source, "layers": layers,
    }
    return out


def bits_per_weight(weights: Iterator[QuantWeight]) -> float:
    bits = n = 0
    for w in weights:
        bits += w.storage_bits()
        n += w.out_features * w.in_features
    return bits / n if n else 0.0


# --- the entry points ----------------------------------------------------------------------------


def import_checkpoint(
    src: str | Path, out: str | Path, *, overwrite: bool = False, unfusable: str = "dense", q6k_bits: int = 8,
    show_progress: bool = False,
) -> ImportReport:
    """A GPTQ/AWQ model directory or a .gguf file -> a halfbyte quantized model directory.

    unfusable: what to do with q/k/v or gate/up parts whose act-order permutations differ:
    "dense" (float32 dequantized values; loads today), "separate" (quantized under their own
    names; needs the loader change in the module notes), "error". q6k_bits: 8 or 6, the width
    Q6_K tensors are requantized to."""
    path = Path(src).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from halfbyte.quant.import_gguf import import_gguf_quantized

        return import_gguf_quantized(
            path, Path(out), overwrite=overwrite, unfusable=unfusable, q6k_bits=q6k_bits, show_progress=show_progress
        )
    if path.is_dir():
        from halfbyte.quant.import_hf import import_hf_quantized

        return import_hf_quantized(path, Path(out), overwrite=overwrite, unfusable=unfusable, show_progress=show_progress)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file")
    raise ModelNotFoundError(f"{path} does not exist")


def default_cache_dir() -> Path:
    root = os.environ.get("HALFBYTE_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "halfbyte") / "imported"


def _fingerprint(path: Path) -> str:
    h = hashlib.sha256(f"{IMPORTER_VERSION}:{path.resolve()}".encode())
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def convert_if_foreign(model_dir: str | Path, cache_dir: str | Path | None = None, show_progress: bool = False) -> Path:
    """`model_dir` itself if halfbyte can load it as is; for a GPTQ/AWQ directory or a .gguf file,
    a converted halfbyte quantized directory in the cache (made once, reused while the source's
    files keep their sizes and mtimes). Other quantization methods raise UnsupportedModelError."""
    path = Path(model_dir).expanduser()
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if not is_gguf:
        if not path.is_dir() or not (path / "config.json").is_file():
            return path  # not ours to judge: the loader reports missing directories
        cfg = read_json(path / "config.json")
        if "quantization" in cfg:
            return path
        qc = quantization_config(path)
        if qc is None:
            return path
        method = str(qc.get("quant_method", "")).lower()
        if method not in FOREIGN_METHODS:
            raise UnsupportedModelError(
                f"{path}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported; "
                f"halfbyte imports {', '.join(FOREIGN_METHODS)} checkpoints and GGUF files"
            )
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{path.stem if is_gguf else path.name}-{_fingerprint(path)}"
    if (target / "config.json").is_file():
        return target
    try:
        import_checkpoint(path, target, show_progress=show_progress)
    except HalfbyteError:
        if (target / "config.json").is_file():  # another process finished the same import first
            return target
        raise
    except OSError:
        if (target / "config.json").is_file():
            return target
        raise
    return target


def add_import_subcommand(sub: Any) -> None:
    """Register `halfbyte import SRC OUT` on an argparse subparsers object."""
    p = sub.add_parser("import", help="convert a GPTQ/AWQ model directory or a GGUF file into a halfbyte quantized directory")
    p.add_argument("src", help="Hugging Face GPTQ or AWQ model directory, or a .gguf file")
    p.add_argument("out", help="output directory")
    p.add_argument("--unfusable", choices=("dense", "separate", "error"), default="dense",
                   help="q/k/v or gate/up parts with different act-order permutations: dense float32 (default), "
                        "quantized under their own names, or an error")
    p.add_argument("--q6k-bits", type=int, choices=(8, 6), default=8, help="bits that GGUF Q6_K tensors are requantized to")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")

    def run(args: Any) -> int:
        import sys

        report = import_checkpoint(args.src, args.out, overwrite=args.overwrite, unfusable=args.unfusable,
                                   q6k_bits=args.q6k_bits, show_progress=sys.stderr.isatty())
        print(report.summary())
        return 0

    p.set_defaults(func=run)
