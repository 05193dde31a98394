"""One-launch all-reduce of a small activation over peer-mapped (symmetric) memory, in Triton.

Why: a batch-1 decode step all-reduces one [1, hidden] row twice per layer (162 times per step
on the 70B shape). Inside the CUDA graph NCCL takes ~9 us per call on 2 x H200 and torch's
one-shot symmetric-memory op, which has no fp16 kernel, three launches (BENCHMARKS.md, issue 9).
Here each program of one launch, for its slice of the row:
1. writes this rank's slice into its own buffer (slot = epoch % 2),
2. after a CTA barrier, raises its flag in every peer's signal pad (release, system scope) and
   waits until every peer's flag for this slice reached the same epoch (acquire),
3. reads every rank's slice, the peers' over NVLink, and sums them in fp32 in rank order (the
   same order on every rank, so the ranks' results are bitwise equal).
Epochs are per program, counted on the device (so CUDA-graph replays advance them) and the same
on every rank because every rank makes the same calls. Two slots suffice: a rank writes a slot
again two epochs later, after the peers' flags of the epoch in between showed they were done
with it (a kernel starts only after the previous one on its stream finished).

The reference is the sum itself (`torch.stack(parts).float().sum(0)`); tests run one rank
against pre-set peer state in Triton's interpreter and two ranks on two streams of one GPU."""

from __future__ import annotations

import torch

from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton

BLOCK = 1024  # elements per program: a 16 KB fp16 row of hidden 8192 is 8 programs


if HAS_TRITON:

    @triton.jit
    def _peer_all_reduce_kernel(
        inp_ptr, out_ptr, buf_ptrs, pad_ptrs, epochs_ptr, n, slot_stride,
        RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_sync(PDL)  # launched early behind the GEMV that writes inp (programmatic dependent launch)
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        epoch = tl.load(epochs_ptr + pid) + 1  # only this program of this rank touches it
        tl.store(epochs_ptr + pid, epoch)
        slot = (epoch % 2) * slot_stride
        x = tl.load(inp_ptr + offs, mask=mask, other=0.0)
        mine = tl.load(buf_ptrs + RANK).to(tl.pointer_type(inp_ptr.dtype.element_ty))
        tl.store(mine + slot + offs, x, mask=mask)
        # every thread's stores happen before the one thread's release (cumulativity)
        tl.debug_barrier()
        for r in tl.static_range(WORLD):
            if r != RANK:
                pad = tl.load(pad_ptrs + r).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(pad + pid * WORLD + RANK, epoch, sem="release", scope="sys")
        my_pad = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32))
        for r in tl.static_range(WORLD):
            if r != RANK:
                seen = tl.atomic_add(my_pad + pid * WORLD + r, 0, sem="acquire", scope="sys")
                while seen < epoch:
                    seen = tl.atomic_add(my_pad + pid * WORLD + r, 0, sem="acquire", scope="sys")
        tl.debug_barrier()
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += x.to(tl.float32)
            else:
                peer = tl.load(buf_ptrs + r).to(tl.pointer_type(inp_ptr.dtype.element_ty))
                # .cv: never a line cached by an earlier call that read this slot
                acc += tl.load(peer + slot + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class PeerAllReduce:
    """Sum of one tensor over `world` ranks that see each other's buffers and signal pads.

    buffer_ptrs / pad_ptrs: int64 [world] device tensors, the address of every rank's buffer
    (2 * capacity elements of `dtype`, two slots) and signal pad (int32, at least
    max_programs * world of them, zero before the first call on every rank); `owners` keeps the
    memory behind them alive as long as this object."""

    def __init__(self, buffer_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, rank: int, world: int,
                 capacity: int, dtype: torch.dtype, pad_ints: int, owners: tuple[object, ...] = ()) -> None:
        self.buffer_ptrs, self.pad_ptrs = buffer_ptrs, pad_ptrs
        # what the addresses point into (the symmetric buffer and its handle): freed with them,
        # the kernel would write freed memory (seen on the H200 as an illegal address)
        self.owners = owners
        self.rank, self.world, self.capacity, self.dtype = rank, world, capacity, dtype
        self.max_programs = min(triton.cdiv(capacity, BLOCK), pad_ints // world)
        self.epochs = torch.zeros(self.max_programs, dtype=torch.int32, device=buffer_ptrs.device)

    def fits(self, t: torch.Tensor) -> bool:
        return (t.device == self.buffer_ptrs.device and t.dtype == self.dtype and t.is_contiguous()
                and t.numel() <= min(self.capacity, self.max_programs * BLOCK))

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks as a new tensor; every rank must call it with the same shape."""
        flat = t.view(-1)
        out = torch.empty_like(flat)
        self._launch(flat, out, warmup=False)
        return out.view_as(t)

    def compile(self, t: torch.Tensor) -> None:
        """Compile (and load) the kernel for t without running it. Loading a module can wait for
        the device to go idle, which never happens while another rank's kernel on the same GPU
        spins for this one (two ranks on one GPU, the tests and bench/peer_all_reduce.py)."""
        flat = t.view(-1)
        self._launch(flat, torch.empty_like(flat), warmup=True)

    def _launch(self, flat: torch.Tensor, out: torch.Tensor, warmup: bool) -> None:
        n = flat.numel()
        args = (flat, out, self.buffer_ptrs, self.pad_ptrs, self.epochs, n, self.capacity)
        kw = dict(RANK=self.rank, WORLD=self.world, BLOCK=BLOCK, num_warps=4, **pdl_args(flat.device))
        if warmup:  # compile, then load the module now (Triton loads it lazily at the first launch)
            kernel = _peer_all_reduce_kernel.warmup(*args, grid=(triton.cdiv(n, BLOCK),), **kw)
            if hasattr(kernel, "_init_handles"):
                kernel._init_handles()
        else:
            _peer_all_reduce_kernel[(triton.cdiv(n, BLOCK),)](*args, **kw)
