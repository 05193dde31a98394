"""The OpenAI-compatible server, as a real process on a loopback port, driven by the official
`openai` client (and raw HTTP where the client would hide what is checked).

Expected texts come from the server itself: the same greedy request, alone, is the reference."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from halfbyte.io.tokenizer import Tokenizer

API_KEY = "test-key"
CHAT = [{"role": "user", "content": "Name three colors."}]
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    url: str
    model: str
    process: subprocess.Popen[bytes]

    def client(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=300)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model_dir: Path, *extra: str) -> Iterator[Server]:
    port = _free_port()
    cmd = [sys.executable, "-m", "halfbyte.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--api-key", API_KEY, "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.3)
        model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
        yield Server(url, model, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(default_model_dir: Path) -> Iterator[Server]:
    # capacity 8 in flight: 4 decoding + 4 waiting
    yield from start_server(default_model_dir, "--max-num-seqs", "4", "--max-waiting", "4", "--kv-cache-tokens", "8192")


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer(default_model_dir)


def test_models_and_health(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_chat_completion_and_its_stream_agree(server: Server, tokenizer: Tokenizer) -> None:
    client = server.client()
    full = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert full.usage is not None
    assert full.usage.completion_tokens == 8
    assert full.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))

    chunks = list(client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1, "streamed in pieces"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stops_at_max_tokens(server: Server, tokenizer: Tokenizer) -> None:
    prompt = "The three primary colors are"
    out = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.choices[0].text == tokenizer.decode(tokenizer.encode(out.choices[0].text, add_special_tokens=False))


def test_stop_string_cuts_the_text(server: Server) -> None:
    client = server.client()
    prompt = "List the days of the week: Monday,"
    free = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"the reference text is too short to cut: {text!r}"
    cut = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_n_choices(server: Server) -> None:
    client = server.client()
    out = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=6, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") and c.message.content is not None for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens <= 3 * 6
    assert out.usage.completion_tokens > 6, "three choices generate more than one choice's tokens"

    stream = client.completions.create(model=server.model, prompt="Hello", max_tokens=4, temperature=0, n=2, stream=True)
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert texts[0] == texts[1] != "", "greedy choices agree"


def test_extra_body_sampling_fields(server: Server) -> None:
    client = server.client()
    greedy = client.completions.create(model=server.model, prompt="Paris is", max_tokens=6, temperature=0)
    # top_k=1 is greedy at any temperature: a property the field must have to be applied at all
    top1 = client.completions.create(
        model=server.model, prompt="Paris is", max_tokens=6, temperature=1.5, extra_body={"top_k": 1, "min_p": 0.05}
    )
    assert top1.choices[0].text == greedy.choices[0].text
    neutral = client.completions.create(
        model=server.model, prompt="Paris is", max_tokens=6, temperature=0, extra_body={"repetition_penalty": 1.0}
    )
    assert neutral.choices[0].text == greedy.choices[0].text


def test_completion_logprobs(server: Server) -> None:
    out = server.client().completions.create(model=server.model, prompt="Paris is", max_tokens=4, temperature=0,
                                             logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0
        assert logprob == max(top.values()) and top[token] == logprob  # greedy picks the most likely token


def test_chat_logprobs_streamed_and_whole_agree(server: Server) -> None:
    client = server.client()
    kwargs = dict(model=server.model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == whole.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)
    streamed = [t for chunk in client.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
                for c in chunk.choices if c.logprobs and c.logprobs.content for t in c.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_logit_bias_bans_the_greedy_token(server: Server, tokenizer: Tokenizer) -> None:
    client = server.client()
    free = client.completions.create(model=server.model, prompt="Paris is", max_tokens=1, temperature=0, logprobs=1)
    first = free.choices[0].logprobs.tokens[0]  # type: ignore[union-attr,index]
    ids = tokenizer.encode(first, add_special_tokens=False)
    assert len(ids) == 1, f"{first!r} is not one token alone"
    banned = client.completions.create(model=server.model, prompt="Paris is", max_tokens=1, temperature=0,
                                       logit_bias={str(ids[0]): -100}, logprobs=1)
    assert banned.choices[0].logprobs.tokens[0] != first  # type: ignore[union-attr,index]


def test_bad_api_key(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(key="wrong").chat.completions.create(model=server.model, messages=CHAT, max_tokens=2)
    assert e.value.status_code == 401


def test_unknown_model(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        server.client().chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 404
    assert isinstance(e.value.body, dict) and e.value.body.get("code") == "model_not_found"


def test_malformed_json(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]


@pytest.mark.parametrize("fields", [
    {"temperature": 5.0}, {"top_p": 0.0}, {"max_tokens": 0}, {"n": 0}, {"top_k": -3}, {"min_p": 1.5},
    {"presence_penalty": 3.0}, {"stop": [""]},
])
def test_out_of_range_parameters(server: Server, fields: dict[str, object]) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=server.model, messages=CHAT, extra_body=fields)
    assert e.value.status_code == 400
    assert isinstance(e.value.body, dict) and e.value.body.get("message")


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context_is_a_400(server: Server, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as e:  # a stream too: rejected before any event is sent
        server.client().completions.create(model=server.model, prompt="word " * 9000, max_tokens=2, stream=stream)
    assert isinstance(e.value.body, dict) and "tokens" in str(e.value.body.get("message"))


def test_disconnect_mid_stream_frees_the_request(server: Server) -> None:
    before = server.metrics()
    body = {"model": server.model, "prompt": "Count to one thousand:", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text": ""' not in line:
                break  # got a token: now hang up
    deadline = time.monotonic() + 120  # a hang guard: the abort lands within a step or two
    while True:
        m = server.metrics()
        if m["halfbyte_requests_in_flight"] == 0 and m["halfbyte_kv_cache_pages_free"] == m["halfbyte_kv_cache_pages_total"]:
            break
        assert time.monotonic() < deadline, f"the disconnected request still holds the engine: {m}"
        time.sleep(0.2)
    assert m["halfbyte_requests_aborted"] == before["halfbyte_requests_aborted"] + 1
    assert m["halfbyte_generation_tokens_total"] < before["halfbyte_generation_tokens_total"] + 400


def test_burst_beyond_the_queue_gets_503_then_serves(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI) -> str:
        try:
            stream = await client.completions.create(
                model=server.model, prompt="Write a poem:", max_tokens=48, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )
            n = 0
            async for chunk in stream:
                n += sum(1 for c in chunk.choices if c.finish_reason == "length")
            return "done" if n == 1 else "incomplete"
        except openai.APIStatusError as e:
            return f"status {e.status_code}"

    async def burst() -> list[str]:
        client = server.async_client()
        results = await asyncio.gather(*(one(client) for _ in range(16)))
        await client.close()
        return list(results)

    results = asyncio.run(burst())
    assert set(results) <= {"done", "status 503"}, results
    assert results.count("status 503") >= 1 and results.count("done") >= 1, results
    after = server.client().completions.create(model=server.model, prompt="Hi", max_tokens=3, temperature=0)
    assert after.choices[0].finish_reason == "length"
    m = server.metrics()
    assert m['halfbyte_requests_total{endpoint="completions",outcome="rejected"}'] == results.count("status 503")


def test_metrics_exposition(server: Server) -> None:
    server.client().completions.create(model=server.model, prompt="Hi", max_tokens=3, temperature=0)
    m = server.metrics()
    for name in ("halfbyte_queue_depth", "halfbyte_kv_cache_usage_ratio", "halfbyte_prefix_cache_hit_rate",
                 "halfbyte_prompt_tokens_total", "halfbyte_generation_tokens_total"):
        assert name in m
    assert m["halfbyte_time_to_first_token_seconds_count"] >= 1
    assert m["halfbyte_inter_token_latency_seconds_count"] >= 2  # 3 tokens: two gaps
    assert m["halfbyte_generation_tokens_total"] >= 3


@pytest.mark.slow
def test_64_concurrent_streams_match_their_solo_text(default_model_dir: Path) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    for srv in start_server(default_model_dir, "--max-num-seqs", "64", "--kv-cache-tokens", "8192"):
        client = srv.client()
        solo = {p: client.completions.create(model=srv.model, prompt=p, max_tokens=8, temperature=0).choices[0].text
                for p in prompts}

        async def stream(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
            text, reason = "", None
            async for chunk in await aclient.completions.create(
                model=srv.model, prompt=prompt, max_tokens=8, temperature=0, stream=True
            ):
                for c in chunk.choices:
                    text += c.text
                    reason = c.finish_reason or reason
            return text, reason

        async def all_streams() -> list[tuple[str, str | None]]:
            aclient = srv.async_client()
            out = await asyncio.gather(*(stream(aclient, prompts[i % 8]) for i in range(64)))
            await aclient.close()
            return list(out)

        results = asyncio.run(all_streams())
        assert [text for text, _ in results] == [solo[prompts[i % 8]] for i in range(64)]
        assert all(reason in ("stop", "length") for _, reason in results)
        assert srv.metrics()["halfbyte_requests_in_flight"] == 0


def test_prefix_cache_hits_show_in_metrics(server: Server) -> None:
    import dataclasses

    from halfbyte.engine.config import EngineConfig

    if "enable_prefix_caching" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        pytest.skip("this engine has no prefix cache")
    prompt = "Here is a long shared system preamble that many requests repeat word for word. " * 4
    client = server.client()
    client.completions.create(model=server.model, prompt=prompt + "First", max_tokens=2, temperature=0)
    before = server.metrics()
    client.completions.create(model=server.model, prompt=prompt + "Second", max_tokens=2, temperature=0)
    after = server.metrics()
    assert after["halfbyte_prefix_cache_hit_tokens"] >= before["halfbyte_prefix_cache_hit_tokens"] + 32
    assert after["halfbyte_prefix_cache_hit_rate"] > 0
