"""The fastest one-launch read of a buffer of a given size: the ceiling for a GEMV of that many
bytes, timed the way bench/gemv.py times the GEMV (CUDA graph, copies rotated past L2, PDL).

Why: issue 4 states GEMV speed as a percentage of the copy bandwidth measured on 2 GiB. A
13 MB matrix (Llama-3-8B qkv at 4 bits) cannot reach that rate in one launch: the ramp-up of
the grid and the DRAM round trip are not amortised. Reading the same bytes with nothing else to
do (wide loads, a running XOR, one store per program; the best of a few grid shapes) shows what
any kernel of that size can reach, and how far the GEMV is from it.

Used by bench/gemv.py (`--read-ceiling`); alone: python bench/read_ceiling.py --mb 13.4"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halfbyte.kernels.triton_utils import pdl_args, pdl_sync, tl, triton  # noqa: E402


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, words_per_prog, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * words_per_prog
    end = tl.minimum(start + words_per_prog, n_words)
    offs = tl.arange(0, BLOCK)
    # as gemv_w4 does: the first tile is requested before waiting for the previous kernel
    acc = tl.load(src_ptr + start + offs, mask=start + offs < end, other=0)
    pdl_sync(PDL)
    for i in range(start + BLOCK, end, BLOCK):
        acc ^= tl.load(src_ptr + i + offs, mask=i + offs < end, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_once(src: torch.Tensor, out: torch.Tensor, programs: int, block: int, warps: int) -> None:
    n = src.numel()
    per = triton.cdiv(triton.cdiv(n, programs), block) * block
    grid = triton.cdiv(n, per)
    _read_kernel[(grid,)](src, out, n, per, BLOCK=block, num_warps=warps, **pdl_args(src.device))


def read_configs(nbytes: int) -> list[tuple[int, int, int]]:
    """(programs, block words, warps): whole waves of the SMs, and one tile per program (all of a
    program's bytes requested before the PDL wait). At 8 words per thread one tile per program
    needs every thread slot of the GPU for an 8B o matrix; at 16-32 words per thread it takes a
    half or a quarter of them, so the next launch's programs fit beside it and load their bytes
    while this one finishes (cross-launch overlap)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    words = nbytes // 4
    out = [(sms * w, b, nw) for w, b, nw in itertools.product((2, 4, 8, 16), (1024, 2048), (4, 8))]
    out += [(triton.cdiv(words, b), b, nw) for b, nw in ((1024, 4), (2048, 8), (2048, 4), (4096, 8), (4096, 4), (8192, 8))]
    return out


def read_ceiling_time(nbytes: int, rotated_time, every: list | None = None) -> tuple[float, tuple[int, int, int]]:  # type: ignore[no-untyped-def]
    """Best seconds per read of nbytes (int32 words, copies rotated past L2), and its config;
    every (a list) collects (seconds, config) of each config tried."""
    words = nbytes // 4
    copies = [(torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device="cuda"),)
              for _ in range(max(1, -(-240_000_000 // nbytes)))]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(max(words // 1024 + 1, sms * 16), dtype=torch.int32, device="cuda")
    _check(copies[0][0][: 1 << 20], out)  # 4 MB: the same code path, a quick check
    best = (float("inf"), (0, 0, 0))
    for cfg in read_configs(nbytes):
        t = rotated_time(lambda s, c=cfg: read_once(s, out, *c), copies)
        best = min(best, (t, cfg))
        if every is not None:
            every.append((t, cfg))
    del copies
    return best


def small_copy_time(nbytes: int, rotated_time) -> float:  # type: ignore[no-untyped-def]
    """Seconds per torch copy_ moving nbytes (nbytes / 2 read, nbytes / 2 written), pairs rotated
    past L2 in the same chained harness: the copy engine's own rate at this size, against the
    2 GiB copy that issue 4's percentages divide by."""
    half = nbytes // 2
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda").random_(), torch.empty(half, dtype=torch.uint8, device="cuda"))
             for _ in range(max(1, -(-240_000_000 // nbytes)))]
    t = rotated_time(lambda a, b: b.copy_(a), pairs)
    del pairs
    return t


def _check(src: torch.Tensor, out: torch.Tensor, programs: int = 8, block: int = 1024) -> None:
    """Each program's result equals torch's sum over lanes of the XOR of its tiles: the kernel
    read every word it was given (a read ceiling that skipped bytes would be a lie)."""
    n = src.numel()
    per = triton.cdiv(triton.cdiv(n, programs), block) * block
    read_once(src, out, programs, block, 4)
    for p in range(triton.cdiv(n, per)):
        chunk = src[p * per: min((p + 1) * per, n)]
        tiles = torch.nn.functional.pad(chunk, (0, (-chunk.numel()) % block)).view(-1, block)
        x = tiles[0].clone()
        for row in tiles[1:]:
            x ^= row
        s = int(x.sum(dtype=torch.int64))
        wrapped = (s + 2**31) % 2**32 - 2**31  # tl.sum of int32 wraps
        if int(out[p]) != wrapped:
            raise AssertionError(f"read kernel: program {p} read {int(out[p])}, expected {wrapped}")


def main() -> None:
    from gemv import copy_bandwidth, rotated_time

    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, nargs="+", default=[8.9, 13.4, 31.2, 62.9, 125.8, 251.7])
    ap.add_argument("--all", action="store_true", help="print every config's time, not only the best")
    args = ap.parse_args()
    copy_gbs = copy_bandwidth()
    print(f"copy {copy_gbs:.0f} GB/s (2 GiB, eager, as GPU.md's anchor)")
    for mb in args.mb:
        nbytes = int(mb * 1e6) // 4 * 4
        every: list = []
        t, cfg = read_ceiling_time(nbytes, rotated_time, every)
        if args.all:
            for te, ce in every:
                print(f"    {mb:8.1f} MB  {te * 1e6:8.2f} us  {nbytes / te / 1e9:7.0f} GB/s  {ce}")
        print(f"{mb:8.1f} MB  {t * 1e6:8.2f} us  {nbytes / t / 1e9:7.0f} GB/s ({100 * nbytes / t / 1e9 / copy_gbs:.1f}% of "
              f"copy)  programs/block/warps {cfg}")
        tc = small_copy_time(nbytes, rotated_time)
        print(f"{mb:8.1f} MB  copy_ moving the same bytes, same harness: {tc * 1e6:8.2f} us "
              f"({100 * nbytes / tc / 1e9 / copy_gbs:.1f}% of copy)")


if __name__ == "__main__":
    main()
