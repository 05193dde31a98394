"""What rank 0 broadcasts to the workers each step: the runner's prepared tensors (input ids,
positions, attention metadata with slot mapping and block tables) and KV page copies, as CPU
objects over the gloo control group; the hidden rows of a logits call as one tensor."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from halfbyte.kernels.attention import AttentionMetadata

STEP, LOGITS, COPY, POOL, STOP = "step", "logits", "copy", "pool", "stop"


def broadcast_rows(hidden: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """The hidden rows rank 0 computes logits for, sent over the compute group (NCCL on GPUs)."""
    if hidden is None:
        hidden = torch.empty(shape, dtype=dtype, device=device)
    hidden = hidden.contiguous()
    dist.broadcast(hidden, src=0, group=group)
    return hidden


def _cpu(v: Any) -> Any:
    return v.cpu() if isinstance(v, torch.Tensor) else v


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> dict[str, Any]:
    fields = {f.name: _cpu(getattr(meta, f.name)) for f in dataclasses.fields(meta)}
    return {"input_ids": input_ids.cpu(), "positions": positions.cpu(), "meta": fields}


def unpack_step(msg: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    fields: dict[str, Any] = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in msg["meta"].items()}
    return msg["input_ids"].to(device), msg["positions"].to(device), AttentionMetadata(**fields)


def broadcast(msg: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0 sends msg; every other rank returns what rank 0 sent."""
    box = [msg]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_to_all(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
