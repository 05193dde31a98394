"""Bad input gets a clear one-line error (a HalfbyteError; from the CLI, a non-zero exit and no
traceback), and never a crash deep inside torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from halfbyte import LLM, SamplingParams
from halfbyte.errors import CorruptFileError, ModelNotFoundError, PromptTooLongError, UnsupportedModelError
from tests.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", default_model_dir)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "halfbyte", *args], capture_output=True, text=True, cwd=REPO,
        env={**os.environ, **(env or {})}, timeout=300,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("halfbyte: error:"), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope", device="cpu")
    assert_one_line_error(run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"), "does not exist")


def test_missing_default_model_says_how_to_get_it(tmp_path: Path) -> None:
    proc = run_cli("generate", "--prompt", "hi", env={"HALFBYTE_HOME": str(tmp_path / "empty-home")})
    assert_one_line_error(proc, "fetch")


def test_unsupported_architecture(tmp_path: Path, tiny_dir: Path) -> None:
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(bad, device="cpu")
    assert_one_line_error(run_cli("generate", "--model", str(bad), "--prompt", "hi"), "GPT2LMHeadModel")


def test_truncated_safetensors(tmp_path: Path, tiny_dir: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_dir.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    with pytest.raises(CorruptFileError, match="model.safetensors"):
        LLM(broken, device="cpu")
    assert_one_line_error(run_cli("generate", "--model", str(broken), "--prompt", "hi"), "truncated or corrupt")


def test_corrupt_config_json(tmp_path: Path, tiny_dir: Path) -> None:
    broken = tmp_path / "badjson"
    broken.mkdir()
    for f in tiny_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "config.json").write_text("{not json")
    assert_one_line_error(run_cli("generate", "--model", str(broken), "--prompt", "hi"), "config.json")


def test_corrupt_gguf_import(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + os.urandom(200))
    assert_one_line_error(run_cli("import-gguf", str(junk), str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_prompt_longer_than_context(tiny_dir: Path) -> None:
    with LLM(tiny_dir, device="cpu", max_model_len=32) as llm:
        with pytest.raises(PromptTooLongError, match="context window"):
            llm.generate("word " * 40)
    proc = run_cli("generate", "--model", str(tiny_dir), "--max-model-len", "16", "--prompt", "word " * 40)
    assert_one_line_error(proc, "context window")


@pytest.mark.parametrize(
    "flag,value,field",
    [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"), ("--top-p", "1.5", "top_p"),
     ("--top-k", "-5", "top_k"), ("--min-p", "2", "min_p"), ("--max-tokens", "0", "max_tokens")],
)
def test_invalid_sampling_values_from_cli(tiny_dir: Path, flag: str, value: str, field: str) -> None:
    assert_one_line_error(run_cli("generate", "--model", str(tiny_dir), "--prompt", "hi", flag, value), field)


def test_bad_rope_scaling_and_dtype(tiny_dir: Path) -> None:
    assert_one_line_error(run_cli("generate", "--model", str(tiny_dir), "--prompt", "hi", "--rope-scaling", "bogus"))
    assert_one_line_error(run_cli("generate", "--model", str(tiny_dir), "--prompt", "hi", "--dtype", "int3"), "dtype")


def test_cli_generates_on_tiny_model(tiny_dir: Path) -> None:
    proc = run_cli("generate", "--model", str(tiny_dir), "--prompt", "hi", "--max-tokens", "5", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n")


def test_request_that_can_never_fit_is_rejected(tiny_dir: Path) -> None:
    with LLM(tiny_dir, device="cpu", kv_cache_tokens=128, page_size=8) as llm:
        with pytest.raises(PromptTooLongError, match="KV cache"):
            llm.generate("hello", SamplingParams(max_tokens=250, ignore_eos=True))
