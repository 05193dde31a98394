"""The `convert`, `eval-ppl` and `eval-kl` subcommands; halfbyte/cli.py registers them with
add_subcommands(sub). Heavy imports happen inside the commands."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _cmd_convert(args: argparse.Namespace) -> int:
    from halfbyte.quant.convert import ConvertOptions, convert

    opts = ConvertOptions(
        bits=args.bits, group_size=args.group_size, head_bits=args.head_bits, act_order=args.act_order,
        calib_files=tuple(args.calib or ()), seq_len=args.calib_seq_len, num_windows=args.calib_windows,
        sample_prompts=args.calib_samples,
        show_progress=sys.stderr.isatty() or args.progress, measure_cache=args.measure_cache,
        clip_search=args.clip_search, tune_steps=0 if not args.tune else args.tune_steps, asymmetric=args.asymmetric,
        rotate=args.rotate, rotation_seed=args.rotation_seed,
    )
    result = convert(args.model, args.out, opts)
    print(
        f"wrote {result.out_dir}: {result.bits_per_weight:.4f} bits per weight over the decoder layers "
        f"(budget {args.bits})"
        + (f", {result.total_bits_per_weight:.4f} with the head" if args.head_bits else "")
        + f", {result.seconds:.0f} s"
    )
    return 0


def _cmd_eval_ppl(args: argparse.Namespace) -> int:
    from halfbyte.quant.evaluate import evaluate_perplexity

    r = evaluate_perplexity(args.model, args.text, ctx=args.ctx, windows=args.windows, show_progress=sys.stderr.isatty())
    print(f"windows: {r.windows}, tokens scored: {r.tokens}, mean NLL: {r.mean_nll:.5f}")
    print(f"perplexity: {r.perplexity:.4f}")
    return 0


def _cmd_eval_kl(args: argparse.Namespace) -> int:
    from halfbyte.quant.evaluate import evaluate_kl

    r = evaluate_kl(args.model, args.ref, args.text, ctx=args.ctx, windows=args.windows, show_progress=sys.stderr.isatty())
    print(f"windows: {r.windows}, positions: {r.tokens}")
    print(f"mean KL(ref || model): {r.mean_kl:.6f} nats")
    print(f"top-1 agreement: {r.top1_agreement:.4f}")
    return 0


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def add_subcommands(sub: Any) -> None:
    """Register convert, eval-ppl and eval-kl on an argparse subparsers object."""
    conv = sub.add_parser(
        "convert", help="quantize a Hugging Face checkpoint to a bits-per-weight budget (GPTQ, measured mixed bits)"
    )
    conv.add_argument("--model", required=True, help="float model directory (or Hub name)")
    conv.add_argument("--out", required=True, help="output directory (must not exist; OUT.partial holds resumable state)")
    conv.add_argument("--bits", type=float, required=True, help="bits-per-weight budget over the decoder layers, 2-8 (e.g. 4.25)")
    conv.add_argument("--calib", action="append", default=None, metavar="FILE",
                      help="calibration text: .txt, .jsonl (\"text\" field) or .parquet (repeatable); default: text sampled "
                      "from the model, which needs no download but calibrates worse than real text below 4 bpw")
    conv.add_argument("--calib-seq-len", type=_positive_int, default=512, help="tokens per calibration window")
    conv.add_argument("--calib-windows", type=_positive_int, default=32, help="number of calibration windows")
    conv.add_argument("--calib-samples", type=_positive_int, default=None, metavar="N",
                      help="without --calib: answers the model writes as its calibration text (default: 32; 96 when "
                      "the conversion tunes; 192 with --calib-windows 64 --tune-steps 180 measured better still)")
    conv.add_argument("--group-size", type=int, default=None, help="fix the group size (32, 64 or 128); default: chosen per layer")
    conv.add_argument("--head-bits", type=int, default=None, help="also quantize the LM head at this many bits (default: dense)")
    conv.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                      help="allow settings that quantize columns in order of decreasing input energy (default: on)")
    conv.add_argument("--clip-search", action=argparse.BooleanOptionalAction, default=True,
                      help="search clipped group ranges for the least energy-weighted rounding error (default: on)")
    conv.add_argument("--asymmetric", action=argparse.BooleanOptionalAction, default=None,
                      help="quantize each matrix against the float model's outputs rather than the quantized model's "
                      "own, so each layer corrects the error of the layers before it (default: on below 4 bits per weight)")
    conv.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=False,
                      help="quantize the model seen through random orthogonal rotations of its residual stream and "
                      "value heads (same function, outlier columns spread out; writes an untied head). Helps GPTQ on "
                      "float weights; hurts weights that already sit on a low-bit grid (a model from a GGUF)")
    conv.add_argument("--rotation-seed", type=int, default=0, metavar="N", help="seed of the rotations (default 0)")
    conv.add_argument("--measure-cache", default=None, metavar="DIR",
                      help="keep calibration and measurements in DIR and reuse them when converting the same model to other budgets")
    conv.add_argument("--tune", action=argparse.BooleanOptionalAction, default=True,
                      help="after quantizing, tune norms, scales and mins end to end on the calibration windows "
                      "(default: on below 4 bits per weight for models up to 0.3B decoder weights, where it pays and fits; "
                      "--no-tune skips it, --tune-steps N forces it)")
    conv.add_argument("--tune-steps", type=_positive_int, default=None, metavar="N",
                      help="end-to-end tuning steps, one calibration window each (default: 90 below 4 bpw for models up to "
                      "0.3B decoder weights, which then sample 96 calibration answers instead of 32; else 0)")
    conv.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is not a terminal")
    conv.set_defaults(func=_cmd_convert)

    ppl = sub.add_parser("eval-ppl", help="perplexity of a model on a text file")
    ppl.add_argument("--model", required=True)
    ppl.add_argument("--text", required=True, help="UTF-8 text file")
    ppl.add_argument("--ctx", type=_positive_int, default=1024, help="tokens per window")
    ppl.add_argument("--windows", type=_positive_int, default=None, help="score only the first N windows")
    ppl.set_defaults(func=_cmd_eval_ppl)

    kl = sub.add_parser("eval-kl", help="KL divergence of a model's next-token distributions from a reference's")
    kl.add_argument("--model", required=True, help="the model under test (e.g. quantized)")
    kl.add_argument("--ref", required=True, help="the reference model")
    kl.add_argument("--text", required=True, help="UTF-8 text file")
    kl.add_argument("--ctx", type=_positive_int, default=1024)
    kl.add_argument("--windows", type=_positive_int, default=None)
    kl.set_defaults(func=_cmd_eval_kl)
