"""8-bit codes for the group scales and mins ("double quantization"), per output column.

A slice with codes stores each group's scale as an unsigned 8-bit code and its min as a signed
8-bit code, and per output column n two float16 steps:

    scale[g, n] = fp16(code_s[g, n] * scale_step[n])      code_s in 1..255
    min[g, n]   = fp16(code_m[g, n] * min_step[n])        code_m in -127..127

(products in float32, which are exact, rounded once to float16). 16 bits per group instead of 32,
plus 32 per column: 4-bit group 32 costs 4.5 + 32 / K bits per weight instead of 5.0, and holds a weight that already sits on a 4-bit
group-32 grid (a Q4_1 GGUF) almost exactly (SmolLM2: mean KL 0.003 against 0.18 for re-rounding
it to groups of 64 at the same 4.5 bpw). In memory the decoded fp16 scales and mins are what the
kernels read; the codes exist in the file and in the bit accounting."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halfbyte.errors import QuantizationError

SCALE_LEVELS = 255
MIN_LEVELS = 127
# steps at least 2^-22: a code times its step then never rounds to an fp16 zero, and the code is
# recovered exactly from the fp16 value (rounding error <= 2^-25 < step / 2)
_MIN_STEP = 2.0**-22


@dataclass
class ScaleCodes:
    """The per-column steps of a coded slice: float16 [N] each."""

    scale_step: torch.Tensor
    min_step: torch.Tensor

    def to(self, device: torch.device | str) -> ScaleCodes:
        return ScaleCodes(self.scale_step.to(device), self.min_step.to(device))

    @staticmethod
    def cat(parts: list[ScaleCodes]) -> ScaleCodes:
        return ScaleCodes(torch.cat([p.scale_step for p in parts]), torch.cat([p.min_step for p in parts]))


def steps_for(scales: torch.Tensor, mins: torch.Tensor) -> ScaleCodes:
    """Steps that let the largest scale and the largest |min| of each column [G, N] be coded."""
    return ScaleCodes(_fp16_step(scales.float().amax(0) / SCALE_LEVELS), _fp16_step(mins.float().abs().amax(0) / MIN_LEVELS))


def _fp16_step(step: torch.Tensor) -> torch.Tensor:
    # nudged up before rounding so the top code still reaches the largest value
    return (step.clamp_min(_MIN_STEP) * (1 + 2.0**-10)).half()


def grid_steps(w: torch.Tensor, bits: int, group_size: int) -> ScaleCodes:
    """Steps for quantizing w [N, width] at `bits` in groups: from each group's min-max grid
    (what the quantizer starts from; GPTQ's later groups may exceed it and are clamped)."""
    n, width = w.shape
    maxq = (1 << bits) - 1
    pad = -width % group_size
    wg = torch.nn.functional.pad(w.float(), (0, pad), value=float("nan")).view(n, -1, group_size)
    lo = torch.nan_to_num(wg, nan=float("inf")).amin(-1)
    hi = torch.nan_to_num(wg, nan=float("-inf")).amax(-1)
    return steps_for(((hi - lo) / maxq).t(), lo.t())


def snap(scale: torch.Tensor, mn: torch.Tensor, codes: ScaleCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest coded (scale, min) to a group's (scale, min) [N]: float32 holding fp16 values."""
    step_s, step_m = codes.scale_step.float(), codes.min_step.float()
    code_s = torch.clamp(torch.round(scale / step_s), 1, SCALE_LEVELS)
    code_m = torch.clamp(torch.round(mn / step_m), -MIN_LEVELS, MIN_LEVELS)
    return (code_s * step_s).half().float(), (code_m * step_m).half().float()


def decode(scale_codes: torch.Tensor, min_codes: torch.Tensor, codes: ScaleCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 / int8 codes [G, N] -> fp16 scales and mins [G, N]."""
    scales = (scale_codes.float() * codes.scale_step.float()[None, :]).half()
    mins = (min_codes.float() * codes.min_step.float()[None, :]).half()
    return scales, mins


def encode(scales: torch.Tensor, mins: torch.Tensor, codes: ScaleCodes, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scales and mins [G, N] -> their uint8 / int8 codes; QuantizationError naming `where`
    if they are not exactly coded values of these steps."""
    code_s = torch.round(scales.float() / codes.scale_step.float()[None, :])
    code_m = torch.round(mins.float() / codes.min_step.float()[None, :])
    if not bool(((code_s >= 1) & (code_s <= SCALE_LEVELS)).all()) or not bool((code_m.abs() <= MIN_LEVELS).all()):
        raise QuantizationError(f"{where}: scales or mins out of the range of their 8-bit codes")
    s8, m8 = code_s.to(torch.uint8), code_m.to(torch.int8)
    back_s, back_m = decode(s8, m8, codes)
    if not (torch.equal(back_s, scales.half()) and torch.equal(back_m, mins.half())):
        raise QuantizationError(f"{where}: scales or mins are not exact 8-bit codes of their steps")
    return s8, m8


def check_codes(codes: ScaleCodes, n: int, where: str) -> None:
    for name, t in (("scale_step", codes.scale_step), ("min_step", codes.min_step)):
        if t.dtype != torch.float16 or tuple(t.shape) != (n,):
            raise QuantizationError(f"{where}: {name} must be float16 [{n}], got {t.dtype} {list(t.shape)}")
        if not bool(torch.isfinite(t).all()) or not bool((t >= _MIN_STEP).all()):
            raise QuantizationError(f"{where}: {name} must be finite and at least 2^-22")
