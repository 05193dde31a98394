"""Finding a model directory: a local path, or a Hugging Face Hub name when online."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from halfbyte.errors import CorruptFileError, ModelNotFoundError

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def resolve_model_dir(model: str | Path | None) -> Path:
    """A directory holding config.json. None means the embedded default model."""
    if model is None:
        from halfbyte.io.default_model import ensure_default_model

        return ensure_default_model(fetch=False)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; is it a model directory?")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is a file, not a model directory (a .gguf file loads directly, or import it with `halfbyte import-gguf`)")
    name = str(model)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model directory {name!r} does not exist")
    return _download_from_hub(name)


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated: all mean "not available here"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local directory and could not be fetched from the Hugging Face Hub ({reason})"
        ) from None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CorruptFileError(f"{path} does not hold a JSON object")
    return data


def read_optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}
