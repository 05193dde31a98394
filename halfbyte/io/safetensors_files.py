"""Reading tensors from single or sharded safetensors checkpoints, with clear errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from halfbyte.errors import CorruptFileError, ModelNotFoundError
from halfbyte.io.model_dir import read_json


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CorruptFileError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file; a truncated or corrupt file raises
    CorruptFileError naming it."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CorruptFileError(f"{path} is truncated or corrupt ({first})") from None
