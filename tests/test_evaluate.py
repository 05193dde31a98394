"""Perplexity and KL evaluation, and the convert / eval-ppl / eval-kl subcommands."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
import transformers

from halfbyte.errors import HalfbyteError
from halfbyte.model.loader import load_pretrained
from halfbyte.quant.cli_commands import add_subcommands
from halfbyte.quant.evaluate import EvalTextError, eval_windows, evaluate_kl, evaluate_perplexity, read_eval_text
from tests.test_convert import CORPUS, make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny_eval") / "m")


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "eval.txt"
    path.write_text(CORPUS[:2000])
    return path


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="halfbyte")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HalfbyteError as e:
        print(f"halfbyte: error: {e}")
        return 1


def test_eval_windows() -> None:
    assert eval_windows(list(range(10)), ctx=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert eval_windows(list(range(10)), ctx=4, windows=1) == [[0, 1, 2, 3]]
    assert eval_windows(list(range(3)), ctx=4) == [[0, 1, 2]]
    with pytest.raises(EvalTextError):
        eval_windows([1], ctx=4)


def test_perplexity_matches_transformers(tiny: Path, text: Path) -> None:
    result = evaluate_perplexity(tiny, text, ctx=64, windows=3)
    ids = load_pretrained(tiny, torch.float32, torch.device("cpu")).tokenizer.encode(
        read_eval_text(text), add_special_tokens=False
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for w in range(3):
            window = torch.tensor([ids[w * 64 : (w + 1) * 64]])
            losses.append(float(hf(window, labels=window).loss))
    assert result.tokens == 3 * 63 and result.windows == 3
    assert result.perplexity == pytest.approx(math.exp(sum(losses) / 3), rel=1e-4)


def test_kl_of_a_model_with_itself_is_zero_and_grows_with_quantization(
    tiny: Path, text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same = evaluate_kl(tiny, tiny, text, ctx=64, windows=2)
    assert abs(same.mean_kl) < 1e-6 and same.top1_agreement == 1.0
    calib = tmp_path / "calib.txt"
    calib.write_text(CORPUS)
    outs = {}
    for bits in (3.0, 6.0):
        out = tmp_path / f"q{bits}"
        assert _run([
            "convert", "--model", str(tiny), "--out", str(out), "--bits", str(bits), "--calib", str(calib),
            "--calib-seq-len", "64", "--calib-windows", "4",
        ]) == 0
        assert f"wrote {out}" in capsys.readouterr().out
        outs[bits] = evaluate_kl(out, tiny, text, ctx=64, windows=2)
    assert 0 < outs[6.0].mean_kl < outs[3.0].mean_kl
    assert outs[6.0].top1_agreement >= outs[3.0].top1_agreement

    assert _run(["eval-ppl", "--model", str(tmp_path / "q6.0"), "--text", str(text), "--ctx", "64", "--windows", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("perplexity: ") and float(last.split()[-1]) > 1
    assert _run(["eval-kl", "--model", str(tmp_path / "q6.0"), "--ref", str(tiny), "--text", str(text), "--ctx", "64", "--windows", "2"]) == 0
    out = capsys.readouterr().out
    assert "mean KL(ref || model):" in out and "top-1 agreement:" in out


def test_bad_text_and_budget_are_clear_errors(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    for bad in (empty, binary, tmp_path / "missing.txt"):
        assert _run(["eval-ppl", "--model", str(tiny), "--text", str(bad)]) == 1
        assert "halfbyte: error:" in capsys.readouterr().out
    assert _run(["convert", "--model", str(tiny), "--out", str(tmp_path / "o"), "--bits", "1.5"]) == 1
    assert "--bits" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


def test_convert_flags_reach_the_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--calib-samples / --calib-windows / --no-tune as ConvertOptions; unset samples and tuning
    stay None so the converter decides them for the budget (resolve_defaults)."""
    import halfbyte.quant.convert as convert_module

    seen: list[object] = []

    def fake_convert(model: object, out: object, opts: object) -> object:
        seen.append(opts)
        raise SystemExit(0)

    monkeypatch.setattr(convert_module, "convert", fake_convert)
    for extra in (["--calib-samples", "7", "--calib-windows", "5", "--no-tune", "--no-asymmetric"], []):
        with pytest.raises(SystemExit):
            _run(["convert", "--model", "m", "--out", str(tmp_path / "o"), "--bits", "3.25", *extra])
    given, default = seen
    assert (given.sample_prompts, given.num_windows, given.tune_steps, given.asymmetric) == (7, 5, 0, False)  # type: ignore[attr-defined]
    assert (default.sample_prompts, default.num_windows, default.tune_steps, default.asymmetric) == (None, 32, None, None)  # type: ignore[attr-defined]
