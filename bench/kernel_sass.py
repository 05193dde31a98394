"""gemv_w4 compiled for the H200 (sm_90) on a machine without a GPU: registers, occupancy and SASS
instructions per 32-bit weight word in the main loop, for tile configs. No device time needed;
the timing itself still happens on the GPU (bench/gemv.py).

    .venv/bin/python bench/kernel_sass.py 64,32,8 256,16,4     # block_n,block_kw,warps
    PYTHONPATH=/tmp/t36 .venv/bin/python bench/kernel_sass.py --dump 64,32,8   # the device's Triton

Triton's wheel carries ptxas and cuobjdump, so `triton.compile` for a CUDA target works on the CPU
machine. The device runs Triton 3.6 (GPU.md); `pip install --no-deps --target /tmp/t36
triton==3.6.0` and PYTHONPATH=/tmp/t36 compile with that one. Measured this way (3.6, 2026-12-04,
BENCHMARKS.md): ~27-37 instructions per word whatever the tile, where the dequantize-and-dot core
is ~16, and Nsight Compute on the device showed the large shapes issue-bound.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.backends.nvidia as nvidia_backend  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from halfbyte.kernels import gemv_w4, gemv_w4_i8  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
REGS_PER_SM, THREADS_PER_SM, BLOCKS_PER_SM = 65536, 2048, 32


def compile_gemv_w4(block_n: int, block_kw: int, warps: int, group: int = 128,
                    pair_rows: bool = False, one_tile: bool = False, early_scales: bool = False,
                    cluster: bool = False, stages: int = 1) -> triton.compiler.CompiledKernel:
    """The one-row kernel as bench/gemv.py launches it: pointers and N, K, k_per_split divisible
    by 16 (what the JIT specialises on for Llama shapes), split-K on, PDL on."""
    sig = {"x_ptr": "*fp16", "qw_ptr": "*i32", "scales_ptr": "*fp16", "mins_ptr": "*fp16", "out_ptr": "*fp16",
           "partial_ptr": "*fp32", "counter_ptr": "*i32", "N": "i32", "K": "i32", "k_per_split": "i32"}
    consts = dict(GROUP=group, BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=2, PAIR_ROWS=pair_rows, USE_ASM=True, PDL=True,
                  DIAG=0, ONE_TILE=one_tile, EARLY_SCALES=early_scales, CLUSTER=cluster,
                  STAGES=stages)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
    src = ASTSource(fn=gemv_w4._gemv_w4_m1_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=H200, options=dict(num_warps=warps, num_stages=2, launch_pdl=True))


def compile_gemv_w4_i8(block_n: int, block_kw: int, warps: int, group: int = 128) -> triton.compiler.CompiledKernel:
    """gemv_w4_i8's GEMV (x as int8 planes, dp4a), specialised as gemv_w4 above."""
    sig = {"planes_ptr": "*i32", "xs_ptr": "*fp32", "xrow_ptr": "*fp32", "qw_ptr": "*i32", "scales_ptr": "*fp16",
           "mins_ptr": "*fp16", "out_ptr": "*fp16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "N": "i32",
           "K": "i32", "k_per_split": "i32"}
    consts = dict(GROUP=group, BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=2, USE_ASM=True, PDL=True)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
    src = ASTSource(fn=gemv_w4_i8._gemv_w4_i8_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=H200, options=dict(num_warps=warps, num_stages=2, launch_pdl=True))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(nvidia_backend.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loop_body(sass: str) -> list[str]:
    """The instructions of the main loop: from the target of the last backward branch to it."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]  # type: ignore[union-attr]
    lo = hi = None
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a:
            lo, hi = int(m.group(1), 16), a
    if lo is None:
        raise SystemExit("no loop found in the SASS")
    return [re.sub(r"\s*/\* 0x[0-9a-f]+ \*/", "", ln).strip() for a, ln in zip(addr, lines) if lo <= a <= hi]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+", help="block_n,block_kw,warps[,flags] (flags: p pair_rows, o one_tile "
                    "(no loop: the whole kernel is counted), e early_scales, c cluster combine, sN N staged sub-tiles, i gemv_w4_i8)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dump", action="store_true", help="print the loop's SASS")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm_90")
    for spec in args.configs:
        fields = spec.split(",")
        block_n, block_kw, warps = (int(v) for v in fields[:3])
        flags = fields[3] if len(fields) > 3 else ""
        pairs, one_tile, i8 = "p" in flags, "o" in flags, "i" in flags
        kernel = (compile_gemv_w4_i8(block_n, block_kw, warps, args.group) if i8
                  else compile_gemv_w4(block_n, block_kw, warps, args.group, pairs, one_tile, "e" in flags, "c" in flags,
                                           int(m.group(1)) if (m := re.search(r"s(\d)", flags)) else 1))
        regs = int(re.search(r"REG:(\d+)", _cuobjdump(kernel.asm["cubin"], "-res-usage")).group(1))  # type: ignore[union-attr]
        sass = _cuobjdump(kernel.asm["cubin"], "-sass")
        body = ([ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)] if one_tile else loop_body(sass))
        ops: dict[str, int] = {}
        for ln in body:
            m = re.search(r"^/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", ln)
            if m:
                ops[m.group(1)] = ops.get(m.group(1), 0) + 1
        words = block_n * block_kw / (32 * warps)  # per thread per iteration
        blocks = min(REGS_PER_SM // (regs * 32 * warps), THREADS_PER_SM // (32 * warps), BLOCKS_PER_SM)
        top = ", ".join(f"{k} {v / words:.1f}" for k, v in sorted(ops.items(), key=lambda t: -t[1])[:8])
        print(f"{block_n:>4} x {block_kw:<3} {warps} warps{' pairs' if pairs else '    i8' if i8 else '      '}{' one tile' if one_tile else ''}: {regs:>3} registers, {blocks:>2} programs/SM, "
              f"{len(body) / words:5.1f} instructions/word ({top})")
        if args.dump:
            print("\n".join(body))


if __name__ == "__main__":
    main()
