"""Process-group setup: gloo on the CPU, NCCL (plus a gloo group for control messages) on CUDA;
ranks spawned by halfbyte or launched by torchrun (RANK / WORLD_SIZE / MASTER_ADDR set)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from halfbyte.errors import InvalidParameterError

# a rank that waits this long on a collective gives up (a dead peer must not hang the others)
TIMEOUT = timedelta(seconds=float(os.environ.get("HALFBYTE_TP_TIMEOUT", "120")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def check_devices(n: int, device: torch.device) -> None:
    """Fail before loading when the ranks cannot each have a GPU."""
    if device.type == "cuda":
        have = torch.cuda.device_count()
        if n > have:
            raise InvalidParameterError(f"tensor_parallel_size {n} needs {n} CUDA devices; {have} visible")


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank)) if launched_by_torchrun() else rank
    return torch.device("cuda", local)


@dataclass
class Groups:
    rank: int
    world_size: int
    compute: dist.ProcessGroup  # the layers' all-reduce / all-gather
    control: dist.ProcessGroup  # gloo: the step broadcast, CPU objects


def init_groups(rank: int, world_size: int, device: torch.device, init_method: str | None) -> Groups:
    """Join (or reuse) the default group; init_method None: torchrun's env:// rendezvous."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=init_method or "env://", rank=rank, world_size=world_size, timeout=TIMEOUT
        )
    default = dist.group.WORLD
    assert default is not None
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if device.type == "cuda" else default
    return Groups(dist.get_rank(), dist.get_world_size(), default, control)


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
