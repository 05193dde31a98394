"""The dequantize-and-dot PTX blocks of gemv_w4 (4 bits) and gemv_w2 (2 bits), run in a small
emulator (tests/ptx_emulator.py) on random words and small-integer x (exact in fp16, so the result
must equal the integer sum): CI's interpreter runs the kernels' plain-Triton twins, this checks the
asm text the GPU runs — masks, magic constants, the value pairing, operand order."""

from __future__ import annotations

import random

import pytest

from halfbyte.kernels import gemv_w2, gemv_w4
from tests.ptx_emulator import half2, run_dot_asm


def _values(word: int, bits: int) -> list[int]:
    return [(word >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)]


@pytest.mark.parametrize("trial", range(3))
def test_gemv_w2_dot_is_the_sum_of_q_minus_2_times_x(trial: int) -> None:
    rng = random.Random()
    for _ in range(200):
        word = rng.getrandbits(32)
        x = [rng.randint(-8, 8) for _ in range(16)]
        pairs = [half2(x[j], x[j + 8]) for j in range(8)]  # (x_j, x_j+8): what gemv_w2._two_pairs builds
        want = sum((q - 2) * xj for q, xj in zip(_values(word, 2), x))
        assert run_dot_asm(gemv_w2._DOT_ASM, [word, *pairs]) == want, (hex(word), x)


@pytest.mark.parametrize("words", [1, 2])
def test_gemv_w4_dot_is_the_sum_of_q_minus_8_times_x(words: int) -> None:
    asm = gemv_w4._DOT8_ASM if words == 1 else gemv_w4._DOT16_ASM
    rng = random.Random()
    for _ in range(300):
        ws = [rng.getrandbits(32) for _ in range(words)]
        xs = [[rng.randint(-6, 6) for _ in range(8)] for _ in range(words)]
        pairs = [half2(x[j], x[j + 4]) for x in xs for j in range(4)]  # (x0,x4) (x1,x5) (x2,x6) (x3,x7) per word
        want = sum((q - 8) * xj for w, x in zip(ws, xs) for q, xj in zip(_values(w, 4), x))
        assert run_dot_asm(asm, [*ws, *pairs]) == want, ([hex(w) for w in ws], xs)


def test_the_emulator_rounds_f16x2_like_ptx_and_knows_its_limits() -> None:
    dot = ("{ .reg .b32 acc; .reg .b16 lo, hi; .reg .f32 f0, f1; fma.rn.f16x2 acc, $1, $2, $3; mov.b32 {lo, hi}, acc;"
           " cvt.f32.f16 f0, lo; cvt.f32.f16 f1, hi; add.f32 $0, f0, f1; }")
    assert run_dot_asm(dot, [half2(2048, 0), half2(1, 0), half2(1, 0)]) == 2048.0  # 2049 is no fp16: nearest-even
    assert run_dot_asm(dot, [half2(1024, 3), half2(1, 2), half2(1, 1)]) == 1025.0 + 7.0
    with pytest.raises(NotImplementedError, match="div.rn.f32"):
        run_dot_asm("{ div.rn.f32 $0, $1, $2; }", [1, 2])
