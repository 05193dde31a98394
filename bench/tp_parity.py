"""Issue 9: tensor_parallel_size N on CUDA (NCCL, one GPU per rank) against one process, through
the engine: greedy continuations and teacher-forced logits, fp16, on a random 4-bit model of
SmolLM2's shape (9 heads: uneven head split at 2 ranks; act-order on the row-parallel matrices),
built with the same helpers as tests/test_tensor_parallel.py (which checks the same on the CPU).

Usage (a machine with >= 2 GPUs; the tokenizer files of the default model in --tokenizer-dir,
here: mkdir -p .evaltext/tokenizer && cp ~/.cache/halfbyte/models/SmolLM2-135M-Instruct/{tokenizer.json,
tokenizer_config.json,generation_config.json} .evaltext/tokenizer/, then carry .evaltext):
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 bench/tp_parity.py --sizes 2 --json OUT
Fewer GPUs than a size asks for: that size is reported NOT RUN, never as passed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halfbyte.engine.llm_engine import LLMEngine  # noqa: E402
from halfbyte.engine.scoring import score_tokens  # noqa: E402
from tests.test_tensor_parallel import PROMPTS, _greedy, make_random_llama, quantize_dir  # noqa: E402

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)


def run(model_dir: Path, tp: int | None, tokens: int, device: str, dtype: str) -> tuple[torch.Tensor, list[list[int]], list[dict]]:
    engine = LLMEngine(model_dir, dtype=dtype, device=device, tensor_parallel_size=tp)
    try:
        logits = score_tokens(engine.model, PROMPTS[0], chunk=16).cpu()
        return logits, _greedy(engine, tokens), (engine.tp.memory if engine.tp is not None else [])
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--tokenizer-dir", default=".evaltext/tokenizer")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (gloo, fp32)")
    ap.add_argument("--dtype", default=None, help="float16 (CUDA default) or float32 (with HALFBYTE_REFERENCE=1 on CUDA: "
                    "the torch references, so only the split and NCCL differ from one process)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    work = Path(tempfile.mkdtemp())
    src = make_random_llama(work / "src", Path(args.tokenizer_dir), **SMOLLM2_SHAPE)
    model_dir = quantize_dir(src, work / "q4", bits=4, group=32, act_order=True)
    ref_logits, ref_greedy, _ = run(model_dir, None, args.tokens, args.device, dtype)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    result: dict[str, object] = dict(device=torch.cuda.get_device_name() if gpus else args.device, gpus=gpus,
                                     torch=torch.__version__, dtype=dtype,
                                     reference_kernels=os.environ.get("HALFBYTE_REFERENCE") == "1", model="random 4-bit g32, SmolLM2 shape, act-order",
                                     prompts=len(PROMPTS), tokens_per_prompt=args.tokens, sizes={})
    for tp in (int(s) for s in args.sizes.split(",")):
        if args.device == "cuda" and tp > gpus:
            result["sizes"][tp] = {"not_run": f"{gpus} GPUs"}  # type: ignore[index]
            print(f"tensor_parallel_size {tp}: NOT RUN ({gpus} GPUs)")
            continue
        logits, greedy, memory = run(model_dir, tp, args.tokens, args.device, dtype)
        same = sum(a == b for a, b in zip(greedy, ref_greedy))
        row = dict(greedy_identical_prompts=same, max_abs_logit_diff=float((logits - ref_logits).abs().max()),
                   top1_agreement=float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
                   memory=memory, greedy=greedy, reference_greedy=ref_greedy)
        result["sizes"][tp] = row  # type: ignore[index]
        print(f"tensor_parallel_size {tp} vs one process: greedy identical for {same}/{len(PROMPTS)} prompts "
              f"x {args.tokens} tokens; teacher-forced logits max |diff| {row['max_abs_logit_diff']:.3g}, "
              f"top-1 {100 * row['top1_agreement']:.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
