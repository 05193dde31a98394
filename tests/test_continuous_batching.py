"""The paged engine on the real default model (SmolLM2, CPU): requests batched together equal
each alone, the prefix cache skips shared tokens without changing outputs, a small pool
preempts without losing anything, and decodes keep going while a long prompt prefills."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfbyte.engine.config import EngineConfig
from halfbyte.engine.llm_engine import LLMEngine
from halfbyte.errors import PromptTooLongError
from halfbyte.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
WORDS = ("river stone lantern harbor cedar copper meadow signal orbit velvet quartz ember "
         "falcon prism tundra willow canyon beacon").split()


def prompt_ids(engine: LLMEngine, seed: int, words: int) -> list[int]:
    text = " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(words))
    return engine.tokenizer.encode(f"Note {seed}: {text}")


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        rid = f"r{i}-{id(ids)}"
        engine.add_request(rid, ids, params)
        out[rid] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return list(out.values())


@pytest.fixture(scope="module")
def uncached(default_model_dir: Path) -> LLMEngine:
    """Whole prompts, no prefix cache: the reference each request is compared to."""
    cfg = EngineConfig(enable_prefix_caching=False, max_model_len=2048)
    return LLMEngine(default_model_dir, device="cpu", dtype="float32", config=cfg)


@pytest.fixture(scope="module")
def paged(default_model_dir: Path) -> LLMEngine:
    """Small chunks and a prefix cache: every request is split and mixed with others."""
    cfg = EngineConfig(max_batch_tokens=96, max_num_seqs=32, max_model_len=2048, kv_cache_tokens=4096)
    return LLMEngine(default_model_dir, device="cpu", dtype="float32", config=cfg)


@pytest.mark.slow
def test_32_mixed_requests_equal_each_alone(paged: LLMEngine, uncached: LLMEngine) -> None:
    prompts = [prompt_ids(paged, i, 3 + (i * 13) % 60) for i in range(32)]
    together = run(paged, prompts)
    alone = [run(uncached, [p])[0] for p in prompts]
    assert together == alone


def test_mixed_batch_equals_each_alone(paged: LLMEngine, uncached: LLMEngine) -> None:
    """The fast cousin of the 32-request test: 6 requests, chunked and mixed."""
    prompts = [prompt_ids(paged, 100 + i, 4 + 25 * i) for i in range(6)]
    assert run(paged, prompts) == [run(uncached, [p])[0] for p in prompts]


def test_shared_prefix_computes_only_new_tokens(paged: LLMEngine, uncached: LLMEngine) -> None:
    prefix = prompt_ids(paged, 7, 150)  # a few hundred tokens, not a whole number of pages
    first, second = prefix + paged.tokenizer.encode(" Question one?"), prefix + paged.tokenizer.encode(" And two?")
    run(paged, [first])
    before = paged.stats()
    cached_out = run(paged, [second])[0]
    after = paged.stats()
    hit = after.prefix_hit_tokens - before.prefix_hit_tokens
    miss = after.prefix_miss_tokens - before.prefix_miss_tokens
    assert hit + miss == len(second)
    assert hit >= len(prefix) - 1  # full pages shared, the prefix's last page partly copied
    assert miss <= len(second) - len(prefix) + 1
    assert cached_out == run(uncached, [second])[0]


def test_small_pool_preempts_and_loses_nothing(default_model_dir: Path, uncached: LLMEngine) -> None:
    cfg = EngineConfig(kv_cache_tokens=16 * 16, page_size=16, max_batch_tokens=128, max_model_len=2048)
    small = LLMEngine(default_model_dir, device="cpu", dtype="float32", config=cfg)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [prompt_ids(small, 200 + i, 6 + 3 * i) for i in range(8)]  # ~8 x 40 tokens > 256
    together = run(small, prompts, params)
    assert small.stats().num_preemptions > 0
    assert together == [run(uncached, [p], params)[0] for p in prompts]
    assert small.stats().pages_used == 0
    with pytest.raises(PromptTooLongError, match="KV cache"):
        small.add_request("too-big", prompts[0], SamplingParams(max_tokens=400))
    small.close()


def test_decodes_get_a_token_every_step_while_a_long_prompt_prefills(paged: LLMEngine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(3):
        paged.add_request(f"short-{i}", prompt_ids(paged, 300 + i, 3), params)
    while any(paged.sequence(f"short-{i}").num_uncomputed_tokens > 1 for i in range(3)):  # type: ignore[union-attr]
        paged.step()
    long_ids = prompt_ids(paged, 400, 350)
    assert len(long_ids) > 3 * paged.config.max_batch_tokens
    paged.add_request("long", long_ids, SamplingParams(max_tokens=2, temperature=0))
    long = paged.sequence("long")
    prefill_steps = 0
    while long is not None and long.num_computed_tokens < len(long_ids):
        got = {o.request_id for o in paged.step()}
        assert {f"short-{i}" for i in range(3)} <= got
        prefill_steps += 1
    assert prefill_steps >= 3  # the prompt really was chunked
    for i in range(3):
        paged.abort_request(f"short-{i}")
    paged.abort_request("long")
