"""Conversion state under OUT.partial/: atomic writes, the residual stream after the last
finished layer, and the fingerprint of the settings that a resumed conversion must match."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from halfbyte.io.safetensors_files import safetensors_files

if TYPE_CHECKING:
    from halfbyte.quant.convert import ConvertOptions

STATE_VERSION = 2  # 2: measurement by block output error, candidates with their own act-order



def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, json.dumps(obj, indent=1).encode())


def _atomic_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _save_stream(path: Path, next_layer: int, stream: torch.Tensor, float_stream: torch.Tensor | None = None) -> None:
    """The residual stream entering layer next_layer (and the float model's, when GPTQ is asymmetric)."""
    tensors = {"stream": stream} if float_stream is None else {"stream": stream, "float_stream": float_stream}
    _atomic_tensors(path, tensors, {"next_layer": str(next_layer)})


def _load_stream(path: Path, name: str = "stream") -> tuple[int, torch.Tensor] | None:
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        next_layer = int(f.metadata()["next_layer"])
        return (next_layer, f.get_tensor(name)) if name in f.keys() else None


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fingerprint(model_dir: Path, opts: ConvertOptions) -> dict[str, Any]:
    return {
        "state_version": STATE_VERSION,
        "model": str(model_dir.resolve()),
        "weights": sorted((p.name, p.stat().st_size) for p in safetensors_files(model_dir)),
        "bits": opts.bits,
        "group_size": opts.group_size,
        "head_bits": opts.head_bits,
        "act_order": opts.act_order,
        "calib": [[str(p), _file_digest(Path(p))] for p in opts.calib_files],
        "seq_len": opts.seq_len,
        "num_windows": opts.num_windows,
        "damp": opts.damp,
        "clip_search": opts.clip_search,
        "measure_tokens": opts.measure_tokens,
        "sample_prompts": opts.sample_prompts,
        "sample_tokens": opts.sample_tokens,
        # the default list too: a cached measurement of another candidate list must not be reused
        "candidates": [c.to_json() for c in opts.candidate_list()],
        "tune": [opts.steps(), opts.tune_lr_norm, opts.tune_lr_scale],
        "asymmetric": [opts.asymmetric, opts.asym_damp] if opts.asymmetric else False,
    } | ({"rotate": opts.rotation_seed} if opts.rotate else {})  # absent when off: earlier states stay valid

