"""mma_w4 (repacked weights, tensor cores for 1-16 rows) beside gemv_w4 (1 row) and gemm_w4
(16 rows) in the same run: us per call with weights rotated past L2, chained in a CUDA graph
with PDL (bench/gemv.py's harness), % of the measured copy bandwidth, 16 rows over 1 row.

    python bench/mma_gemv.py [--shapes 8b.qkv,...] [--json OUT]

Each mma_w4 config (warps x split-K) is first checked against the torch reference (rel. err
<= 1e-3) and only then timed; the best per shape and row count is reported."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemv import SHAPES, TP2_SHAPES, copy_bandwidth, make_weight, rotated_time  # noqa: E402
from halfbyte.kernels import gemm_w4, gemv_w4, mma_w4  # noqa: E402
from halfbyte.kernels.quant_matmul import quant_matmul_ref  # noqa: E402


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    known = {**SHAPES, **TP2_SHAPES}
    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s")
    results = []
    g = args.group
    for name in args.shapes.split(","):
        n, k = known[name]
        copies = [make_weight(n, k, 4, g)]
        nbytes = copies[0][0].numel() * 4 + copies[0][1].numel() * 2 + copies[0][2].numel() * 2
        copies += [make_weight(n, k, 4, g) for _ in range(max(0, -(-240_000_000 // nbytes) - 1))]
        packed = [(mma_w4.repack(q, k), s, m) for q, s, m in copies]
        assert torch.equal(mma_w4.unrepack(packed[0][0], k), copies[0][0])
        row: dict[str, Any] = dict(shape=name, n=n, k=k, bytes=nbytes)
        for m_rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m_rows, k, device="cuda", dtype=torch.float16)
            q0, s0, mn0 = copies[0]
            ref = quant_matmul_ref(x, q0, s0, mn0, 4, g)
            if m_rows == 1:
                old = lambda q, s_, m_: gemv_w4.gemv_w4(x, q, s_, m_, g)  # noqa: E731
            else:
                old = lambda q, s_, m_: gemm_w4.gemm_w4(x, q, s_, m_, g)  # noqa: E731
            err_old = rel(old(q0, s0, mn0), ref)
            t_old = rotated_time(old, copies)
            best = None
            trials = []
            for w, sk in itertools.product((int(v) for v in args.warps.split(",")), (int(v) for v in args.splits.split(","))):
                fn = lambda q, s_, m_, w=w, sk=sk: mma_w4.mma_w4(x, q, s_, m_, g, num_warps=w, split_k=sk)  # noqa: E731
                try:
                    out = torch.full((m_rows, n), float("nan"), device="cuda", dtype=torch.float16)
                    mma_w4.mma_w4(x, packed[0][0], s0, mn0, g, num_warps=w, split_k=sk, out=out)
                    err = rel(out, ref)
                    if not err <= 1e-3:
                        print(f"  {name} rows {m_rows} warps {w} split {sk}: rel err {err:.3e}", file=sys.stderr)
                        trials.append(dict(warps=w, split=sk, rel_err=err, us=None))
                        continue
                    t = rotated_time(fn, packed)
                except Exception as e:
                    print(f"  {name} warps {w} split {sk}: {type(e).__name__} {str(e)[-800:]}", file=sys.stderr)
                    continue
                trials.append(dict(warps=w, split=sk, rel_err=err, us=t * 1e6))
                if best is None or t < best[0]:
                    best = (t, w, sk, err)
            row[f"old_{m_rows}_us"] = t_old * 1e6
            row[f"old_{m_rows}_err"] = err_old
            row[f"mma_{m_rows}_trials"] = trials
            if best:
                row[f"mma_{m_rows}_us"] = best[0] * 1e6
                row[f"mma_{m_rows}_cfg"] = [best[1], best[2]]
                row[f"mma_{m_rows}_err"] = best[3]
            print(f"{name} rows {m_rows}: old {t_old*1e6:.1f} us ({100*nbytes/t_old/1e9/copy_gbs:.1f}% copy, err {err_old:.1e})"
                  + (f"  mma {best[0]*1e6:.1f} us ({100*nbytes/best[0]/1e9/copy_gbs:.1f}% copy, warps {best[1]} split {best[2]}, err {best[3]:.1e})" if best else "  mma: no valid config"), flush=True)
        results.append(row)
        del copies, packed
        torch.cuda.empty_cache()
    print(f"\n| shape | MB | gemv_w4 b1 us | mma_w4 b1 us | % copy (mma b1) | gemm_w4 b16 us | mma_w4 b16 us | mma b16/b1 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        b1, b16 = r.get("mma_1_us"), r.get("mma_16_us")
        pct = 100 * r["bytes"] / (b1 * 1e-6) / 1e9 / copy_gbs if b1 else float("nan")
        print(f"| {r['shape']} | {r['bytes']/1e6:.1f} | {r.get('old_1_us', float('nan')):.1f} | {b1 or float('nan'):.1f} | {pct:.1f} | "
              f"{r.get('old_16_us', float('nan')):.1f} | {b16 or float('nan'):.1f} | {(b16 / b1) if b1 and b16 else float('nan'):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_gbs=copy_gbs, rows=results), indent=1))


if __name__ == "__main__":
    main()
