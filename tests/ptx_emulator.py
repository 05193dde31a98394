"""A tiny emulator for the PTX blocks the GEMV kernels inline (`_dot_asm`): the few opcodes they use,
with PTX's rounding (f16x2 ops round once to fp16, nearest-even). CI has no GPU and Triton's
interpreter cannot run PTX, so this is how the CPU tests check the asm text itself: its constants,
masks and operand order. Operands are $0 (the fp32 result), $1.. (32-bit inputs)."""

from __future__ import annotations

import numpy as np


def _halves(u: int) -> np.ndarray:
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)


def _pack(pair: np.ndarray) -> int:
    lo, hi = pair.astype(np.float16).view(np.uint16)
    return int(lo) | (int(hi) << 16)


def run_dot_asm(asm: str, inputs: list[int]) -> float:
    """Execute asm on 32-bit inputs ($1, $2, ...); returns $0 (fp32)."""
    regs: dict[str, object] = {f"${i + 1}": v for i, v in enumerate(inputs)}

    def val(token: str) -> int:
        return int(token, 16) if token.startswith("0x") else int(regs[token])  # type: ignore[call-overload]

    for raw in asm.replace(";", "\n").splitlines():
        line = raw.strip().strip("{}").strip()
        if not line or line.startswith("."):
            continue
        op, rest = line.split(None, 1)
        a = [t.strip() for t in rest.replace("{", "").replace("}", "").split(",")]
        if op == "mov.b32" and len(a) == 3:  # {lo, hi} <- a half2 register
            regs[a[0]], regs[a[1]] = _halves(val(a[2]))
        elif op == "mov.b32":
            regs[a[0]] = val(a[1]) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        elif op == "lop3.b32" and a[4] == "0xea":  # (a & b) | c
            regs[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op == "sub.f16x2":
            regs[a[0]] = _pack(_halves(val(a[1])) - _halves(val(a[2])))
        elif op == "mul.rn.f16x2":
            regs[a[0]] = _pack(_halves(val(a[1])) * _halves(val(a[2])))
        elif op == "fma.rn.f16x2":
            regs[a[0]] = _pack(_halves(val(a[1])) * _halves(val(a[2])) + _halves(val(a[3])))
        elif op == "cvt.f32.f16":
            regs[a[0]] = float(regs[a[1]])  # type: ignore[arg-type]
        elif op == "add.f32":
            regs[a[0]] = float(np.float32(float(regs[a[1]]) + float(regs[a[2]])))  # type: ignore[arg-type]
        else:
            raise NotImplementedError(f"ptx_emulator: {line}")
    return float(regs["$0"])  # type: ignore[arg-type]


def half2(lo: float, hi: float) -> int:
    """Two fp16 values as one 32-bit operand (lo in bits 0-15)."""
    return _pack(np.array([lo, hi]))
