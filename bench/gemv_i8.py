"""gemv_w4_i8 (x as int8 planes, dp4a) beside gemv_w4 (fp16x2) at one row, same call, same harness
as bench/gemv.py (CUDA graph, weights rotated past L2, PDL): the GEMV on prepared planes, x's
quantization alone, and the two chained (what a call costs when no producer writes the planes).

Usage: python bench/gemv_i8.py [--shapes 8b.qkv,...] [--quick] [--json OUT]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv import SHAPES, TP2_SHAPES, copy_bandwidth, graph_time, make_weight, rotated_time  # noqa: E402

from halfbyte.kernels import gemv_w4, gemv_w4_i8  # noqa: E402
from halfbyte.kernels.quant_matmul import quant_matmul_ref  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="a small config grid")
    ap.add_argument("--nosplit", action="store_true",
                    help="only configs without a K split, 8-32 columns per program over the whole K in tiles of 128 or "
                    "256 word rows "
                    "(gemv_w4's --sweep-nosplit winners on the 8B attention shapes)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    known = {**SHAPES, **TP2_SHAPES}
    copy_gbs = copy_bandwidth()
    if args.nosplit:
        grid = [dict(block_n=bn, block_kw=kw, split_k=1, num_warps=w)
                for bn, kw, w in itertools.product((8, 16, 32), (128, 256), (4, 8)) if 8 <= bn * kw // (32 * w) <= 64]
    elif args.quick:
        grid = [dict(block_n=bn, block_kw=kw, split_k=sk, num_warps=w)
                for bn, kw, sk, w in itertools.product((64, 128, 256), (16, 32), (None, 8), (4,))]
    else:
        grid = [dict(block_n=bn, block_kw=kw, split_k=sk, num_warps=w)
                for bn, kw, sk, w in itertools.product((64, 128, 256), (16, 32, 64), (None, 8, 16), (4, 8))
                if bn * kw <= 8192 and (w == 4 and kw < 64 or w == 8 and bn * kw >= 4096)]
    rows = []
    for name in args.shapes.split(","):
        n, k = known[name]
        copies = [make_weight(n, k, 4, args.group)]
        nbytes = copies[0][0].numel() * 4 + copies[0][1].numel() * 2 + copies[0][2].numel() * 2
        copies += [make_weight(n, k, 4, args.group) for _ in range(max(0, -(-240_000_000 // nbytes) - 1))]
        qw, sc, mn = copies[0]
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        ref = quant_matmul_ref(x, qw, sc, mn, 4, args.group)
        err_of = lambda out: ((out.float() - ref).norm() / ref.norm()).item()  # noqa: E731
        t_w4 = rotated_time(lambda q, s_, m_: gemv_w4.gemv_w4(x, q, s_, m_, args.group), copies)
        err_w4 = err_of(gemv_w4.gemv_w4(x, qw, sc, mn, args.group))
        xp = gemv_w4_i8.quantize_x(x, args.group)
        ref_xp = gemv_w4_i8.quantize_x_ref(x, args.group)
        if not (torch.equal(xp.planes, ref_xp.planes) and torch.equal(xp.scales, ref_xp.scales)):
            raise SystemExit(f"{name}: quantize_x differs from quantize_x_ref")
        t_quant = graph_time(lambda: gemv_w4_i8.quantize_x(x, args.group))
        trials = []
        best: tuple[dict[str, Any], float, float] | None = None
        for cfg in grid:
            try:
                err = err_of(gemv_w4_i8.gemv_w4_i8_planes(xp, qw, sc, mn, **cfg))
                if not err <= 1e-3:
                    print(f"  {name} {cfg}: rel err {err:.2e}", file=sys.stderr)
                    continue
                t = rotated_time(lambda q, s_, m_, cfg=cfg: gemv_w4_i8.gemv_w4_i8_planes(xp, q, s_, m_, **cfg), copies)
            except Exception as e:  # registers, shared memory
                print(f"  {name} {cfg}: {type(e).__name__} {str(e)[-300:]}", file=sys.stderr)
                continue
            trials.append(dict(cfg=cfg, us=t * 1e6))
            if best is None or t < best[1]:
                best = (cfg, t, err)
        if best is None:
            raise SystemExit(f"{name}: every gemv_w4_i8 config failed (see stderr)")
        cfg, t_i8, err_i8 = best
        t_chain = rotated_time(lambda q, s_, m_: gemv_w4_i8.gemv_w4_i8(x, q, s_, m_, args.group, **cfg), copies)
        rows.append(dict(shape=name, n=n, k=k, bytes=nbytes, w4_us=t_w4 * 1e6, w4_err=err_w4, i8_us=t_i8 * 1e6,
                         i8_err=err_i8, i8_config=cfg, quant_us=t_quant * 1e6, chain_us=t_chain * 1e6,
                         w4_pct_copy=100 * nbytes / t_w4 / 1e9 / copy_gbs, i8_pct_copy=100 * nbytes / t_i8 / 1e9 / copy_gbs,
                         trials=trials))
        del copies
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, group=args.group, copy_gbs=copy_gbs, rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\ngemv_w4_i8 vs gemv_w4, one row, 4-bit g{args.group}; copy {copy_gbs:.0f} GB/s; {result['device']}")
    print(f"{'shape':<12}{'w4 us':>8}{'w4 %copy':>9}{'i8 us':>8}{'i8 %copy':>9}{'quant us':>9}{'q+i8 us':>9}"
          f"{'w4 err':>9}{'i8 err':>9}  i8 config")
    for r in rows:
        print(f"{r['shape']:<12}{r['w4_us']:>8.1f}{r['w4_pct_copy']:>9.1f}{r['i8_us']:>8.1f}{r['i8_pct_copy']:>9.1f}"
              f"{r['quant_us']:>9.1f}{r['chain_us']:>9.1f}{r['w4_err']:>9.1e}{r['i8_err']:>9.1e}  {r['i8_config']}")


if __name__ == "__main__":
    main()
