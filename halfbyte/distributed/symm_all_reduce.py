"""All-reduce of small activations through symmetric memory, one kernel per call.

Why: at batch 1 a decode step all-reduces a [1, hidden] row twice per layer (162 times per step
on the 70B shape). Inside the CUDA graph NCCL took ~30 us per call at 2 ranks on H200s
(BENCHMARKS.md, issue 9), which ate most of what halving the weights per rank saved.
`torch.ops.symm_mem.one_shot_all_reduce_copy_out` copies this rank's tensor into its symmetric
buffer, waits for the peers (a flag handshake through the signal pads) and sums every rank's
buffer read directly over NVLink: no ring, no protocol negotiation, one launch.

Opt-in (HALFBYTE_TP_ALLREDUCE=symm), and measured slower than NCCL on 2 x H200 (torch 2.11,
BENCHMARKS.md issue 9): the op has no fp16 kernel, so an fp16 row costs three launches (cast,
all-reduce in fp32, cast back): 70B 81.0-81.3 vs 85.1 tok/s, 8B 325.6 vs 339.7. Without CUDA, an
older torch or a failed rendezvous the collectives stay on NCCL, saying why once. The buffer is
allocated by every rank at the same point (the rendezvous is collective): when the rank's
Collectives are made, before the shard loads."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

ENV = "HALFBYTE_TP_ALLREDUCE"  # "nccl" (default) or "symm"
MAX_BYTES = 1 << 20  # decode rows (16 KB at hidden 8192) and short chunks; longer prefills use NCCL

log = logging.getLogger(__name__)


def buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The one-shot kernel has no fp16 variant (torch 2.11: "not implemented for 'Half'", H200):
    fp16 rows are summed in fp32, one cast in and one out."""
    return torch.float32 if dtype == torch.float16 else dtype


class SymmAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str, dtype: torch.dtype | None = None) -> None:
        self.buffer = buffer  # symmetric: the same size on every rank, readable by the peers
        self.group_name = group_name
        self.dtype = dtype or buffer.dtype  # the activations' dtype (the buffer's, or fp16 over fp32)

    def fits(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * self.buffer.element_size()
        # the kernel moves 16-byte vectors and wants the input aligned as the buffer is
        return (t.is_cuda and t.dtype == self.dtype and t.is_contiguous() and nbytes <= MAX_BYTES
                and nbytes % 16 == 0 and t.data_ptr() % 16 == 0)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, as a new tensor (the op's output must not alias its input)."""
        flat = t.view(-1).to(self.buffer.dtype)
        out = torch.empty_like(flat)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buffer[: flat.numel()], flat, "sum", self.group_name, out)
        return out.view_as(t).to(self.dtype)


def requested() -> bool:
    choice = os.environ.get(ENV, "nccl")
    if choice not in ("nccl", "symm"):
        from halfbyte.errors import InvalidParameterError

        raise InvalidParameterError(f"{ENV} must be nccl or symm, got {choice!r}")
    return choice == "symm"


def make_symm_all_reduce(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> SymmAllReduce | None:
    """Every rank calls this at the same point; None means NCCL for every all-reduce."""
    if not requested() or device.type != "cuda":  # a bad value fails on every device
        return None
    made: SymmAllReduce | None = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018 - present since torch 2.8
        wide = buffer_dtype(dtype)
        buffer = symm_mem.empty(MAX_BYTES // wide.itemsize, dtype=wide, device=device)
        symm_mem.rendezvous(buffer, group.group_name)
    except Exception as e:  # an older torch, no P2P between the GPUs, a failed rendezvous
        log.warning("%s=symm: symmetric memory unavailable (%s: %s); all-reduce stays on NCCL",
                    ENV, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    else:
        made = SymmAllReduce(buffer, group.group_name, dtype)
    # every rank must take the same path, or one would wait in a handshake the others never join
    ok = torch.tensor([1 if made is not None else 0], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return made if int(ok.item()) == 1 else None
