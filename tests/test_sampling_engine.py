"""Sampling through the real engine on the demo model: seeds in any batch, min_tokens, logprobs,
n > 1, logits processors and output hooks from LLM.generate, vocab checks at add_request."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from halfbyte.api import LLM, RequestOutput
from halfbyte.errors import InvalidParameterError
from halfbyte.sampling_params import SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    with LLM(default_model_dir, device="cpu", dtype="float32", kv_cache_tokens=8192, max_num_seqs=32) as model:
        yield model


@pytest.mark.slow  # ~40 s on the shared 2-core box; tests/test_sampling.py checks the same on the sampler alone
def test_seed_gives_the_same_tokens_alone_and_in_a_batch_of_16(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234, max_tokens=6, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].token_ids
    torch.manual_seed(0)
    others = [SamplingParams(temperature=0.6 + 0.1 * i, top_k=i * 5, repetition_penalty=1.0 + i / 20,
                             max_tokens=2 + i % 5, ignore_eos=True) for i in range(15)]
    prompts = [f"Story {i}:" for i in range(15)]
    outs = llm.generate(prompts[:9] + [PROMPT] + prompts[9:], others[:9] + [seeded] + others[9:])
    assert outs[9].token_ids == alone
    assert len(alone) == 6


def test_min_tokens_suppresses_eos(llm: LLM) -> None:
    eos = next(iter(llm.engine.eos_token_ids))
    force_eos = lambda ids, row: row.index_fill(0, torch.tensor([eos]), 1e4)  # noqa: E731
    out = llm.generate(PROMPT, SamplingParams(temperature=0, min_tokens=5, max_tokens=20, logits_processors=[force_eos]))[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    assert out.finish_reason == "stop"


def test_logprobs_come_back_per_token(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0.8, seed=3, max_tokens=5, logprobs=2, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 5
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) in (2, 3)
        assert all(v <= 0.0 for v in entry.values())
        assert max(entry.values()) >= entry[token]


def test_n_fans_out_into_distinct_seeded_samples(llm: LLM) -> None:
    p = SamplingParams(temperature=1.2, seed=7, max_tokens=4, n=3, ignore_eos=True)
    out = llm.generate(PROMPT, p)
    assert len(out) == 1 and len(out[0].samples) == 3
    assert out[0].token_ids == out[0].samples[0].token_ids
    single = llm.generate(PROMPT, p.for_sample(2))[0]
    assert out[0].samples[2].token_ids == single.token_ids  # child i is the seed + i request
    assert len({tuple(s.token_ids) for s in out[0].samples}) > 1


def test_logits_processor_and_output_hook_from_the_api(llm: LLM) -> None:
    target = llm.tokenizer.encode(" Paris")[0]

    def only_target(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        return torch.full_like(row, float("-inf")).index_fill(0, torch.tensor([target]), 0.0)

    def shout(res: RequestOutput) -> RequestOutput:
        res.text = res.text.upper()
        return res

    out = llm.generate(PROMPT, SamplingParams(max_tokens=3, logits_processors=[only_target], output_processors=[shout]))[0]
    assert out.token_ids == [target] * 3
    assert out.text == out.text.upper() and "PARIS" in out.text


def test_bad_token_ids_outside_the_vocab_name_the_field(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))


def test_allowed_ids_and_penalties_run_in_the_engine(llm: LLM) -> None:
    allowed = llm.tokenizer.encode(" yes no maybe")
    p = SamplingParams(temperature=1.0, seed=5, max_tokens=6, allowed_token_ids=allowed, repetition_penalty=1.5,
                       frequency_penalty=0.5, penalty_window=4, ignore_eos=True)
    out = llm.generate(PROMPT, dataclasses.replace(p, max_tokens=4))[0]
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 4
