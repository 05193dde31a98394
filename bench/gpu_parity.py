"""The GPU engine against the CPU reference engine on a real model with the same quantized weights.

    python bench/gpu_parity.py --model DIR_OR_GGUF [--text FILE] [--positions 1000] [--json OUT]

Teacher-forced over `positions` tokens of text: top-1 agreement and mean KL(CPU fp32 || GPU fp16)
of the next-token distributions, for one whole-prompt prefill and for 128-token chunks over the
cached prefix (the paged extend path); then greedy generation through LLM on both devices (the
engine loop with CUDA-graph decode). A .gguf model is imported to the halfbyte format first
(Q4_1 / Q4_0 / Q8_0 bit-exact). Issue 4's bar: top-1 >= 99%, mean KL <= 1e-3."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halfbyte.api import LLM, SamplingParams  # noqa: E402
from halfbyte.engine.scoring import score_tokens  # noqa: E402
from halfbyte.model.loader import load_pretrained  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def compare(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    ref_lp, out_lp = ref.float().log_softmax(-1), out.float().log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - out_lp)).sum(-1)
    return dict(top1=(ref.argmax(-1) == out.argmax(-1)).float().mean().item(),
                mean_kl=kl.mean().item(), max_kl=kl.max().item())


def batch_equality(model_dir: Path, device: str, requests: int, max_tokens: int) -> dict[str, int]:
    """Issue 5: `requests` prompts of mixed lengths run together (chunked prefill, prefix cache,
    continuous batching) against each run alone, greedy, fp16 on the device under test."""
    from halfbyte.engine.config import EngineConfig
    from halfbyte.engine.llm_engine import LLMEngine

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    words = "river stone lantern harbor cedar copper meadow signal orbit velvet quartz ember falcon prism".split()

    def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
        out: dict[str, list[int]] = {}
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params)
            out[f"r{i}"] = []
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return list(out.values())

    batched = LLMEngine(model_dir, device=device, dtype="float16",
                        config=EngineConfig(max_batch_tokens=256, max_num_seqs=requests, max_model_len=2048,
                                             kv_cache_tokens=65536))
    prompts = [batched.tokenizer.encode(f"Note {i}: " + " ".join(words[(i * 7 + j * (i % 5 + 1)) % len(words)]
                                                                  for j in range(3 + (i * 37) % 300)))
               for i in range(requests)]
    together = run(batched, prompts)
    del batched
    alone_engine = LLMEngine(model_dir, device=device, dtype="float16",
                             config=EngineConfig(enable_prefix_caching=False, max_model_len=2048, kv_cache_tokens=8192))
    alone = [run(alone_engine, [p])[0] for p in prompts]
    firsts = [next((i for i, (a, b) in enumerate(zip(t, s)) if a != b), len(t)) for t, s in zip(together, alone)]
    return dict(requests=requests, identical_requests=sum(t == s for t, s in zip(together, alone)),
                tokens=sum(len(t) for t in together), identical_tokens=sum(firsts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", default=str(ROOT / "docs" / "format.md"))
    ap.add_argument("--positions", type=int, default=1000)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch-requests", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="the device under test (cpu: a dry run of this script)")
    args = ap.parse_args()
    model_dir = Path(args.model)
    if model_dir.suffix == ".gguf":
        out = Path(tempfile.mkdtemp()) / "model"
        subprocess.run([sys.executable, "-m", "halfbyte.cli", "import", str(model_dir), str(out)], check=True)
        model_dir = out
    torch.backends.cuda.enable_cudnn_sdp(False)
    cpu = load_pretrained(model_dir, torch.float32, torch.device("cpu"), None, False)
    ids = cpu.tokenizer.encode(Path(args.text).read_text())[: args.positions]
    if len(ids) < args.positions:
        raise SystemExit(f"{args.text} has {len(ids)} tokens; {args.positions} asked for")
    ref = score_tokens(cpu.model, ids)
    del cpu
    gpu = load_pretrained(model_dir, torch.float16, torch.device(args.device), None, False)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result: dict[str, object] = dict(model=str(args.model), positions=len(ids), device=name, torch=torch.__version__)
    result["prefill"] = compare(ref, score_tokens(gpu.model, ids).cpu())
    result["chunked_128"] = compare(ref, score_tokens(gpu.model, ids, chunk=128).cpu())
    del gpu
    if args.device == "cuda":
        torch.cuda.empty_cache()
    prompt = [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    texts = {}
    for key, device, dtype in (("ref", "cpu", "float32"), ("test", args.device, "float16")):
        with LLM(model_dir, device=device, dtype=dtype, max_model_len=1024) as llm:
            texts[key] = llm.chat([prompt], params)[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(texts["ref"], texts["test"])) if a != b), len(texts["ref"]))
    result["greedy_generation"] = dict(tokens=len(texts["ref"]), identical_prefix=same)
    result["batch_equality"] = batch_equality(model_dir, args.device, args.batch_requests, args.gen_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\n{args.model}: {len(ids)} teacher-forced positions, CPU fp32 vs {result['device']} fp16")
    for name in ("prefill", "chunked_128"):
        r = result[name]
        print(f"{name:<14} top-1 {100 * r['top1']:.2f}%  mean KL {r['mean_kl']:.2e}  max KL {r['max_kl']:.2e}")  # type: ignore[index]
    print(f"greedy generation: first {same} of {len(texts['ref'])} tokens identical")
    b = result["batch_equality"]
    print(f"{b['requests']} mixed requests batched vs alone on {args.device}: {b['identical_requests']} identical, "
          f"{b['identical_tokens']}/{b['tokens']} tokens before the first difference")  # type: ignore[index]


if __name__ == "__main__":
    main()
