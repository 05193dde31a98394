"""SamplingParams validation, and the batched sampler against plain per-row references."""

from __future__ import annotations

import pytest
import torch

from halfbyte.engine.sampler import Sampler
from halfbyte.errors import InvalidParameterError
from halfbyte.sampling_params import SamplingParams
from tests.test_sampling_reference import FakeSeq, ref_filtered_probs, ref_penalized

EOS = {0}


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"typical_p": 0.0}, "typical_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"penalty_window": 0}, "penalty_window"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_token_ids": [-3]}, "bad_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"logits_processors": [3]}, "logits_processors"),
        ({"output_processors": ["x"]}, "output_processors"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**kwargs)


def test_token_ids_are_checked_against_the_vocab() -> None:
    SamplingParams(logit_bias={99: 1.0}).check_token_ids(100)
    for kwargs, field in [({"logit_bias": {100: 1.0}}, "logit_bias"), ({"allowed_token_ids": [5, 100]}, "allowed_token_ids"),
                          ({"bad_token_ids": [100]}, "bad_token_ids")]:
        with pytest.raises(InvalidParameterError, match=field):
            SamplingParams(**kwargs).check_token_ids(100)


FILTER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.1, typical_p=0.6),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.8, top_k=40, typical_p=0.9, min_p=0.01),
    SamplingParams(temperature=0.5, top_p=1e-9),
    SamplingParams(temperature=1.0, top_p=0.999),
    SamplingParams(temperature=6.0, top_p=0.9),  # flat: the cut lies beyond the candidates (sort fallback)
    SamplingParams(temperature=0),
]


def test_filters_match_reference_in_one_batch() -> None:
    torch.manual_seed(0)
    vocab = 3000
    seqs = [FakeSeq(p, [1]) for p in FILTER_CASES]
    logits = torch.randn(len(seqs), vocab) * 3
    got = Sampler(EOS).filtered_logits(logits, seqs).softmax(dim=1)
    for i, seq in enumerate(seqs):
        want = ref_filtered_probs(ref_penalized(logits[i], seq, EOS), seq.params)
        if seq.params.greedy:
            assert got[i].argmax() == want.argmax()
            continue
        assert (got[i].double() - want).abs().max().item() <= 1e-6, seq.params


def test_penalties_bias_and_bans_match_reference() -> None:
    torch.manual_seed(1)
    vocab = 64
    rng = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=rng).tolist()

    params = [
        SamplingParams(repetition_penalty=1.4),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=0.2, penalty_window=6),
        SamplingParams(logit_bias={3: 2.0, 9: float("-inf")}, bad_token_ids=[4]),
        SamplingParams(allowed_token_ids=[2, 5, 7], logit_bias={5: -1.0}, temperature=0.6),
        SamplingParams(min_tokens=50, stop_token_ids=[8], repetition_penalty=1.2),
        SamplingParams(temperature=0.9),  # no state: reads the pool's zero slot
    ]
    seqs = [FakeSeq(p, tokens(12)) for p in params]
    sampler = Sampler(EOS)
    for step in range(4):  # counts follow the tokens appended between steps
        logits = torch.randn(len(seqs), vocab) * 2
        got = sampler.filtered_logits(logits, seqs)
        for i, seq in enumerate(seqs):
            want = ref_penalized(logits[i], seq, EOS)
            finite = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got[i]), finite), (step, seq.params)
            assert torch.allclose(got[i][finite].double(), want[finite], atol=1e-5), (step, seq.params)
        for seq in seqs:
            seq.token_ids.extend(tokens(1 + step % 2))


def test_slots_are_reused_after_a_sequence_is_gone() -> None:
    sampler = Sampler(EOS)
    first = FakeSeq(SamplingParams(logit_bias={3: 50.0}), [1, 2])
    sampler.filtered_logits(torch.zeros(1, 10), [first])
    del first  # its slot is cleared and handed to the next request
    plain = FakeSeq(SamplingParams(presence_penalty=1.0), [1, 2])
    x = sampler.filtered_logits(torch.zeros(1, 10), [plain])
    assert x[0, 3].item() == 0.0


def test_extreme_values_behave_as_defined() -> None:
    torch.manual_seed(2)
    vocab = 500
    logits = torch.randn(4, vocab) * 4
    only = 17
    params = [
        SamplingParams(temperature=1e-5),
        SamplingParams(temperature=1.0, top_p=1e-9),
        SamplingParams(temperature=1.0, logit_bias={t: float("-inf") for t in range(vocab) if t != only}),
        SamplingParams(temperature=1e-5, top_p=1e-9, min_p=1.0, typical_p=1e-9, top_k=1),
    ]
    seqs = [FakeSeq(p, [1], ) for p in params]
    sampler = Sampler(EOS)
    x = sampler.filtered_logits(logits, seqs)
    assert not x.isnan().any()
    assert not x.softmax(dim=1).isnan().any()
    for _ in range(5):
        out = sampler.sample(logits, seqs).token_ids
        argmax = logits.argmax(dim=1).tolist()
        assert out[0] == argmax[0] and out[1] == argmax[1] and out[3] == argmax[3]
        assert out[2] == only
        for s in seqs:
            s.token_ids.append(5)


