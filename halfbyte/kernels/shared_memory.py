"""Dynamic shared memory of our own beside Triton's: a launch that adds bytes to a kernel's dynamic
shared memory (and can make the launch a Hopper cluster), and, inside the kernel, the 32-bit shared
address of those bytes and cp.async copies into them.

Why: Triton allocates shared memory only for its own layout conversions and pipelines; two GEMV
experiments need a buffer of their own (cluster.py: split-K partials from other CTAs; gemv_w4's
staged one-tile path: weight sub-tiles in flight). The added bytes are the tail of the dynamic shared
memory, found from %dynamic_smem_size, so they never overlap Triton's. PTX only: the interpreter
runs the kernels' plain-load twins instead."""

from __future__ import annotations

import inspect

import torch

from halfbyte.kernels.triton_utils import HAS_TRITON, tl, triton

_functions: dict[tuple[str, int, int], int] = {}


def launch_with_shared(fn, grid: tuple[int, int, int], extra_smem: int, *args, cluster: int = 1, **kwargs) -> None:
    """Launch the Triton kernel `fn` as fn[grid](*args, **kwargs) would, each CTA with extra_smem
    more bytes of dynamic shared memory after the kernel's own; cluster > 1 makes it a cluster launch
    of that many CTAs along x (the launch then has cluster * grid[0] programs along x)."""
    kernel = fn.warmup(*args, grid=grid, **kwargs)  # compiles or finds the kernel; launches nothing
    kernel._init_handles()
    device = torch.cuda.current_device()
    shared = -(-kernel.metadata.shared // 16) * 16 + extra_smem
    key = (kernel.hash, shared, device)
    function = _functions.get(key)
    if function is None:  # the module again, loaded for the larger shared memory (opt-in past 48 KB)
        _, function, _, _, _ = triton.runtime.driver.active.utils.load_binary(kernel.name, kernel.kernel, shared, device)
        _functions[key] = function
    num_warps, _, _ = kernel.packed_metadata  # (num_warps, num_ctas, shared) in Triton 3.6-3.9
    stream = triton.runtime.driver.active.get_current_stream(device)
    kernel.run(grid[0], grid[1], grid[2], stream, function, (num_warps, cluster, shared), None, None, None,
               *bound_values(fn, args, kwargs))


def bound_values(fn, args: tuple, kwargs: dict) -> list:
    """Every parameter of fn in order (constexprs included), as its launcher takes them."""
    values = list(args)
    for p in fn.params[len(args):]:
        if p.name in kwargs:
            values.append(kwargs[p.name])
        elif p.default is not inspect.Parameter.empty:
            values.append(p.default)
        else:
            raise TypeError(f"launch_with_shared: {fn.__name__} is missing argument {p.name!r}")
    return values


if HAS_TRITON:

    @triton.jit
    def shared_tail(FROM_END: tl.constexpr, dummy):
        """The 32-bit shared address FROM_END bytes before the end of the dynamic shared memory
        (scalar; dummy: any scalar, for the asm's operand)."""
        return tl.inline_asm_elementwise(
            "{ .reg .u32 t; mov.u32 $0, global_smem; mov.u32 t, %dynamic_smem_size; add.u32 $0, $0, t; sub.u32 $0, $0, $1; }",
            "=r,r", [dummy * 0 + FROM_END], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def copy_rows_async(qw_ptr, w_row, row_ok, N, rn0, BLOCK_N: tl.constexpr, smem_rows):
        """cp.async of int32 rows w_row x columns rn0 .. rn0 + BLOCK_N into shared memory at
        smem_rows [rows] (a row's BLOCK_N words contiguous there): one 16-byte copy per 4 columns,
        whatever the layout; rows not row_ok and columns past N land as zeros (N % 4 == 0)."""
        c4 = 4 * tl.arange(0, BLOCK_N // 4)
        ok = row_ok[:, None] & ((rn0 + c4) < N)[None, :]
        src = qw_ptr + (w_row * N)[:, None] + (rn0 + c4)[None, :]
        tl.inline_asm_elementwise(
            "cp.async.cg.shared.global [$1], [$2], 16, $3;\nmov.u32 $0, 0;", "=r,r,l,r",
            [smem_rows[:, None] + (c4 * 4)[None, :], src, tl.where(ok, 16, 0)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def commit_copies(dummy):
        """Close this thread's cp.async group (wait_copies counts groups)."""
        tl.inline_asm_elementwise("cp.async.commit_group;\nmov.u32 $0, 0;", "=r,r", [dummy], dtype=tl.int32,
                                  is_pure=False, pack=1)

    # cp.async.wait_group takes its count as an immediate: one asm string per count
    WAIT_ASM = tl.constexpr(tuple(f"cp.async.wait_group {n};\nmov.b32 $0, $1;" for n in range(8)))

    @triton.jit
    def wait_copies(PENDING: tl.constexpr, acc):
        """acc unchanged once at most PENDING (0-7) of this thread's cp.async groups are in flight,
        then a CTA barrier (other threads read what this one copied). Taking acc ties the wait to
        acc's arithmetic in the PTX (ptxas may still move the wait up: it has no register operand)."""
        out = tl.inline_asm_elementwise(WAIT_ASM[PENDING], "=r,r", [acc], dtype=acc.dtype, is_pure=False, pack=1)
        tl.debug_barrier()
        return out

    @triton.jit
    def load_shared(addr):
        """int32 at 32-bit shared addresses addr (any shape)."""
        return tl.inline_asm_elementwise("ld.shared.u32 $0, [$1];", "=r,r", [addr], dtype=tl.int32, is_pure=False, pack=1)

else:  # pragma: no cover
    shared_tail = copy_rows_async = commit_copies = wait_copies = load_shared = None
