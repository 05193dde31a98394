"""Async scheduling (engine/launched_step.py): the engine launches the next decode step before it
reads the previous step's tokens. On the real default model (CPU), with requests arriving, stopping
by EOS, stop strings and length, sampling with seeds, filters and penalties (which count a token
in flight on the device), asking for logprobs (read with the tokens) or running a logits processor
(which keeps its steps synchronous), aborted mid-flight and preempted by a small pool,
every request gets exactly the tokens, text and finish reason of the synchronous engine; and the
engine does run ahead, on the eager path and through the decode-graph rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from halfbyte.engine.config import EngineConfig
from halfbyte.engine.llm_engine import LLMEngine
from halfbyte.sampling_params import SamplingParams

from .test_token_rows import EagerGraphs

PROMPTS = ["The river", "Once upon a time", "List three colors:", "def add(a, b):", "Paris is", "1, 2, 3,", "a a a",
           "Hello"]
PARAMS = [
    SamplingParams(max_tokens=9, temperature=0),  # may stop at EOS
    SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=1.0, min_p=0.05, seed=3, stop=[","]),
    SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.7, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True),  # counts in flight
    SamplingParams(max_tokens=9, temperature=0.9, seed=5, frequency_penalty=0.8, presence_penalty=0.5,
                   penalty_window=4, logit_bias={11: 2.0}, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,  # host callable: synchronous steps
                   logits_processors=[lambda out, row: row - 5.0 * (torch.arange(row.numel()) % 7 == len(out) % 7)]),
]


def engine(model_dir: Path, async_scheduling: bool, **cfg: Any) -> LLMEngine:
    config = EngineConfig(max_model_len=256, async_scheduling=async_scheduling, **cfg)
    return LLMEngine(model_dir, device="cpu", dtype="float32", config=config)


def drive(eng: LLMEngine, requests: list[tuple[int, int]], abort: tuple[int, str] | None = None,
          params: list[SamplingParams] = PARAMS) -> dict[str, Any]:
    """requests: (step to add it at, prompt index); abort: (step, request id). Per request:
    (tokens, text, finish reason, logprobs)."""
    tokens: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    reason: dict[str, str | None] = {}
    logprobs: dict[str, list[Any]] = {}
    step = 0
    pending = sorted(requests)
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            rid = f"r{i}"
            eng.add_request(rid, eng.tokenizer.encode(PROMPTS[i]), params[i])
            tokens[rid], text[rid], reason[rid], logprobs[rid] = [], "", None, []
        if abort is not None and step == abort[0]:
            eng.abort_request(abort[1])
            reason[abort[1]] = "abort"
        for out in eng.step():
            assert reason[out.request_id] is None, f"{out.request_id} produced a token after it finished"
            tokens[out.request_id] += out.new_token_ids
            text[out.request_id] += out.delta_text
            logprobs[out.request_id] += out.logprobs or []
            if out.finished:
                reason[out.request_id] = out.finish_reason
        step += 1
    assert eng.pool.num_used == 0, "pages still referenced after every request finished"
    return {r: (tokens[r], text[r], reason[r], logprobs[r]) for r in tokens}


class LaunchLog:
    """Counts the launches that ran ahead (named the in-flight step's tokens)."""

    def __init__(self, eng: LLMEngine) -> None:
        self.ahead = 0
        launch = eng.runner.launch

        def logged(batch: Any, previous_tokens: torch.Tensor | None = None) -> Any:
            self.ahead += previous_tokens is not None
            return launch(batch, previous_tokens)

        eng.runner.launch = logged  # type: ignore[method-assign]


ARRIVALS = [(0, 0), (0, 1), (0, 2), (2, 3), (4, 4), (9, 5), (10, 6), (12, 7)]


def test_async_equals_sync_on_mixed_requests(default_model_dir: Path) -> None:
    want = drive(engine(default_model_dir, False), ARRIVALS)
    eng = engine(default_model_dir, True)
    log = LaunchLog(eng)
    got = drive(eng, ARRIVALS)
    assert got == want
    assert log.ahead >= 2  # only outside the logits-processor request's steps (synchronous)


def test_decodes_run_ahead(default_model_dir: Path) -> None:
    arrivals = [(0, 1), (0, 2), (0, 3), (0, 4), (0, 6)]  # seeds, filters, penalties, logprobs: all run ahead
    want = drive(engine(default_model_dir, False), arrivals)
    eng = engine(default_model_dir, True)
    log = LaunchLog(eng)
    assert drive(eng, arrivals) == want
    # 12 tokens for the longest: prefill, then a run-ahead launch for each decode until a request
    # stops by length or stop string (the step after it is launched only after the read)
    assert log.ahead >= 6


def test_async_through_graph_rows_equals_sync(default_model_dir: Path) -> None:
    """The decode-graph path (a CPU stand-in replaying eagerly) resolves the placeholders too."""

    def with_graphs(async_scheduling: bool) -> LLMEngine:
        eng = engine(default_model_dir, async_scheduling, max_num_seqs=8)
        eng.runner.graphs = EagerGraphs(eng.model, eng.pool.kv_caches, 8, 256, eng.pool.scratch_page)
        return eng

    want = drive(with_graphs(False), ARRIVALS)
    eng = with_graphs(True)
    log = LaunchLog(eng)
    got = drive(eng, ARRIVALS)
    assert got == want
    assert log.ahead >= 2 and len(eng.runner.graphs.replays) > 10


def test_abort_while_in_flight(default_model_dir: Path) -> None:
    arrivals = [(0, 0), (0, 1), (0, 4)]
    want = drive(engine(default_model_dir, False), arrivals, abort=(4, "r1"))
    eng = engine(default_model_dir, True)
    log = LaunchLog(eng)
    got = drive(eng, arrivals, abort=(4, "r1"))
    assert got["r0"] == want["r0"] and got["r4"] == want["r4"]
    # the aborted request's tokens are a prefix of its full run (async reads them a step later)
    full = drive(engine(default_model_dir, False), [(0, 1)])["r1"][0]
    assert got["r1"][0] == full[: len(got["r1"][0])] and got["r1"][2] == "abort"
    assert log.ahead >= 3


def test_small_pool_preempts_and_resumes(default_model_dir: Path) -> None:
    arrivals = [(0, i) for i in range(5)]
    long = [SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True) for i in range(5)]
    small = {"kv_cache_tokens": 128, "page_size": 8}  # 16 pages of 8 for 5 requests of ~35 tokens
    want = drive(engine(default_model_dir, False), arrivals, params=long)
    eng = engine(default_model_dir, True, **small)
    got = drive(eng, arrivals, params=long)
    assert got == want
    assert eng.scheduler.num_preemptions > 0


def test_async_is_off_by_default_on_the_cpu(default_model_dir: Path) -> None:
    eng = LLMEngine(default_model_dir, device="cpu", dtype="float32", config=EngineConfig(max_model_len=64))
    assert eng.async_scheduling is False


@pytest.mark.parametrize("n", [0, 3])
def test_placeholders_resolve_on_the_device(n: int) -> None:
    from halfbyte.engine.launched_step import placeholder, resolve_placeholders

    previous = torch.tensor([50, 60, 70])[:n]
    ids = torch.tensor([5, placeholder(2), 9, placeholder(0)] if n else [5, 9])
    want = [5, 70, 9, 50] if n else [5, 9]
    assert resolve_placeholders(ids, previous).tolist() == want
