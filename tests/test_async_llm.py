"""AsyncLLM on the CPU demo model: streamed deltas match the sync engine, concurrent requests share
one engine, cancellation and abort free the pages at once, admission is bounded.

One LLM is loaded for the module; each test wraps its engine in an AsyncLLM (started and stopped
by `async with`), so the sync API and the async one are checked on the same engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from halfbyte.api import LLM
from halfbyte.async_llm import AsyncLLM, EngineDeadError, QueueFullError, StreamDelta
from halfbyte.errors import InvalidParameterError
from halfbyte.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)
LONG = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)  # runs until aborted
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,", "Water boils at"]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    with LLM(default_model_dir, device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=8) as model:
        yield model


def run(coro_fn, llm: LLM, max_waiting: int = 16):  # type: ignore[no-untyped-def]
    """Run coro_fn(engine) inside a started AsyncLLM over the module's engine."""

    async def main():  # type: ignore[no-untyped-def]
        async with AsyncLLM(engine=llm.engine, max_waiting=max_waiting) as engine:
            return await coro_fn(engine)

    return asyncio.run(main())


async def collect(engine: AsyncLLM, prompt, params: SamplingParams = GREEDY) -> list[StreamDelta]:  # type: ignore[no-untyped-def]
    return [d async for d in engine.generate(prompt, params)]


def test_sync_batch_keeps_order_and_on_token_streams(llm: LLM) -> None:
    seen: dict[str, list[str]] = {}
    outs = llm.generate(PROMPTS[:3], GREEDY, on_token=lambda rid, delta: seen.setdefault(rid, []).append(delta))
    for prompt, out in zip(PROMPTS[:3], outs, strict=True):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert "".join(seen[out.request_id]) == out.text
        assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens


def test_deltas_match_the_sync_engine(llm: LLM) -> None:
    expected = llm.generate(PROMPTS[0], GREEDY)[0]
    deltas = run(lambda e: collect(e, PROMPTS[0]), llm)
    assert len(deltas) > 1, "a streamed request yields one delta per step"
    assert "".join(d.text for d in deltas) == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert deltas[-1].completion_tokens == GREEDY.max_tokens
    assert deltas[-1].prompt_tokens == len(expected.prompt_token_ids)


def test_token_ids_and_chat_messages_as_prompts(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    expected_chat = llm.chat(messages, GREEDY)[0].text
    ids = llm.tokenizer.encode(PROMPTS[1])
    expected_ids = llm.generate(ids, GREEDY)[0].text

    async def both(engine: AsyncLLM) -> tuple[str, str]:
        chat = "".join(d.text for d in await collect(engine, messages))
        from_ids = "".join(d.text for d in await collect(engine, ids))
        return chat, from_ids

    assert run(both, llm) == (expected_chat, expected_ids)


def test_concurrent_requests_get_their_solo_text(llm: LLM) -> None:
    solo = [llm.generate(p, GREEDY)[0].text for p in PROMPTS]

    async def together(engine: AsyncLLM) -> list[str]:
        results = await asyncio.gather(*(collect(engine, p) for p in PROMPTS * 2))
        return ["".join(d.text for d in r) for r in results]

    assert run(together, llm) == solo * 2
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_cancelling_the_consumer_frees_its_pages(llm: LLM) -> None:
    pool = llm.engine.pool

    async def cancel(engine: AsyncLLM) -> tuple[int, int, int]:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("Tell me a long story.", LONG,
                                           request_id="long"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        used = pool.num_pages - pool.num_free
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.abort("long")  # a barrier: returns after the engine thread handled the cancel's abort
        return used, pool.num_free, engine.num_in_flight

    used, free_after, in_flight = run(cancel, llm)
    assert used > 0
    assert free_after == pool.num_pages
    assert in_flight == 0


def test_abort_by_request_id_ends_the_stream(llm: LLM) -> None:
    pool = llm.engine.pool

    async def abort(engine: AsyncLLM) -> tuple[str | None, int]:
        stream = await engine.submit("Count slowly:", LONG, request_id="a")
        last = None
        async for d in stream:
            if d.completion_tokens == 1:
                await engine.abort("a")
                free = pool.num_free  # abort() returns once the pages are back
            last = d
        assert last is not None
        return last.finish_reason, free

    reason, free = run(abort, llm)
    assert reason == "abort"
    assert free == pool.num_pages


def test_a_stream_dropped_unread_is_aborted(llm: LLM) -> None:
    pool = llm.engine.pool

    async def drop(engine: AsyncLLM) -> tuple[int, int]:
        stream = await engine.submit("Never read:", LONG)
        del stream  # e.g. an HTTP response whose body never started
        await engine.abort("no-such-request")  # a barrier: earlier commands (the drop's abort) are done
        return pool.num_free, engine.num_in_flight

    assert run(drop, llm) == (pool.num_pages, 0)


def test_admission_is_bounded_and_recovers(llm: LLM) -> None:
    capacity = llm.engine.config.max_num_seqs + 2

    async def burst(engine: AsyncLLM) -> str:
        streams = [await engine.submit(p, LONG)
                   for p in (PROMPTS * 4)[:capacity]]
        with pytest.raises(QueueFullError):
            await engine.submit("one too many", GREEDY)
        for s in streams:
            s.abort()
        return "".join(d.text for d in await collect(engine, PROMPTS[0]))

    assert run(burst, llm, max_waiting=2) == llm.generate(PROMPTS[0], GREEDY)[0].text
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_bad_input_is_reported_and_the_engine_keeps_serving(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size

    async def bad_then_good(engine: AsyncLLM) -> str:
        with pytest.raises(InvalidParameterError):
            await collect(engine, [vocab + 5])
        with pytest.raises(InvalidParameterError):
            await collect(engine, 42)
        with pytest.raises(InvalidParameterError):
            await collect(engine, PROMPTS[0], SamplingParams(max_tokens=4, n=2))
        return "".join(d.text for d in await collect(engine, PROMPTS[3]))

    assert run(bad_then_good, llm) == llm.generate(PROMPTS[3], GREEDY)[0].text
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages


def test_requests_after_stop_are_refused(llm: LLM) -> None:
    async def after_stop() -> None:
        engine = AsyncLLM(engine=llm.engine)
        async with engine:
            pass
        with pytest.raises(EngineDeadError):
            await engine.submit(PROMPTS[0], GREEDY)

    asyncio.run(after_stop())
