"""Load on the OpenAI-compatible server: C concurrent streaming clients, R requests each.

Usage: python bench/serve_load.py [--model DIR] [--clients 64] [--requests-per-client 4]
       [--max-tokens 128] [--prompt-words 200] [--url http://HOST:PORT] [--json OUT.json]
       [-- extra `halfbyte serve` flags, e.g. --max-num-seqs 128 --dtype float16]

Without --url it starts `halfbyte serve` itself on a free loopback port (and stops it after).
Reports output tokens/s over the whole run, requests/s, and time-to-first-token and
inter-token latency percentiles as the clients saw them (ignore_eos: every request generates
exactly --max-tokens tokens, so runs are comparable)."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "halfbyte.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run_load(url: str, clients: int, per_client: int, max_tokens: int, prompt_words: int) -> dict[str, float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        prompt = f"Request {i}. " + " ".join(f"word{(i * 7 + j) % 997}" for j in range(prompt_words))
        start = last = time.perf_counter()
        first = True
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                (ttft if first else itl).append(now - last)
                first = False
                last = now
            if chunk.usage is not None:
                tokens += chunk.usage.completion_tokens

    async def worker(c: int) -> None:
        for r in range(per_client):
            await one(c * per_client + r)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in range(clients)))
    elapsed = time.perf_counter() - t0
    await client.close()
    return {
        "clients": clients, "requests": clients * per_client, "seconds": elapsed,
        "output_tokens_per_s": tokens / elapsed, "requests_per_s": clients * per_client / elapsed,
        "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p95_ms": 1e3 * pct(ttft, 0.95),
        "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p95_ms": 1e3 * pct(itl, 0.95),
        "itl_mean_ms": 1e3 * statistics.fmean(itl) if itl else float("nan"),
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--url", default=None, help="an already running server")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, extra)
    try:
        result = asyncio.run(run_load(url, args.clients, args.requests_per_client, args.max_tokens, args.prompt_words))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    for key, value in result.items():
        print(f"{key:>22}: {value:.2f}" if isinstance(value, float) else f"{key:>22}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
