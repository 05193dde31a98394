"""Triton is optional: the CPU path runs without it. Kernel files import it from here."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")
    except Exception:  # no NVIDIA backend, or an older Triton
        return False


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if os.environ.get("HALFBYTE_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and _triton_has_pdl()


def pdl_args(device: torch.device) -> dict[str, Any]:
    """Launch arguments for programmatic dependent launch (Hopper and later): a kernel launched
    with them may start while the previous kernel on the stream finishes, and waits for it in
    `pdl_sync` before touching memory. In a decode step of ~330 small launches this hides the
    launch gap and the ramp-up of each kernel. HALFBYTE_PDL=0 turns it off."""
    if device.type == "cuda" and _pdl_on(device.index if device.index is not None else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if HAS_TRITON:

    @triton.jit
    def pdl_sync(PDL: tl.constexpr):
        """First statement of every kernel launched with pdl_args, before any load or store, in
        every program: wait until the previous kernel finished (its writes visible), then let
        the next kernel launch. Waiting in every program keeps the chain transitive: a kernel
        cannot finish before the one before it did."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

else:  # pragma: no cover
    pdl_sync = None
