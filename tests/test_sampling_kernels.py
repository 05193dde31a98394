"""The sampling kernels (fused penalties, exponential race) against their torch references;
on the CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from halfbyte.kernels.sampling import penalize_ref, penalize_triton, race_ref, race_triton, row_keys, uniform_noise_ref
from halfbyte.kernels.triton_utils import HAS_TRITON
from tests.kernel_testing import DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("vocab", [37, 1500])
def test_penalize_kernel_matches_reference(dtype: torch.dtype, vocab: int) -> None:
    torch.manual_seed(vocab)
    rows, slots = 5, 4
    logits = (torch.randn(rows, vocab) * 3).to(dtype).to(DEVICE)
    counts = torch.randint(0, 3, (slots, vocab), dtype=torch.int32, device=DEVICE)
    counts[0] = 0
    seen = (torch.rand(slots, vocab, device=DEVICE) < 0.2).to(torch.int8)
    seen[0] = 0
    additive = torch.randn(slots, vocab, device=DEVICE)
    additive[1, ::3] = float("-inf")
    additive[0] = 0
    row_slots = torch.tensor([0, 1, 2, 3, 1], dtype=torch.int32, device=DEVICE)
    row_params = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.3, 0.5, 0.2, 2.0], [0.7, -0.4, 1.0, 0.5],
                               [1.0, 0.0, 0.0, 1e5], [2.0, 1.5, -1.5, 1.0]], device=DEVICE)
    got = penalize_triton(logits, row_slots, counts, seen, additive, row_params)
    want = penalize_ref(logits, row_slots, counts, seen, additive, row_params)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("vocab", [50, 5000])
def test_race_kernel_matches_reference(vocab: int) -> None:
    torch.manual_seed(vocab + 1)
    rows = 6
    x = (torch.randn(rows, vocab) * 2).to(DEVICE)
    x[1, vocab // 2 :] = float("-inf")  # filtered tokens never win
    x[2] = float("-inf")
    x[2, vocab - 1] = 0.0  # one survivor at the very end
    keys = torch.tensor(row_keys(list(range(rows)), [7] * rows), dtype=torch.int64, device=DEVICE)
    greedy = torch.tensor([False, False, False, True, False, True], device=DEVICE)
    got = race_triton(x, keys, greedy)
    want = race_ref(x, keys, greedy)
    assert torch.equal(got, want)
    assert got[1] < vocab // 2 and got[2] == vocab - 1
    assert got[3] == x[3].argmax() and got[5] == x[5].argmax()


def test_noise_is_uniform_and_independent_of_the_batch() -> None:
    keys = torch.tensor(row_keys([1, 2, 3], [0, 0, 0]))
    u = uniform_noise_ref(keys, 100_000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert torch.equal(uniform_noise_ref(keys[1:2], 100_000)[0], u[1])
    corr = torch.corrcoef(u)
    assert (corr - torch.eye(3)).abs().max() < 0.02  # rows of different keys are unrelated


def test_noise_never_reaches_one_so_filtered_tokens_never_win() -> None:
    # the largest hash gives the largest U; it must stay below 1 in fp32 (E > 0, finite log E)
    keys = torch.tensor(row_keys([0], [0]))
    u = uniform_noise_ref(keys, 1 << 20)
    assert u.max().item() < 1.0 and torch.isfinite(torch.log(-torch.log(u))).all()


def test_race_on_candidates_equals_the_full_row_draw() -> None:
    torch.manual_seed(9)
    rows, vocab, k = 4, 300, 17
    full = torch.randn(rows, vocab, device=DEVICE) * 2
    vals, ids = full.topk(k, dim=1)
    masked = torch.full_like(full, float("-inf")).scatter_(1, ids, vals)
    keys = torch.tensor(row_keys([11, 12, 13, 14], [3] * rows), dtype=torch.int64, device=DEVICE)
    greedy = torch.tensor([False, True, False, False], device=DEVICE)
    want = race_ref(masked, keys, greedy)
    assert torch.equal(race_ref(vals, keys, greedy, ids), want)
    assert torch.equal(race_triton(vals, keys, greedy, ids), want)


def test_mostly_filtered_rows_draw_as_the_full_race() -> None:
    """race_ref hashes only the live tokens of a mostly filtered batch: the draw is the full
    race's (noise on every token, filtered ones at -inf)."""
    torch.manual_seed(5)
    rows, vocab = 6, 4000
    x = torch.randn(rows, vocab) * 2
    x[x < 1.5] = float("-inf")  # ~7% of each row alive
    keys = torch.tensor(row_keys(list(range(rows)), [2] * rows), dtype=torch.int64)
    greedy = torch.tensor([False, False, True, False, False, False])
    full = (x - torch.log(-torch.log(uniform_noise_ref(keys, vocab)))).argmax(dim=1)
    full[2] = x[2].argmax()
    assert torch.equal(race_ref(x, keys, greedy), full)
