"""Triton is optional: the CPU path runs without it. Kernel files import it from here."""

from __future__ import annotations

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
