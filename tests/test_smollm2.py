"""The real default model (SmolLM2-135M-Instruct from its GGUF) against transformers, and the
engine's generation behaviour on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfbyte import LLM, SamplingParams
from halfbyte.engine.scoring import score_tokens
from halfbyte.io.default_model import default_gguf_path

TEXT = (
    "The history of the lighthouse begins in antiquity. Sailors relied on fires lit on hilltops to "
    "guide them home, and the Pharos of Alexandria, built in the third century BC, stood for more "
    "than a thousand years. Modern lighthouses use Fresnel lenses, invented by Augustin-Jean Fresnel "
    "in 1822, which concentrate light into a beam visible for many miles. Today most lights are "
    "automated, and the keepers who once tended them are remembered in stories, songs and museums. "
    "Numbers like 1,234.56 and code such as `for i in range(10): print(i)` also appear in text."
)


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    with LLM(default_model_dir, device="cpu", dtype="float32") as model:
        yield model


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    gguf = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    return model.eval()


def test_logits_match_transformers_on_200_tokens(llm: LLM, hf_model) -> None:  # type: ignore[no-untyped-def]
    ids = llm.tokenizer.encode(TEXT * 3)[:200]
    assert len(ids) == 200
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    got = score_tokens(llm.engine.model, ids)
    diff = (got - ref).abs().max().item()
    assert diff <= 1e-3, diff


def test_greedy_64_tokens_equal_transformers(llm: LLM, hf_model) -> None:  # type: ignore[no-untyped-def]
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the moon."}])
    out = llm.generate(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert out.token_ids == ref[0, len(ids):].tolist()


def test_chat_names_paris(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=48, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_batch_equals_each_alone(llm: LLM) -> None:
    prompts = ["The sky is", "List three fruits:", TEXT[:300], "1, 2, 3, 4,", "def fib(n):"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        alone = llm.generate(prompt, params)[0]
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text


def test_stream_equals_generate_and_stops(llm: LLM) -> None:
    params = SamplingParams(max_tokens=30, temperature=0)
    full = llm.generate("Once upon a time", params)[0]
    streamed = "".join(llm.stream("Once upon a time", params))
    assert streamed == full.text
    stop_at = full.text.split()[3]
    stopped = llm.generate("Once upon a time", SamplingParams(max_tokens=30, temperature=0, stop=[stop_at]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop_at)]


def test_seed_gives_same_tokens_alone_and_in_a_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = llm.generate("Write a poem about rain.", seeded)[0]
    others = [SamplingParams(max_tokens=16, temperature=1.0) for _ in range(3)]
    batch = llm.generate(["Hello", "Write a poem about rain.", "Why?", "Count: 1"], [others[0], seeded, *others[1:]])
    assert batch[1].token_ids == alone.token_ids


def test_max_tokens_gives_length(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_preemption_loses_nothing(default_model_dir: Path) -> None:
    """A pool far smaller than the load: sequences are preempted, recomputed, and equal alone."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    with LLM(default_model_dir, device="cpu", kv_cache_tokens=16 * 16, page_size=16) as small:
        together = small.generate(prompts, params)
        alone = [small.generate(p, params)[0] for p in prompts[:2]]
    assert [o.token_ids for o in together[:2]] == [a.token_ids for a in alone]
    assert all(len(o.token_ids) == 40 for o in together)


def test_cli_chat_answers_paris() -> None:
    """The README's demo command, as a user runs it."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "halfbyte", "generate", "--chat", "--temperature", "0", "--max-tokens", "48",
         "--prompt", "What is the capital of France?"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
