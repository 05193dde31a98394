"""All-reduce of small activations through symmetric memory, one Triton launch per call.

Why: at batch 1 a decode step all-reduces a [1, hidden] row twice per layer (162 times per step
on the 70B shape). Inside the CUDA graph NCCL takes ~9 us per call at 2 ranks on H200s, ~1.5 ms
of a ~9.4 ms step (BENCHMARKS.md, issue 9: the step of one rank's shard measured alone). torch's
one-shot op over the same memory has no fp16 kernel (torch 2.11): cast, all-reduce in fp32 and
cast back took three launches and was ~5% slower than NCCL (70B 81.0-81.3 vs 85.1 tok/s). Now
the symmetric buffer and signal pads that torch maps on every rank feed our own kernel
(peer_all_reduce.py): one launch in the activations' dtype, each rank reading its peers' rows
directly over NVLink.

Opt-in (HALFBYTE_TP_ALLREDUCE=symm). Without CUDA, an older torch or a failed rendezvous the
collectives stay on NCCL, saying why once. The buffer is allocated by every rank at the same
point (the rendezvous is collective): when the rank's Collectives are made, before the shard
loads."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from halfbyte.distributed.peer_all_reduce import PeerAllReduce

ENV = "HALFBYTE_TP_ALLREDUCE"  # "nccl" (default) or "symm"
MAX_BYTES = 1 << 20  # decode rows (16 KB at hidden 8192) and short chunks; longer prefills use NCCL

log = logging.getLogger(__name__)

def requested() -> bool:
    choice = os.environ.get(ENV, "nccl")
    if choice not in ("nccl", "symm"):
        from halfbyte.errors import InvalidParameterError

        raise InvalidParameterError(f"{ENV} must be nccl or symm, got {choice!r}")
    return choice == "symm"


def make_symm_all_reduce(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> PeerAllReduce | None:
    """Every rank calls this at the same point; None means NCCL for every all-reduce."""
    if not requested() or device.type != "cuda":  # a bad value fails on every device
        return None
    made: PeerAllReduce | None = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        capacity = MAX_BYTES // dtype.itemsize
        buffer = symm_mem.empty(2 * capacity, dtype=dtype, device=device)  # two slots
        handle = symm_mem.rendezvous(buffer, group.group_name)
        if handle.buffer_ptrs[handle.rank] != buffer.data_ptr():
            raise RuntimeError("the symmetric buffer does not start its allocation")
        pad_ints = handle.signal_pad_size // 4
        handle.get_signal_pad(handle.rank, [pad_ints], torch.int32).zero_()  # epochs start at 0 everywhere
        made = PeerAllReduce(
            torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device),
            torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device),
            handle.rank, handle.world_size, capacity, dtype, pad_ints, owners=(buffer, handle),
        )
    except Exception as e:  # an older torch, no P2P between the GPUs, a failed rendezvous
        log.warning("%s=symm: symmetric memory unavailable (%s: %s); all-reduce stays on NCCL",
                    ENV, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    # every rank must take the same path, or one would wait for flags the others never raise;
    # the all-reduce also orders every rank's zeroed pad before anyone's first flag
    torch.cuda.synchronize(device)
    ok = torch.tensor([1 if made is not None else 0], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return made if int(ok.item()) == 1 else None
