"""What asking the L2 for a GEMV's weights before the small kernels in front of it buys, in
isolation (kernels/l2_prefetch.py). Per shape and window, us per sequence (CUDA graph, weights
rotated through copies larger than the L2, so each one is cold, as in a decode step):

    window     W x RMSNorm of one row (PDL-chained small kernels: the decode step's norms,
               RoPE, attention) and nothing else
    + prefetch the prefetch launch, then the window: what the launch costs the chain (+side: the
               prefetch on a side stream, joined after the GEMV)
    cold       the window, then the GEMV
    warmed     the prefetch, the window, then the GEMV
    hot        the window, then the GEMV on one weight, L2-resident after the first call: the floor

warmed < cold is the gain the decode step can expect per GEMV at that window; window + prefetch
against window says whether the kernel after the prefetch waits for its bytes.

Usage: python bench/l2_prefetch.py [--shapes 8b.o,8b.qkv,8b.down] [--windows 0,1,3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv import SHAPES, graph_time, make_weight, rotated_time  # noqa: E402

from halfbyte.kernels import l2_prefetch as lp  # noqa: E402
from halfbyte.kernels.quant_matmul import quant_matmul  # noqa: E402
from halfbyte.kernels.rms_norm import rms_norm  # noqa: E402

L2_ROTATION_BYTES = 200 << 20  # copies of each weight together this large: every call reads cold


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8b.o,8b.qkv,8b.down")
    ap.add_argument("--windows", default="0,1,3", help="RMSNorm launches between the prefetch and the GEMV")
    ap.add_argument("--modes", default="bulk,lines,bulk+side,lines+side", help="+side: on a side stream")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["HALFBYTE_L2_PREFETCH_MB"] = "1000000"  # the bench decides what to prefetch
    x = torch.randn(1, 8192, dtype=torch.float16, device="cuda")
    norm_w = torch.rand(8192, dtype=torch.float16, device="cuda")
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        one = make_weight(n, k, 4, 128)
        nbytes = sum(t.numel() * t.element_size() for t in one)
        weights = [one] + [make_weight(n, k, 4, 128) for _ in range(max(1, L2_ROTATION_BYTES // nbytes) - 1)]
        xk = x[:, :k].contiguous() if k <= 8192 else torch.randn(1, k, dtype=torch.float16, device="cuda")
        for window in (int(w) for w in args.windows.split(",")):
            def small() -> None:
                for _ in range(window):
                    rms_norm(x, norm_w, 1e-5)

            def gemv(q, s, m) -> None:  # type: ignore[no-untyped-def]
                quant_matmul(xk, q, s, m, 4, 128)

            row = {"shape": name, "MB": nbytes / 2**20, "window": window,
                   # (no window: nothing to time, and an empty graph will not capture)
                   "window_us": rotated_time(lambda q, s, m: small(), weights) * 1e6 if window else 0.0,
                   "cold_us": rotated_time(lambda q, s, m: (small(), gemv(q, s, m)), weights) * 1e6,
                   "hot_us": graph_time(lambda: (small(), gemv(*one))) * 1e6}
            for mode in args.modes.split(","):
                os.environ["HALFBYTE_L2_PREFETCH"] = mode.removesuffix("+side")
                os.environ["HALFBYTE_L2_PREFETCH_SIDE"] = "1" if mode.endswith("+side") else "0"

                def warm(q, s, m) -> None:  # type: ignore[no-untyped-def]
                    lp.l2_prefetch([q, s, m])

                row[f"{mode}_window_us"] = rotated_time(
                    lambda q, s, m: (warm(q, s, m), small(), lp.join(x.device)), weights) * 1e6
                row[f"{mode}_warmed_us"] = rotated_time(
                    lambda q, s, m: (warm(q, s, m), small(), gemv(q, s, m), lp.join(x.device)), weights) * 1e6
            os.environ["HALFBYTE_L2_PREFETCH"] = "0"
            rows.append(row)
    modes = args.modes.split(",")
    print(f"\n{'shape':<9} {'MB':>5} {'win':>3} {'window':>7} " + " ".join(f"{m + '+win':>10}" for m in modes)
          + f" {'cold':>7} " + " ".join(f"{m + ' warm':>10}" for m in modes) + f" {'hot':>7}   (us)")
    for r in rows:
        print(f"{r['shape']:<9} {r['MB']:5.1f} {r['window']:>3} {r['window_us']:7.2f} "
              + " ".join(f"{r[m + '_window_us']:10.2f}" for m in modes) + f" {r['cold_us']:7.2f} "
              + " ".join(f"{r[m + '_warmed_us']:10.2f}" for m in modes) + f" {r['hot_us']:7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
