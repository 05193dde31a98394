"""Ask the L2 cache for a weight's bytes while the small kernels before its GEMV run.

Why: a batch-1 decode step alternates bandwidth-bound GEMVs with small latency-bound kernels
(norms, RoPE + KV write, attention's split and merge: ~0.5 ms of an 8B step's ~2.9 on the H100,
BENCHMARKS.md), during which DRAM is mostly idle. A weight that fits in the L2 (50 MB on the
H100 and H200) can be requested in that time, so its GEMV reads part of it from the L2 and its
DRAM stream starts before its own ramp-up. (Prefetching inside the GEMV, before its PDL wait, lost
in the fifteenth session: there it competed with the previous GEMV's stream; here it is issued
after the previous kernel finished.)

How: one launch, after the PDL wait, splits the regions (up to four per launch; more take more
launches) into one chunk per thread over about one wave of single-warp programs. MODE "bulk":
each thread asks Hopper's TMA for its chunk with one `cp.async.bulk.prefetch.L2` (16-byte aligned);
"lines": one `prefetch.global.L2` per 128-byte line (sm_80+). Neither waits for the bytes and
nothing reads a result, so outputs cannot change (the GPU test: a graphed decode bit-identical
with and without). `record` (the interpreter's mode) stores each thread's (address, size) instead,
and the tests hold it to `chunk_plan`, the torch-free reference of which bytes are asked for.

HALFBYTE_L2_PREFETCH_SIDE=1 launches it on a side stream instead (forked from the current one,
joined by `join`, which the model calls at the end of its forward): then no kernel of the chain
waits for it, whatever the hardware counts as its completion; in the chain (the default) the next
kernel's PDL wait is for the prefetch launch's exit.

Off unless HALFBYTE_L2_PREFETCH=bulk or lines (not yet timed in a decode step). Weights larger in
total than HALFBYTE_L2_PREFETCH_MB (default 20: well inside the L2 with the KV reads beside it) are
skipped, since a prefetch that evicts itself before the GEMV reads it only adds traffic, or with
HALFBYTE_L2_PREFETCH_PREFIX=1 get that many bytes from the start of each region, in proportion:
the [K/8, N] words and [groups, N] scales of the K rows that a split-K grid's first wave (the
splits are program_id(1)) reads first."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton

MAX_REGIONS = 4  # per launch
LANES = 32  # threads per program: one warp, one chunk each
MODES = ("bulk", "lines")
LINE = 128  # bytes a line prefetch fetches
ALIGN = 16  # TMA wants 16-byte addresses and sizes
_UNIT = {"bulk": ALIGN, "lines": LINE, "record": ALIGN}


def prefetch_mode() -> str | None:
    """HALFBYTE_L2_PREFETCH: bulk, lines, or off (unset, 0)."""
    mode = os.environ.get("HALFBYTE_L2_PREFETCH", "0")
    if mode in ("", "0"):
        return None
    if mode not in MODES:
        raise ValueError(f"HALFBYTE_L2_PREFETCH={mode!r}: expected one of {', '.join(MODES)} or 0")
    return mode


def prefetch_cap_bytes() -> int:
    return int(float(os.environ.get("HALFBYTE_L2_PREFETCH_MB", "20")) * 2**20)


def regions(tensors: Sequence[torch.Tensor], lines: bool) -> list[tuple[int, int]]:
    """(address, bytes) of each non-empty contiguous tensor: lines, every 128-byte line holding a
    byte of it (a line prefetch fetches the line holding its address, so this reads nothing
    outside the tensor's lines); else its 16-byte-aligned interior (a bulk prefetch must start
    and end on 16 bytes, so the unaligned ends are left out)."""
    out = []
    for t in tensors:
        if t.numel() == 0 or not t.is_contiguous():
            continue
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        if lines:
            start = start - start % LINE
            end = end + (-end) % LINE
        else:
            start = start + (-start) % ALIGN
            end = end - end % ALIGN
        if end > start:
            out.append((start, end - start))
    return out


def within_cap(region_list: list[tuple[int, int]], cap: int, prefix: bool, unit: int) -> list[tuple[int, int]]:
    """The regions if they total at most cap bytes; else nothing, or (prefix) each region's first
    part, all cut to the same fraction of themselves (in whole units) so they total at most cap."""
    total = sum(n for _, n in region_list)
    if total <= cap:
        return region_list
    if not prefix:
        return []
    cut = [(a, n * cap // total // unit * unit) for a, n in region_list]
    return [(a, n) for a, n in cut if n > 0]


def chunk_bytes(total: int, programs: int, unit: int) -> int:
    """One chunk per thread over `programs` programs of LANES threads, in whole units."""
    per_thread = -(-total // (programs * LANES))
    return max(unit, -(-per_thread // unit) * unit)


def chunk_plan(region_list: Sequence[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """The reference: the (address, bytes) each thread asks for, in thread order — each region cut
    into chunks of `chunk` bytes (its last one shorter), regions one after another."""
    plan = []
    for start, n in region_list:
        plan += [(start + off, min(chunk, n - off)) for off in range(0, n, chunk)]
    return plan


if HAS_TRITON:

    @triton.jit
    def _issue(addr, size, chunk, MODE: tl.constexpr):
        """Ask the L2 for size (<= chunk) bytes at addr (nothing where size <= 0)."""
        if MODE == "bulk":
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 s; setp.gt.s64 p, $2, 0; cvt.u32.s64 s, $2;"
                " @p cp.async.bulk.prefetch.L2.global [$1], s; mov.u32 $0, 0; }",
                "=r,l,l", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
        else:  # lines
            for off in range(0, chunk, 128):  # LINE
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.gt.s64 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                    "=r,l,l", [addr + off, size - off], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _l2_prefetch_kernel(a0, n0, e0, a1, n1, e1, a2, n2, e2, a3, n3, e3, chunk, record_ptr,
                            LANES_: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):
        """Region r: a_r, n_r bytes, its chunks end at thread e_r (counted from the first region's)."""
        pdl_sync(PDL)  # the previous kernel's reads are done: DRAM is ours
        i = (tl.program_id(0) * LANES_ + tl.arange(0, LANES_)).to(tl.int64)  # this thread's chunk
        chunk = chunk.to(tl.int64)
        # the address of chunk i if it lies in region r: a_r + (i - first chunk of r) * chunk
        base = tl.where(i < e0, a0.to(tl.int64), tl.where(i < e1, a1.to(tl.int64) - e0 * chunk,
                        tl.where(i < e2, a2.to(tl.int64) - e1 * chunk, a3.to(tl.int64) - e2 * chunk)))
        end = tl.where(i < e0, a0.to(tl.int64) + n0, tl.where(i < e1, a1.to(tl.int64) + n1,
                       tl.where(i < e2, a2.to(tl.int64) + n2, a3.to(tl.int64) + n3)))
        addr = base + i * chunk
        size = tl.where(i < e3, tl.minimum(end - addr, chunk), 0)
        if MODE == "record":
            tl.store(record_ptr + 2 * i, addr)
            tl.store(record_ptr + 2 * i + 1, size)
        else:
            _issue(addr, size, chunk, MODE)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch(region_list: Sequence[tuple[int, int]], device: torch.device, mode: str, programs: int,
           record: torch.Tensor | None = None, pdl: bool = True) -> tuple[int, int]:
    """One launch over up to MAX_REGIONS regions, chunked for about `programs` programs; returns
    (chunk bytes, programs launched). record (mode "record"): int64 [programs launched * LANES * 2]
    for each thread's (address, size)."""
    assert 0 < len(region_list) <= MAX_REGIONS
    chunk = chunk_bytes(sum(n for _, n in region_list), programs, _UNIT[mode])
    padded = list(region_list) + [(0, 0)] * (MAX_REGIONS - len(region_list))
    args, ends = [], 0
    for start, n in padded:
        ends += -(-n // chunk)
        args += [start, n, ends]
    grid = -(-ends // LANES)  # each region's last chunk may be short: a few more chunks than asked
    if record is not None and record.numel() < grid * LANES * 2:
        raise ValueError(f"record holds {record.numel()} values, the launch writes {grid * LANES * 2}")
    launch_args = pdl_args(device) if pdl and mode != "record" else {"PDL": False}
    _l2_prefetch_kernel[(grid,)](*args, chunk, record, LANES_=LANES, MODE=mode, num_warps=LANES // 32, **launch_args)
    return chunk, grid


@functools.cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device_index)


_forked: set[int] = set()  # devices whose side stream has prefetches not yet joined


def join(device: torch.device) -> None:
    """Make the current stream wait for the prefetches launched on the side stream (a CUDA graph
    capture must join every stream it forked before it ends)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index in _forked:
            torch.cuda.current_stream(index).wait_stream(_side_stream(index))
            _forked.discard(index)


def l2_prefetch(tensors: Sequence[torch.Tensor]) -> None:
    """Ask the L2 for these tensors' bytes, where turned on (HALFBYTE_L2_PREFETCH), on a GPU,
    outside the interpreter, up to HALFBYTE_L2_PREFETCH_MB (within_cap); otherwise nothing."""
    mode = prefetch_mode()
    if mode is None or not tensors or tensors[0].device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    device = tensors[0].device
    if mode == "bulk" and torch.cuda.get_device_capability(device)[0] < 9:
        return
    prefix = os.environ.get("HALFBYTE_L2_PREFETCH_PREFIX", "0") == "1"
    found = within_cap(regions(tensors, lines=mode == "lines"), prefetch_cap_bytes(), prefix, _UNIT[mode])
    if not found:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if os.environ.get("HALFBYTE_L2_PREFETCH_SIDE", "0") != "1":
        for i in range(0, len(found), MAX_REGIONS):
            launch(found[i : i + MAX_REGIONS], device, mode, programs=_num_sms(index))
        return
    side = _side_stream(index)
    side.wait_stream(torch.cuda.current_stream(index))  # after the kernel before: DRAM is free
    with torch.cuda.stream(side):  # no PDL there: its edge from the main stream is a full one
        for i in range(0, len(found), MAX_REGIONS):
            launch(found[i : i + MAX_REGIONS], device, mode, programs=_num_sms(index), pdl=False)
    _forked.add(index)