def test_seeded_rows_are_reproducible_in_any_batch() -> None:
    torch.manual_seed(3)
    vocab = 200
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=42)
    alone_seq = FakeSeq(p, [1, 2, 3])
    others = [FakeSeq(SamplingParams(temperature=0.5 + i / 10, top_k=i * 3, repetition_penalty=1.1), [i + 1])
              for i in range(15)]
    batch_seq = FakeSeq(p, [1, 2, 3])
    batch = others[:7] + [batch_seq] + others[7:]
    alone_sampler, batch_sampler = Sampler(EOS), Sampler(EOS)
    for _ in range(20):
        logits = torch.randn(16, vocab)
        a = alone_sampler.sample(logits[7:8], [alone_seq]).token_ids[0]
        b = batch_sampler.sample(logits, batch).token_ids[7]
        assert a == b
        for s, t in zip(batch, batch_sampler.sample(logits, batch).token_ids, strict=True):
            s.token_ids.append(t)
        alone_seq.token_ids.append(a)


def test_different_seeds_and_positions_give_different_draws() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any token; the draws must not repeat
    sampler = Sampler(EOS)
    tokens = [sampler.sample(logits, [FakeSeq(SamplingParams(seed=s), [1])]).token_ids[0] for s in range(20)]
    assert len(set(tokens)) > 15
    seq = FakeSeq(SamplingParams(seed=1), [1])
    walk = []
    for _ in range(20):
        walk.append(sampler.sample(logits, [seq]).token_ids[0])
        seq.token_ids.append(walk[-1])
    assert len(set(walk)) > 15


def test_logprobs_are_the_models_log_softmax() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 40)
    params = [SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=2.0), SamplingParams(), SamplingParams(logprobs=0)]
    seqs = [FakeSeq(p, [1, 2]) for p in params]
    out = Sampler(EOS).sample(logits, seqs)
    logp = logits.log_softmax(dim=1)
    assert out.logprobs[1] is None
    first = out.logprobs[0]
    assert first is not None
    top3 = logp[0].topk(3).indices.tolist()
    assert set(first) == set(top3) | {out.token_ids[0]}
    for t, v in first.items():
        assert abs(v - logp[0, t].item()) < 1e-5
    assert out.logprobs[2] == pytest.approx({out.token_ids[2]: logp[2, out.token_ids[2]].item()}, abs=1e-5)


def test_logits_processor_sees_its_row_and_output() -> None:
    seen: list[list[int]] = []

    def force_seven(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_ids))
        row = torch.full_like(row, -1e9)
        row[7] = 0.0
        return row

    seqs = [FakeSeq(SamplingParams(logits_processors=[force_seven]), [1, 2], [1, 2, 9]), FakeSeq(SamplingParams(), [3])]
    logits = torch.randn(2, 20)
    logits[1, 7] = -100.0
    out = Sampler(EOS).sample(logits, seqs)
    assert out.token_ids[0] == 7 and out.token_ids[1] != 7
    assert seen == [[9]]


def test_candidate_path_matches_reference_when_every_row_has_top_k() -> None:
    torch.manual_seed(6)
    vocab = 2000
    params = [SamplingParams(top_k=30, top_p=0.8, temperature=0.9), SamplingParams(top_k=12, typical_p=0.7),
              SamplingParams(top_k=50, min_p=0.1, repetition_penalty=1.3), SamplingParams(temperature=0),
              SamplingParams(top_k=5, top_p=0.5, typical_p=0.9, min_p=0.05, temperature=2.0)]
    seqs = [FakeSeq(p, [1, 2, 3]) for p in params]
    logits = torch.randn(len(seqs), vocab) * 3
    sampler = Sampler(EOS)
    got = sampler.filtered_logits(logits, seqs).softmax(dim=1)
    for i, seq in enumerate(seqs):
        want = ref_filtered_probs(ref_penalized(logits[i], seq, EOS), seq.params)
        if seq.params.greedy:
            assert got[i].argmax() == want.argmax()
        else:
            assert (got[i].double() - want).abs().max().item() <= 1e-6, seq.params
    tokens = sampler.sample(logits, seqs).token_ids
    assert all(got[i, t] > 0 for i, t in enumerate(tokens))
