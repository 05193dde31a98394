"""One-row GEMV speed at the format's other bit widths (2, 3, 8; 4 is bench/gemv.py's), for the
mixed-bit models (~2.5 bpw 70B: mostly 2-bit g32 matrices) and an 8-bit LM head: the generic
kernel (quant_gemv.py; 3 bits straddle words: the tiled quant_matmul_triton) and, at 2 bits,
gemv_w2 (fp16x2) at its default and a small sweep. GB/s counts packed words + scales + mins,
against this run's copy bandwidth (as bench/gemv.py measures it); weights rotated past L2,
outputs checked against the reference (<= 1e-3).

Usage: python bench/gemv_bits.py [--bits 2,3,8] [--shapes 70b.gate_up,70b.down,...] [--sweep] [--json OUT]
"""

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

from gemv import HEAD_SHAPES, SHAPES, copy_bandwidth, make_weight, rotated_time  # noqa: E402

from halfbyte.kernels import gemv_w2  # noqa: E402
from halfbyte.kernels.quant_gemv import gemv_triton  # noqa: E402
from halfbyte.kernels.quant_matmul import quant_matmul_ref, quant_matmul_triton  # noqa: E402

GROUP = {2: 32, 3: 64, 5: 64, 6: 128, 8: 128}  # what the converter's mixes use per width (issue 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="2,3,8")
    ap.add_argument("--shapes", default="8b.o,8b.down,70b.o,70b.gate_up,70b.down,8b.head")
    ap.add_argument("--sweep", action="store_true", help="2 bits: gemv_w2 tiles x splits x warps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    known = {**SHAPES, **HEAD_SHAPES}
    copy_gbs = copy_bandwidth()
    rows: list[dict[str, Any]] = []
    for bits, name in itertools.product((int(b) for b in args.bits.split(",")), args.shapes.split(",")):
        n, k = known[name]
        group = GROUP[bits]
        copies = [make_weight(n, k, bits, group)]
        nbytes = sum(t.numel() * t.element_size() for t in copies[0])
        copies += [make_weight(n, k, bits, group) for _ in range(max(0, -(-240_000_000 // nbytes) - 1))]
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        ref = quant_matmul_ref(x, *copies[0], bits, group)

        def timed(fn, cfg: dict[str, Any]) -> float | None:  # type: ignore[no-untyped-def]
            try:
                err = ((fn(x, *copies[0], **cfg).float() - ref).norm() / ref.norm()).item()
                if not err <= 1e-3:
                    print(f"  {bits}-bit {name} {cfg}: rel err {err:.2e}", file=sys.stderr)
                    return None
                return rotated_time(lambda q, s, m: fn(x, q, s, m, **cfg), copies) * 1e6
            except Exception as e:  # a config that does not compile
                print(f"  {bits}-bit {name} {cfg}: {type(e).__name__} {str(e)[-300:]}", file=sys.stderr)
                return None

        generic = gemv_triton if 32 % bits == 0 else quant_matmul_triton
        row: dict[str, Any] = dict(bits=bits, group=group, shape=name, mb=nbytes / 1e6,
                                   generic_us=timed(lambda x, q, s, m: generic(x, q, s, m, bits, group), {}))
        if bits == 2:
            grid: list[dict[str, Any]] = [{}]
            if args.sweep:
                grid += [dict(block_n=bn, block_kw=kw, split_k=sk, num_warps=w)
                         for bn, kw, sk, w in itertools.product((64, 128, 256), (8, 16, 32), (None, 4, 8), (4, 8))
                         if bn * kw <= 4096]
            tried = [(t, cfg) for cfg in grid if (t := timed(lambda x, q, s, m, **c: gemv_w2.gemv_w2(x, q, s, m, group, **c), cfg))]
            row["w2_default_us"] = tried[0][0] if tried and not tried[0][1] else None
            if tried:
                row["w2_us"], row["w2_config"] = min(tried, key=lambda tc: tc[0])
        rows.append(row)
        del copies
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows), indent=1))
    pct = lambda r, key: f"{100 * r['mb'] * 1e3 / r[key] / copy_gbs:6.1f}" if r.get(key) else f"{'-':>6}"  # noqa: E731
    us = lambda r, key: f"{r[key]:9.1f}" if r.get(key) else f"{'-':>9}"  # noqa: E731
    print(f"\none row, {torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s; us (% of copy)")
    print(f"{'bits':>4} {'shape':<12}{'MB':>7}{'generic':>9}{'%':>6}{'w2 dflt':>9}{'%':>6}{'w2 best':>9}{'%':>6}  config")
    for r in rows:
        print(f"{r['bits']:>4} {r['shape']:<12}{r['mb']:7.1f}{us(r, 'generic_us')}{pct(r, 'generic_us')}"
              f"{us(r, 'w2_default_us')}{pct(r, 'w2_default_us')}{us(r, 'w2_us')}{pct(r, 'w2_us')}  {r.get('w2_config', '')}")


if __name__ == "__main__":
    main()
