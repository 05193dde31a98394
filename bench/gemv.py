"""Quantized GEMV/GEMM speed on the GPU: GB/s of packed weights + scales + mins moved, against
the measured device-to-device copy bandwidth, for Llama-3-8B and 70B layer shapes.

Usage: python bench/gemv.py [--bits 4] [--group 128] [--sweep] [--json OUT]
Times the generic kernel at its defaults and, at 4 bits, the fp16x2 kernels in the same run:
gemv_w4 for one row, gemm_w4 (tensor cores) for 16 and 64 rows; --sweep tries their tile /
split / warp settings per shape (--sweep-rows: only gemm_w4's; --sweep-b1: only gemv_w4's, wider)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halfbyte.kernels import gemm_w4, gemv_w4  # noqa: E402
from halfbyte.kernels.quant_gemv import gemv_triton  # noqa: E402
from halfbyte.kernels.quant_matmul import quant_matmul_ref, quant_matmul_triton  # noqa: E402

SHAPES = {  # name: (N out, K in)
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "70b.qkv": (10240, 8192), "70b.o": (8192, 8192), "70b.gate_up": (57344, 8192), "70b.down": (8192, 28672),
}
# One rank's shards at tensor_parallel_size 2 (qkv and gate_up split by columns, o and down by
# K): what each GPU streams in a 2-GPU decode step. Only by name (--shapes); not in the default run.
TP2_SHAPES = {
    "8b.tp2.qkv": (3072, 4096), "8b.tp2.o": (4096, 2048), "8b.tp2.gate_up": (14336, 4096), "8b.tp2.down": (4096, 7168),
    "70b.tp2.qkv": (5120, 8192), "70b.tp2.o": (8192, 4096), "70b.tp2.gate_up": (28672, 8192),
    "70b.tp2.down": (8192, 14336),
}
# The Llama-3 LM head (vocabulary 128,256) when quantized (bench/decode.py --head-bits): by name only
HEAD_SHAPES = {"8b.head": (128256, 4096), "70b.head": (128256, 8192)}


def graph_time(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call, replayed from a CUDA graph of `reps` calls (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / reps)
    return best


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second, measured as GPU.md's anchor does
    (2 GiB of random uint8, eager `copy_` between CUDA events, median of 20)."""
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * a.numel() / sorted(times)[len(times) // 2] / 1e9


def copy_bandwidth_in_graph() -> float:
    """The same copy replayed from a CUDA graph, as this bench measured it before 2026-12-04: it
    read 2.7 TB/s in every call, well below the eager copy (kept to show the difference)."""
    a = torch.empty(1 << 29, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    t = min(graph_time(lambda: b.copy_(a), reps=10) for _ in range(3))
    return 2 * a.numel() * 4 / t / 1e9


def read_bandwidth() -> float:
    """Bytes read per second by a plain reduction (torch.sum) over 2 GiB: a read-only stream, the
    pattern of a GEMV, which the copy's read + write mix does not show."""
    a = torch.empty(1 << 30, dtype=torch.float16, device="cuda").normal_()
    t = min(graph_time(lambda: a.sum(), reps=10) for _ in range(3))
    return a.numel() * 2 / t / 1e9


GPU_MD_COPY_GBS = 4161.0  # the H200's copy bandwidth as measured for GPU.md


def rotated_time(fn, weights, reps: int = 40) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call with the weight rotating through copies that together exceed the L2
    cache (60 MB on an H200), as in a real forward pass where every layer's weight is cold."""
    calls = [lambda w=w: fn(*w) for w in weights]
    return graph_time(lambda: [c() for c in calls], reps=max(1, reps // len(calls))) / len(calls)


def make_weight(n: int, k: int, bits: int, group: int):  # type: ignore[no-untyped-def]
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 32 * bits, n), dtype=torch.int32, device="cuda")
    groups = -(-k // group)
    scales = (torch.rand(groups, n, device="cuda") * 0.02).half()
    mins = (-torch.rand(groups, n, device="cuda") * 0.1).half()
    return qweight, scales, mins


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--sweep", action="store_true", help="try tile / split / warp settings per shape")
    ap.add_argument("--sweep-rows", action="store_true", help="sweep only the 16- and 64-row (gemm_w4) settings")
    ap.add_argument("--sweep-b1", action="store_true",
                    help="sweep only gemv_w4's one-row settings, including tiles of one group (block_kw 8, 16)")
    ap.add_argument("--pairs", action="store_true", help="one row: gemv_w4 with pair_rows beside the default, same call")
    ap.add_argument("--sweep-b16", action="store_true", help="sweep only the 16-row gemm_w4 settings, with K splits")
    ap.add_argument("--sweep-split", action="store_true",
                    help="one row: gemv_w4 with 16-64 K splits and 8 warps, many more programs per SM (the read "
                    "ceiling's best grids run 16 programs x 8 warps per SM)")
    ap.add_argument("--one-tile", action="store_true",
                    help="one row: configs whose K split is one tile, with the loop and compiled without it "
                    "(gemv_w4 one_tile: fewer registers, room for the next launch's programs beside this one)")
    ap.add_argument("--sweep-nosplit", action="store_true",
                    help="one row: no K split (no combine: no partials, counter or serial sum), 8-32 columns per "
                    "program over the whole K, as one tile (one_tile) or two")
    ap.add_argument("--sweep-b16-nosplit", action="store_true",
                    help="16 rows: gemm_w4 tiles of 16-64 columns with no or a 2-way K split (no or a small combine)")
    ap.add_argument("--diag", action="store_true",
                    help="one row, the best config again without the split-K combine, and without the arithmetic "
                    "too (gemv_w4 _diag 1 / 2: timing only, wrong outputs): what each costs")
    ap.add_argument("--cluster", action="store_true",
                    help="one and 16 rows: the tuned configs with the split-K combine through a thread-block cluster "
                    "(kernels/cluster.py) beside the counter combine, same call (no change where there is no split)")
    ap.add_argument("--sweep-cluster", action="store_true",
                    help="one and 16 rows: K splits of 2-8 combined through a thread-block cluster, a few tiles each "
                    "(cheap combines may make splits win where the counter combine lost)")
    ap.add_argument("--stages", action="store_true",
                    help="one row: one-tile paired configs with their tile as 2 / 4 sub-tiles staged through shared "
                    "memory (gemv_w4 stages), beside the same configs unstaged and the tuned one, same call")
    ap.add_argument("--no-read-ceiling", action="store_true",
                    help="skip timing a plain read of each shape's bytes (bench/read_ceiling.py)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join({**SHAPES, **TP2_SHAPES, **HEAD_SHAPES})}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    known = {**SHAPES, **TP2_SHAPES, **HEAD_SHAPES}
    if unknown := [s for s in args.shapes.split(",") if s not in known]:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(known)}")
    copy_gbs = copy_bandwidth()
    copy_graph_gbs = copy_bandwidth_in_graph()
    read_gbs = read_bandwidth()
    rows = []
    for name in args.shapes.split(","):
        n, k = known[name]
        copies = [make_weight(n, k, args.bits, args.group)]
        nbytes = copies[0][0].numel() * 4 + copies[0][1].numel() * 2 + copies[0][2].numel() * 2
        copies += [make_weight(n, k, args.bits, args.group) for _ in range(max(0, -(-240_000_000 // nbytes) - 1))]
        qw, sc, mn = copies[0]
        x1 = torch.randn(1, k, device="cuda", dtype=torch.float16)
        x16 = torch.randn(16, k, device="cuda", dtype=torch.float16)
        ref1 = quant_matmul_ref(x1, qw, sc, mn, args.bits, args.group)
        ref16 = quant_matmul_ref(x16, qw, sc, mn, args.bits, args.group)

        trials: list[dict[str, Any]] = []  # every timed config, for the JSON

        def pick(fn, grid, x, ref, label="w4"):  # type: ignore[no-untyped-def]
            best = None
            for cfg in grid:
                try:
                    out = fn(x, qw, sc, mn, **cfg)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err <= 1e-3:
                        print(f"  {name} {cfg}: rel err {err:.2e}", file=sys.stderr)
                        continue
                    t = rotated_time(lambda q, s_, m_: fn(x, q, s_, m_, **cfg), copies)
                except Exception as e:  # a config that does not compile (registers, shared memory)
                    print(f"  {name} {cfg}: {type(e).__name__} {str(e)[-1500:]}", file=sys.stderr)
                    continue
                trials.append(dict(kernel=label, rows=x.shape[0], cfg=cfg, us=t * 1e6))
                if best is None or t < best[1]:
                    best = (cfg, t, err)
            return best

        # the generic kernel at its defaults (or the tiled one for widths that straddle words)
        generic = gemv_triton if 32 % args.bits == 0 else quant_matmul_triton
        old = lambda x, q, s_, m_, **c: generic(x, q, s_, m_, args.bits, args.group, **c)  # noqa: E731
        _, t1, err = pick(old, [{}], x1, ref1, "generic")
        _, t16, err16 = pick(old, [{}], x16, ref16, "generic")
        row = dict(shape=name, n=n, k=k, bytes=nbytes, t1_us=t1 * 1e6, gbs=nbytes / t1 / 1e9,
                   pct_4161=100 * nbytes / t1 / 1e9 / GPU_MD_COPY_GBS,
                   pct_copy=100 * nbytes / t1 / 1e9 / copy_gbs, t16_over_t1=t16 / t1, rel_err=max(err, err16))
        if args.bits == 4 and gemm_w4.supports(x16, 4, args.group):
            # one row: gemv_w4 (weight streaming); 16 and 64 rows: gemm_w4 (tensor cores)
            new = lambda x, q, s_, m_, **c: gemv_w4.gemv_w4(x, q, s_, m_, args.group, **c)  # noqa: E731
            mma = lambda x, q, s_, m_, **c: gemm_w4.gemm_w4(x, q, s_, m_, args.group, **c)  # noqa: E731
            grid1: list[dict[str, Any]] = [{}]
            grid_m: list[dict[str, Any]] = [{}]
            if args.sweep:
                grid1 += [dict(block_n=bn, block_kw=kw, split_k=sk, num_stages=st)
                          for bn, kw, sk, st in itertools.product((64, 128), (32, 64), (None, 16), (2, 4))]
            if args.sweep_b1:  # tiles of at most one group read one scale row per tile
                grid1 += [dict(block_n=bn, block_kw=kw, split_k=sk, num_stages=st, num_warps=w)
                          for bn, kw, sk, st, w in itertools.product((64, 128, 256), (8, 16, 32), (None, 8, 16), (2, 4), (4, 8))
                          if bn * kw <= 4096]
            if args.pairs:  # the tuned tile with paired rows, and the tiles that compile to the fewest instructions
                grid1 += [dict(pair_rows=True)] + [dict(block_n=bn, block_kw=kw, num_warps=w, split_k=sk, pair_rows=True)
                                                   for (bn, kw, w), sk in itertools.product(
                                                       ((64, 32, 4), (64, 64, 8), (128, 32, 8), (256, 32, 8)), (None, 8))]
            if args.sweep_split:
                grid1 += [dict(block_n=bn, block_kw=kw, split_k=sk, num_warps=w, num_stages=2, pair_rows=pr)
                          for bn, kw, sk, w, pr in itertools.product((128, 256), (8, 16), (16, 32, 64), (4, 8), (False, True))]
            if args.one_tile:
                grid1 += [dict(block_n=bn, block_kw=kw, num_warps=w, pair_rows=pr, split_k=-(-k // (8 * kw)), one_tile=one)
                          for bn, kw, w, pr in ONE_TILE_CONFIGS for one in (False, True)]
            if args.sweep_nosplit:
                grid1 += nosplit_configs(k)
            if args.stages:  # whole-K one-tile programs (no split, no combine) and 2-way cluster splits
                grid1 += [dict(block_n=bn, block_kw=k // 8 // sk, split_k=sk, num_warps=w, pair_rows=True, one_tile=True,
                               stages=st, **({"cluster": True} if sk > 1 else {}))
                          for bn, w, sk, st in itertools.product((16, 32), (4, 8), (1, 2), (1, 2, 4))
                          if (k // 8 // sk) & (k // 8 // sk - 1) == 0 and bn * k // 8 // sk <= 16384]
            grid16 = list(grid_m)
            if args.sweep_cluster:
                grid1 += [dict(block_n=bn, block_kw=kw, num_warps=w, split_k=sk, pair_rows=True, cluster=True)
                          for (bn, kw, w), sk in itertools.product(CLUSTER_TILES_B1, (2, 4, 8))]
                # each split one tile, several small programs per SM: one program's arithmetic can run
                # while the others' words still arrive (one 64 KB program per SM waits for all of them)
                grid1 += [dict(block_n=bn, block_kw=k // 8 // sk, num_warps=w, split_k=sk, pair_rows=True, one_tile=True,
                               cluster=True)
                          for bn, w, sk in itertools.product((16, 32), (4, 8), (2, 4, 8))
                          if (k // 8) % sk == 0 and (k // 8 // sk) & (k // 8 // sk - 1) == 0 and bn * k // 8 // sk <= 16384]
                grid16 += [dict(block_n=bn, block_kw=kw, split_k=sk, cluster=True)
                           for (bn, kw), sk in itertools.product(((64, 16), (64, 32), (128, 16)), (2, 4, 8))]
            if args.sweep_b16:
                grid16 += [dict(block_n=bn, block_kw=kw, split_k=sk, num_warps=w, num_stages=st) for bn, kw, sk, st, w in
                           itertools.product((32, 64, 128), (16, 32), (None, 4), (3, 5), (2, 4))]
            if args.sweep_b16_nosplit:  # the split-K combine of 16 rows costs 1.7-5.7 us (--diag)
                grid16 += [dict(block_n=bn, block_kw=kw, split_k=sk, num_warps=w, num_stages=st) for bn, kw, sk, w, st in
                           itertools.product((16, 32, 64), (16, 32, 64), (1, 2), (2, 4), (2, 4)) if sk == 1 or bn > 16]
            if args.sweep or args.sweep_rows:
                grid_m += [dict(block_n=bn, block_kw=kw, num_warps=w, num_stages=st)
                           for bn, kw, w, st in itertools.product((64, 128, 256), (16, 32), (4, 8), (3, 4))]
                grid_m += [dict(block_n=bn, block_kw=kw, split_k=sk) for bn, kw, sk in
                           itertools.product((64, 128, 256), (16, 32), (2, 4, 8))]
            grid64 = grid_m + [dict(block_n=bn, block_m=bm, num_warps=w) for bn, bm, w in
                               itertools.product((64, 128, 256), (16, 32), (4, 8))] if args.sweep or args.sweep_rows else grid_m
            best1 = pick(new, grid1, x1, ref1)
            x64 = torch.randn(64, k, device="cuda", dtype=torch.float16)
            best16 = pick(mma, grid_m if args.sweep or args.sweep_rows else grid16, x16, ref16)
            best64 = pick(mma, grid64, x64, quant_matmul_ref(x64, qw, sc, mn, args.bits, args.group))
            if best1 is None or best16 is None or best64 is None:
                raise SystemExit(f"{name}: every 4-bit config failed (see stderr)")
            (cfg, w1, e1), (cfg16, w16, e16), (cfg64, w64, e64) = best1, best16, best64
            if args.diag:  # same config, same copies; outputs not checked (they are not the product)
                row["diag_us"] = [w1 * 1e6] + [
                    rotated_time(lambda q, s_, m_, d=d: new(x1, q, s_, m_, **cfg, _diag=d), copies) * 1e6 for d in (1, 2)]
                row["diag16_us"] = [w16 * 1e6] + [
                    rotated_time(lambda q, s_, m_, d=d: mma(x16, q, s_, m_, **cfg16, _diag=d), copies) * 1e6 for d in (1, 2, 3, 4)]
            if args.cluster:  # counter, cluster, twice: the same configs, the same copies, checked
                times = [pick(fn, [{**c, "cluster": mode}], x, ref, f"w4 cluster={mode}")
                         for fn, c, x, ref in ((new, cfg, x1, ref1), (mma, cfg16, x16, ref16)) for mode in CLUSTER_MODES * 2]
                row["cluster_us"] = [t[1] * 1e6 if t else None for t in times]  # b1 then b16, CLUSTER_MODES twice each
            # the other way to feed x's value planes (gemm_w4.x_split_default), same configs, same run
            split16, split64 = gemm_w4.x_split_default(n, k, 16), gemm_w4.x_split_default(n, k, 64)
            alt16 = pick(mma, [{**cfg16, "x_split": not split16}], x16, ref16)
            alt64 = pick(mma, [{**cfg64, "x_split": not split64}], x64, quant_matmul_ref(x64, qw, sc, mn, args.bits, args.group))
            row.update(x_split16=split16, x_split64=split64, w4_t16_other_us=alt16[1] * 1e6 if alt16 else None,
                       w4_t64_other_us=alt64[1] * 1e6 if alt64 else None)
            row.update(w4_t1_us=w1 * 1e6, w4_pct_copy=100 * nbytes / w1 / 1e9 / copy_gbs,
                       w4_gbs=nbytes / w1 / 1e9, w4_pct_read=100 * nbytes / w1 / 1e9 / read_gbs, w4_pct_4161=100 * nbytes / w1 / 1e9 / GPU_MD_COPY_GBS, w4_t16_us=w16 * 1e6,
                       w4_t16_over_t1=w16 / w1, w4_t64_us=w64 * 1e6, w4_rel_err=max(e1, e16, e64),
                       w4_config=cfg, w4_config16=cfg16, w4_config64=cfg64)
        dense = [(torch.randn(n, k, device="cuda", dtype=torch.float16),) for _ in range(max(1, -(-240_000_000 // (n * k * 2))))]
        row["trials"] = trials
        if not args.no_read_ceiling:  # the fastest one-launch read of the same bytes, same harness
            from read_ceiling import read_ceiling_time

            t_read, cfg_read = read_ceiling_time(nbytes, rotated_time)
            row.update(read_us=t_read * 1e6, read_pct_copy=100 * nbytes / t_read / 1e9 / copy_gbs, read_config=cfg_read)
            if "w4_t1_us" in row:
                row["w4_pct_of_read"] = 100 * t_read * 1e6 / row["w4_t1_us"]
        row["fp16_linear_us"] = rotated_time(lambda w: torch.nn.functional.linear(x1, w), dense) * 1e6
        del dense, copies
        rows.append(row)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, bits=args.bits,
                  group=args.group, copy_gbs=copy_gbs, copy_graph_gbs=copy_graph_gbs, read_gbs=read_gbs, rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\ncopy bandwidth {copy_gbs:.0f} GB/s (in a graph {copy_graph_gbs:.0f}), read-only (sum) {read_gbs:.0f} GB/s; {args.bits}-bit g{args.group}; {result['device']}")
    print(f"(%copy: of this run's copy; %4161: of GPU.md's {GPU_MD_COPY_GBS:.0f} GB/s; read: the fastest one-launch "
          "read of the same bytes, same harness; w4 %read: read time / w4 time)")
    print(f"{'shape':<12}{'us b1':>8}{'%copy':>7}{'b16/b1':>8}{'w4 us b1':>10}{'w4 %copy':>10}{'%4161':>7}{'w4 b16/b1':>10}"
          f"{'w4 b64 us':>10}{'fp16 us':>9}{'read us':>9}{'read %copy':>11}{'w4 %read':>9}  w4 config b1 | b16")
    for r in rows:
        w4 = (f"{r['w4_t1_us']:>10.1f}{r['w4_pct_copy']:>10.1f}{r['w4_pct_4161']:>7.1f}{r['w4_t16_over_t1']:>10.2f}"
              if "w4_t1_us" in r else f"{'-':>10}{'-':>10}{'-':>7}{'-':>10}")
        print(f"{r['shape']:<12}{r['t1_us']:>8.1f}{r['pct_copy']:>7.1f}{r['t16_over_t1']:>8.2f}{w4}{r.get('w4_t64_us', 0):>10.1f}"
              f"{r['fp16_linear_us']:>9.1f}{r.get('read_us', float('nan')):>9.1f}{r.get('read_pct_copy', float('nan')):>11.1f}"
              f"{r.get('w4_pct_of_read', float('nan')):>9.1f}  {r.get('w4_config')} | {r.get('w4_config16')} | {r.get('w4_config64')}")
    if args.pairs:
        for r in rows:
            one = [tr for tr in r["trials"] if tr["rows"] == 1 and tr["kernel"] == "w4"]
            plain = min((tr for tr in one if not tr["cfg"].get("pair_rows")), key=lambda tr: tr["us"])
            paired = min((tr for tr in one if tr["cfg"].get("pair_rows")), key=lambda tr: tr["us"])
            print(f"{r['shape']:<12} b1 default {plain['us']:.1f} us, pair_rows {paired['us']:.1f} us {paired['cfg']}")
    print("gemm_w4, x split in the kernel (S) or permuted (P), default -> the other, same configs: " + ", ".join(
        f"{r['shape']} b16 {'SP'[not r['x_split16']]} {r['w4_t16_us']:.1f}->{r['w4_t16_other_us'] or float('nan'):.1f} "
        f"b64 {'SP'[not r['x_split64']]} {r['w4_t64_us']:.1f}->{r['w4_t64_other_us'] or float('nan'):.1f} us"
        for r in rows if "w4_t16_other_us" in r))
    print_diag(rows)
    if args.stages:
        for r in rows:
            one = [tr for tr in r["trials"] if tr["rows"] == 1 and tr["kernel"] == "w4" and "stages" in tr["cfg"]]
            if one:
                best = {st: min((tr for tr in one if tr["cfg"]["stages"] == st), key=lambda tr: tr["us"], default=None)
                        for st in (1, 2, 4)}
                print(f"{r['shape']:<12} b1 one tile, best unstaged / 2 / 4 sub-tiles: " + " / ".join(
                    f"{b['us']:.1f} us {b['cfg']['block_n']}x{b['cfg']['block_kw']}x{b['cfg']['num_warps']} split {b['cfg']['split_k']}"
                    if b else "-" for b in best.values()))
    if args.cluster:
        print("split-K combine, tuned configs, counter / cluster (two each, us): " + ", ".join(
            f"{r['shape']} b1 {_modes(r['cluster_us'][0:4])} b16 {_modes(r['cluster_us'][4:8])}" for r in rows if "cluster_us" in r))
    if args.one_tile:
        print_one_tile(rows)
    if args.sweep_b16_nosplit:
        for r in rows:
            b16 = sorted((tr for tr in r["trials"] if tr["rows"] == 16 and tr["kernel"] == "w4"), key=lambda tr: tr["us"])
            tuned = next(tr for tr in r["trials"] if tr["rows"] == 16 and tr["kernel"] == "w4")
            print(f"{r['shape']:<12} b16 tuned {tuned['us']:.1f} us, best three: " + ", ".join(
                f"{tr['us']:.1f} {tr['cfg']}" for tr in b16[:3]) + f"; b1 {r['w4_t1_us']:.1f}")
    if args.sweep_nosplit:
        for r in rows:
            one = [tr for tr in r["trials"] if tr["rows"] == 1 and tr["kernel"] == "w4"]
            ns = sorted((tr for tr in one if tr["cfg"].get("split_k") == 1 and "one_tile" in tr["cfg"]), key=lambda tr: tr["us"])
            print(f"{r['shape']:<12} b1 tuned {one[0]['us']:.1f} us; no split, best three: " + ", ".join(
                f"{tr['us']:.1f} {tr['cfg']}" for tr in ns[:3]))


# (block_n, block_kw, warps, pair_rows) for --one-tile: registers with / without the loop (sm_90,
# bench/kernel_sass.py ...,o): 64x64x4 128 / 80, 64x64x8 pairs 59 / 40, 64x32x4 pairs 56 / 40,
# 128x32x4 pairs 88 / 71, 128x64x8 pairs 80 / 72, 256x32x8 pairs 108 / 74
ONE_TILE_CONFIGS = [(64, 64, 4, False), (64, 64, 8, True), (64, 32, 4, True), (128, 32, 4, True), (128, 64, 8, True),
                    (256, 32, 8, True)]


def nosplit_configs(k: int) -> list[dict[str, Any]]:
    """Split 1 at 8-32 columns per program: K in one tile (compiled without the loop) or in two,
    8-64 words per thread. Offline (sm_90): 8 x 512 x 4 warps paired 68 registers, 7 programs per
    SM, so 8B qkv's 768 programs are all resident; 16 x 512 x 8 paired 66, 3 per SM (384)."""
    full = 1 << (k // 8 - 1).bit_length()  # word rows of K, rounded up to a power of two
    out = []
    for bn, w, pr, tiles in itertools.product((8, 16, 32), (4, 8), (False, True), (1, 2)):
        kw = full // tiles
        if 8 <= bn * kw // (32 * w) <= 64:
            out.append(dict(block_n=bn, block_kw=kw, num_warps=w, pair_rows=pr, split_k=1, one_tile=tiles == 1))
    return out


# one-row tiles for --sweep-cluster: the tuned tiles of the 8B / 70B shapes and their neighbours
CLUSTER_TILES_B1 = ((32, 64, 4), (64, 32, 4), (64, 64, 8), (128, 32, 8), (32, 128, 8))


CLUSTER_MODES = (False, True)  # the counter combine, the cluster's


def _modes(us: list[float | None]) -> str:
    """'a1 a2 / b1 b2' from CLUSTER_MODES' times twice over ([a, b, a, b])."""
    f = lambda v: "fail" if v is None else f"{v:.1f}"  # noqa: E731
    n = len(CLUSTER_MODES)
    return " / ".join(f"{f(us[i])} {f(us[i + n])}" for i in range(n))


def print_one_tile(rows: list[dict[str, Any]]) -> None:
    """Per shape and config: us with the loop -> compiled as one tile."""
    for r in rows:
        t = {(tr["cfg"].get("block_n"), tr["cfg"].get("block_kw"), tr["cfg"].get("num_warps"), tr["cfg"].get("pair_rows"),
              tr["cfg"].get("one_tile")): tr["us"] for tr in r["trials"] if tr["rows"] == 1 and "one_tile" in tr["cfg"]}
        print(f"{r['shape']:<12} one tile per split, loop -> none (us): " + ", ".join(
            f"{bn}x{kw}x{w}{'p' if pr else ''} {t.get((bn, kw, w, pr, False), float('nan')):.1f}->{t.get((bn, kw, w, pr, True), float('nan')):.1f}"
            for bn, kw, w, pr in ONE_TILE_CONFIGS) + f"  (best of all {r.get('w4_t1_us', float('nan')):.1f})")


def print_diag(rows: list[dict[str, Any]]) -> None:
    if any("diag_us" in r for r in rows):
        print("gemv_w4 b1, best config: full / without the split-K combine / loads only (us): " + ", ".join(
            f"{r['shape']} {' / '.join(f'{t:.1f}' for t in r['diag_us'])}" for r in rows if "diag_us" in r))
        print("gemm_w4 b16, best config: full / no combine / x made in registers / dequantization without dots / "
              "weight loads only (us): " + ", ".join(
                  f"{r['shape']} {' / '.join(f'{t:.1f}' for t in r['diag16_us'])}" for r in rows if "diag16_us" in r))


if __name__ == "__main__":
    main()
