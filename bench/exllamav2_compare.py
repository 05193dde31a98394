"""exllamav2 0.3.2 beside halfbyte in the same GPU run (issue 4's comparison).

Usage (GPU machine; the exllamav2 wheel travels in .whl/, bench/gpu_check.sh installs it):
  here:  python3 -m pip download --no-deps exllamav2==0.3.2 -d .whl   (pure Python, 1.5 MB)
  there: STEPS="decode exl2" bash bench/gpu_check.sh   (carry .whl; the extension builds ~2 min)
  python3 bench/exllamav2_compare.py [--shape llama3-8b] [--json OUT] [--halfbyte-json DECODE.json]
Builds a random 4-bit GPTQ checkpoint (group 128, sym, no act-order) of the named shape in /tmp,
times exllamav2 on it (cuDNN SDPA off, as GPU.md measured it): prefill of 2,047 tokens (best of
3) and batch-1 decode at context 128 and 2048 (128 steps, greedy fed back). With --halfbyte-json
(bench/decode.py --json of the same shape, same call) it prints halfbyte / exllamav2.
If CUDA or exllamav2 is missing it says NOT RUN and writes {"not_run": reason}: a comparison
that could not run is never reported as passed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_model import SHAPES  # noqa: E402

GROUP = 128


def write_gptq_checkpoint(path: Path, shape: dict[str, Any]) -> None:
    """Random values, real shapes: qweight [K/8, N] int32, qzeros all 8, scales [K/G, N] fp16, g_idx."""
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_layers"]
    heads, kv_heads, vocab, hd = shape["num_heads"], shape["num_kv_heads"], shape["vocab_size"], shape["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def linear(prefix: str, n: int, k: int, out: dict[str, torch.Tensor]) -> None:
        out[prefix + ".qweight"] = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda",
                                                 generator=gen).cpu()
        out[prefix + ".qzeros"] = torch.full((k // GROUP, n // 8), 0x77777777, dtype=torch.int32)
        out[prefix + ".scales"] = (torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.004 + 0.002).half().cpu()
        out[prefix + ".g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP

    dense = {"model.embed_tokens.weight": (torch.randn(vocab, h, device="cuda", generator=gen) * 0.02).half().cpu(),
             "lm_head.weight": (torch.randn(vocab, h, device="cuda", generator=gen) * 0.02).half().cpu(),
             "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    save_file(dense, str(path / "model-00000.safetensors"))
    for i in range(layers):
        t: dict[str, torch.Tensor] = {}
        p = f"model.layers.{i}"
        t[p + ".input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        t[p + ".post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        for name, n, k in (("self_attn.q_proj", heads * hd, h), ("self_attn.k_proj", kv_heads * hd, h),
                           ("self_attn.v_proj", kv_heads * hd, h), ("self_attn.o_proj", h, heads * hd),
                           ("mlp.gate_proj", inter, h), ("mlp.up_proj", inter, h), ("mlp.down_proj", h, inter)):
            linear(f"{p}.{name}", n, k, t)
        save_file(t, str(path / f"model-{i + 1:05d}.safetensors"))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=h, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=shape["rope_theta"],
                  torch_dtype="float16", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu",
                  quantization_config=dict(quant_method="gptq", bits=4, group_size=GROUP, desc_act=False, sym=True))
    (path / "config.json").write_text(json.dumps(config))


def time_exllamav2(path: Path) -> dict[str, float]:
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config  # type: ignore[import-not-found]

    config = ExLlamaV2Config(str(path))
    config.max_seq_len = 4096
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=4096, lazy=True)
    model.load_autosplit(cache)
    ids = torch.randint(0, 32000, (1, 2048))
    res: dict[str, float] = {}
    times = []
    for _ in range(4):  # the first is warm-up
        cache.current_seq_len = 0
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.forward(ids[:, :-1], cache, preprocess_only=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    res["prefill 2047 tok/s"] = 2047 / min(times[1:])
    for ctx in (128, 2048):
        cache.current_seq_len = 0
        model.forward(ids[:, : ctx - 1], cache, preprocess_only=True)
        tok = ids[:, ctx - 1 : ctx]
        for _ in range(5):  # warm-up, then rewind
            model.forward(tok, cache)
            cache.current_seq_len -= 1
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(128):
            logits = model.forward(tok, cache)
            tok = logits[:, -1:, :].argmax(-1).cpu().clamp(max=32000)
        torch.cuda.synchronize()
        res[f"decode ctx {ctx} tok/s"] = 128 / (time.perf_counter() - t)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--halfbyte-json", default=None, help="bench/decode.py --json of the same shape, same run")
    args = ap.parse_args()

    def done(result: dict[str, Any]) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))

    if not torch.cuda.is_available():
        print("exllamav2: NOT RUN (no CUDA device)")
        return done({"not_run": "no CUDA device"})
    os.environ.setdefault("MAX_JOBS", "16")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    torch.backends.cuda.enable_cudnn_sdp(False)  # GPU.md: cuDNN SDPA costs ~2 ms of CPU per call
    t = time.perf_counter()
    try:
        import exllamav2  # type: ignore[import-not-found]
        from exllamav2 import ext  # type: ignore[import-not-found]  # noqa: F401  (builds its CUDA extension)
    except Exception as e:  # not installed, or its extension did not build
        reason = f"exllamav2 import/build failed: {type(e).__name__}: {str(e)[-300:]}"
        print(f"exllamav2: NOT RUN ({reason})")
        return done({"not_run": reason})
    build_s = time.perf_counter() - t
    path = Path("/tmp") / f"gptq_random_{args.shape}"
    t = time.perf_counter()
    write_gptq_checkpoint(path, SHAPES[args.shape])
    write_s = time.perf_counter() - t
    exl = time_exllamav2(path)
    result: dict[str, Any] = dict(shape=args.shape, exllamav2=getattr(exllamav2, "__version__", "?"), build_s=build_s,
                                  checkpoint_s=write_s, device=torch.cuda.get_device_name(), torch=torch.__version__,
                                  exllamav2_rows=exl)
    ours = json.loads(Path(args.halfbyte_json).read_text())["rows"] if args.halfbyte_json and Path(args.halfbyte_json).exists() else {}
    pairs = {"decode ctx 128 tok/s": "decode ctx 128 graph", "decode ctx 2048 tok/s": "decode ctx 2048 graph",
             "prefill 2047 tok/s": "prefill 2048 tok/s"}
    result["ratios"] = {k: ours[v] / exl[k] for k, v in pairs.items() if v in ours}
    done(result)
    print(f"\nexllamav2 {result['exllamav2']} vs halfbyte, {args.shape} 4-bit g{GROUP}, {result['device']} "
          f"(build {build_s:.0f} s, checkpoint {write_s:.0f} s)")
    for k, v in exl.items():
        mine = ours.get(pairs[k])
        print(f"{k:<24}exllamav2 {v:>10.1f}   halfbyte {mine if mine is not None else float('nan'):>10.1f}   "
              f"ratio {result['ratios'].get(k, float('nan')):.2f}")


if __name__ == "__main__":
    main()
