"""SamplingParams validation and the batched sampler's filters against plain per-row references."""

from __future__ import annotations

import pytest
import torch

from halfbyte.engine.sampler import apply_filters, sample
from halfbyte.errors import InvalidParameterError
from halfbyte.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**kwargs)


def _ref_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Straight from the definitions, one row, with Python loops over sorted tokens."""
    logits = row.double() / (p.temperature or 1.0)
    keep = torch.ones_like(logits, dtype=torch.bool)
    order = logits.argsort(descending=True).tolist()
    if p.top_k > 0:
        for t in order[p.top_k :]:
            keep[t] = False
    if p.top_p < 1:
        probs = torch.where(keep, logits, torch.tensor(float("-inf"), dtype=logits.dtype)).softmax(0)
        mass = 0.0
        for t in order:
            if not keep[t]:
                continue
            if mass >= p.top_p:
                keep[t] = False
            mass += probs[t].item()
    if p.min_p > 0:
        probs = torch.where(keep, logits, torch.tensor(float("-inf"), dtype=logits.dtype)).softmax(0)
        keep &= probs >= p.min_p * probs.max()
    return torch.where(keep, logits, torch.tensor(float("-inf"), dtype=logits.dtype)).softmax(0)


def test_filters_match_reference() -> None:
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=0.5, top_p=1e-9),
    ]
    logits = torch.randn(len(params), 300) * 3
    got = apply_filters(logits, params).softmax(dim=1)
    for i, p in enumerate(params):
        assert torch.allclose(got[i].double(), _ref_filter(logits[i], p), atol=1e-6), p


def test_greedy_and_top_p_tiny_pick_the_argmax() -> None:
    logits = torch.randn(4, 100)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=1e-9),
              SamplingParams(temperature=1e-5), SamplingParams(temperature=2.0, top_k=1)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    assert torch.equal(sample(logits, params, gens), logits.argmax(dim=1))


def test_seeded_rows_are_reproducible_in_any_batch() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits[3:4], [p], [torch.Generator().manual_seed(42)]).item()]
    others = [SamplingParams(temperature=1.0) for _ in range(8)]
    others[3] = p
    gens: list[torch.Generator | None] = [None] * 8
    gens[3] = torch.Generator().manual_seed(42)
    batched = sample(logits, others, gens)
    assert batched[3].item() == alone[0]


def test_sampled_distribution_matches_filtered_probs() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, 6)
    p = SamplingParams(temperature=0.8, top_k=4)
    expected = apply_filters(logits, [p]).softmax(dim=1)[0]
    gen = torch.Generator().manual_seed(3)
    draws = 20000
    counts = torch.zeros(6)
    batch = logits.expand(draws, 6)
    rows = sample(batch, [p] * draws, [gen] * draws)
    counts += torch.bincount(rows, minlength=6).float()
    freq = counts / draws
    assert counts[expected == 0].sum() == 0
    # 4-sigma band of a binomial proportion
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert ((freq - expected).abs() <= 4 * sigma + 1e-9).all(), (freq, expected)
