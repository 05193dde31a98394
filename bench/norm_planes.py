"""The RMSNorm(+residual) kernel for one decode row: columns per program (chunk), and what writing
the output's int8 planes for gemv_w4_i8 beside it costs. CUDA graph, us per call.

Usage: python bench/norm_planes.py [--json OUT]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv import graph_time  # noqa: E402

from halfbyte.kernels.rms_norm import rms_norm_triton  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for hidden in (4096, 8192):
        x, r = (torch.randn(1, hidden, device="cuda", dtype=torch.float16) for _ in range(2))
        w = torch.ones(hidden, device="cuda", dtype=torch.float16)
        for chunk in (hidden, 1024, 512, 256):
            for group in (None, 128):
                t = graph_time(lambda c=chunk, g=group: rms_norm_triton(x, w, 1e-5, r, planes_group=g, chunk=c))
                rows.append(dict(hidden=hidden, chunk=chunk, planes_group=group, us=t * 1e6))
                print(f"hidden {hidden:5d} chunk {chunk:5d} planes {str(group):>4}: {t * 1e6:6.2f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
