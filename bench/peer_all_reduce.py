"""Latency of the one-launch peer all-reduce (halfbyte/distributed/peer_all_reduce.py) on ONE GPU:
two ranks as two streams of one CUDA graph, each all-reducing a row `--calls` times in a chain
(each call waits for the other rank's flags, as across GPUs). The peer's row is local memory
here, not NVLink, so this is the kernel's own floor (launch, flags, sums), not the 2-GPU number.

Usage: python bench/peer_all_reduce.py [--hidden 8192] [--calls 160]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv import graph_time  # noqa: E402

from halfbyte.distributed.peer_all_reduce import PeerAllReduce  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=160)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cap, pad_ints = 1 << 19, 1024
    bufs = [torch.zeros(2 * cap, dtype=torch.float16, device=dev) for _ in range(2)]
    pads = [torch.zeros(pad_ints, dtype=torch.int32, device=dev) for _ in range(2)]
    ptr = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=dev)  # noqa: E731
    ops = [PeerAllReduce(ptr(bufs), ptr(pads), r, 2, cap, torch.float16, pad_ints) for r in range(2)]
    xs = [torch.randn(1, args.hidden, dtype=torch.float16, device=dev) for _ in range(2)]
    # two created streams (a kernel on the legacy default stream would wait for the other stream's
    # spinning kernel), launches interleaved: streams may share a hardware queue, where 160 queued
    # launches of one rank would stall (PDL) in front of the other rank's first
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def chain() -> None:
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for _ in range(args.calls):
            for op, s, x in zip(ops, streams, xs, strict=True):
                with torch.cuda.stream(s):
                    op(x)
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)

    for op, x in zip(ops, xs, strict=True):
        op.compile(x)  # before either runs: loading a module waits for an idle device
    torch.cuda.synchronize()
    chain()  # epochs stay in step for the graph
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    chain()
    end.record()
    end.synchronize()
    print(f"eager: {start.elapsed_time(end) * 1000 / args.calls:.2f} us per call (launch-bound)", flush=True)
    # a graph of one chain (both ranks' calls); graph_time runs it once eagerly first, which
    # keeps the two ranks' epochs in step
    best = graph_time(chain, reps=1) * 1e6 / args.calls
    # the floor of any launch in the same setting: one elementwise add per call, chained in a graph
    y = torch.empty_like(xs[0])
    add = graph_time(lambda: torch.add(xs[0], xs[1], out=y), reps=args.calls) * 1e6
    result = {"hidden": args.hidden, "calls": args.calls, "us_per_all_reduce": best, "us_per_add": add}
    print(f"peer all-reduce, 2 ranks on one GPU, hidden {args.hidden}: {best:.2f} us per call; "
          f"an elementwise add: {add:.2f} us (graphs of {args.calls} chained calls)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
