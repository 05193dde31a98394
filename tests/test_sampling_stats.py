"""Sampled distributions, statistically: 10^5 draws on a small vocabulary per filter (and for
combinations) against the reference filtered distribution, by a chi-square test.

Each case uses a fixed seed; p > 1e-4 passes. The same statistic must reject a sampler that is
slightly wrong (an off temperature, or the unfiltered distribution), so the test has teeth."""

from __future__ import annotations

import pytest
import torch

from halfbyte.engine.sampler import Sampler
from halfbyte.kernels.sampling import race, row_keys
from halfbyte.sampling_params import SamplingParams
from tests.test_sampling_reference import FakeSeq, ref_filtered_probs, ref_penalized

DRAWS = 100_000
VOCAB = 12
P_MIN = 1e-4


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of the counts under the expected distribution (cells with p = 0 must be empty)."""
    support = expected_probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = expected_probs[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def draw_counts(x: torch.Tensor, seed: int) -> torch.Tensor:
    """DRAWS draws from one filtered row: independent keys as DRAWS requests (or positions) would have."""
    keys = torch.tensor(row_keys([seed] * DRAWS, list(range(DRAWS))), dtype=torch.int64)
    tokens = race(x.expand(DRAWS, -1).contiguous(), keys, torch.zeros(DRAWS, dtype=torch.bool))
    return torch.bincount(tokens, minlength=x.shape[0]).double()


CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(top_k=5),
    "top_p": SamplingParams(top_p=0.7),
    "min_p": SamplingParams(min_p=0.1),
    "typical_p": SamplingParams(typical_p=0.6),
    "penalties": SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
    "bias_and_bans": SamplingParams(logit_bias={2: 1.5, 3: -1.0}, bad_token_ids=[0]),
    "top_k+top_p+min_p": SamplingParams(temperature=1.3, top_k=8, top_p=0.9, min_p=0.05),
    "all": SamplingParams(temperature=0.9, top_k=9, top_p=0.95, typical_p=0.95, min_p=0.02,
                          repetition_penalty=1.2, presence_penalty=0.2, logit_bias={5: 0.5}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_distribution_matches_reference(name: str) -> None:
    params = CASES[name]
    torch.manual_seed(len(name))
    logits = torch.randn(1, VOCAB) * 1.5
    seq = FakeSeq(params, [1, 4, 4, 7], [1, 4, 4, 7, 4, 9])
    x = Sampler({11}).filtered_logits(logits, [seq])[0]
    expected = ref_filtered_probs(ref_penalized(logits[0], seq, {11}), params)
    counts = draw_counts(x, seed=100 + len(name))
    assert chi_square_p(counts, expected) > P_MIN, (name, counts / DRAWS, expected)


def test_the_statistic_rejects_a_wrong_sampler() -> None:
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 1.5
    right = logits.double().softmax(0)
    counts = draw_counts(logits.float(), seed=1)
    assert chi_square_p(counts, right) > P_MIN
    assert chi_square_p(counts, (logits.double() / 1.05).softmax(0)) < P_MIN  # temperature off by 5%
    top_k = ref_filtered_probs(logits.double(), SamplingParams(top_k=6))
    assert chi_square_p(counts, top_k) < P_MIN  # unfiltered draws against a top-k reference
