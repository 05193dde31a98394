"""The fused candidates kernel (kernels/sampling_candidates.py) against the torch reference
path (filter_candidates + race_ref on the same noise): the SAME filtered candidates and the
SAME token for random logits and parameters. On the CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from halfbyte.engine.sampling_filters import FilterParams, filter_candidates
from halfbyte.kernels.sampling import race_ref, row_keys
from halfbyte.kernels.triton_utils import HAS_TRITON
from tests.kernel_testing import DEVICE

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _case(seed: int, rows: int, vocab: int, use_top_p: bool, use_typ: bool, use_min_p: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * (0.5 + 3 * torch.rand(rows, 1, generator=gen))
    x[0, ::7] = float("-inf")  # banned tokens
    x[1, 3] = x[1, 5] = x[1].max() + 1  # a tie at the top
    top_k = torch.randint(1, 60, (rows,), generator=gen)
    greedy = torch.rand(rows, generator=gen) < 0.15
    top_k[greedy] = vocab
    floats = torch.ones(rows, 7)
    if use_top_p:
        floats[:, 4] = torch.where(torch.rand(rows, generator=gen) < 0.8, torch.rand(rows, generator=gen), 1.0)
    if use_typ:
        floats[:, 5] = torch.where(torch.rand(rows, generator=gen) < 0.7, 0.2 + 0.8 * torch.rand(rows, generator=gen), 1.0)
    floats[:, 6] = torch.where(torch.rand(rows, generator=gen) < 0.6, 0.3 * torch.rand(rows, generator=gen), 0.0) if use_min_p else 0.0
    floats[greedy, 4:6] = 1.0
    floats[greedy, 6] = 0.0
    keys = torch.tensor(row_keys(list(range(seed, seed + rows)), [seed] * rows), dtype=torch.int64)
    typ_rows = (floats[:, 5] < 1).nonzero().squeeze(1)
    max_top_k = int(top_k[top_k < vocab].max())
    f = FilterParams(top_k=top_k, top_p=floats[:, 4], typical_p=floats[:, 5], min_p=floats[:, 6],
                     max_top_k=max_top_k, use_top_p=use_top_p,
                     typical_rows=typ_rows if use_typ and len(typ_rows) else None, use_min_p=use_min_p,
                     candidates_only=True)
    return x, f, floats, keys, greedy


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, True), (False, True, False), (True, False, False),
                                   (False, False, False)])
@pytest.mark.parametrize("seed", range(4))
def test_fused_candidates_equal_reference(flags: tuple[bool, bool, bool], seed: int) -> None:
    from halfbyte.kernels.sampling_candidates import sample_candidates_triton

    rows, vocab = 24, 700
    x, f, floats, keys, greedy = _case(seed * 10 + sum(flags), rows, vocab, *flags)
    want_vals, ids = filter_candidates(x, f)
    want = race_ref(want_vals, keys, greedy, ids)
    vals, ids2 = x.topk(f.max_top_k, dim=1)
    assert torch.equal(ids, ids2)
    typ = (floats[:, 5] < 1) if f.typical_rows is not None else None
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    got, got_vals = sample_candidates_triton(dev(vals), dev(ids), dev(f.top_k), dev(floats), dev(keys), dev(greedy),
                                             None if typ is None else dev(typ), f.use_top_p, f.use_min_p)
    got_vals = got_vals.cpu()
    assert torch.equal(torch.isinf(got_vals), torch.isinf(want_vals))
    fin = torch.isfinite(want_vals)
    assert torch.allclose(got_vals[fin], want_vals[fin])
    assert torch.equal(got.cpu(), want)


def test_sampler_fused_path_equals_reference_path() -> None:
    """Whole Sampler, several steps, penalties + bias + every filter: the fused path and the
    torch path pick the same tokens (same seeds, same noise)."""
    from halfbyte.engine.sampler import Sampler
    from halfbyte.sampling_params import SamplingParams
    from tests.test_sampling_reference import FakeSeq

    vocab, rows = 900, 12
    gen = torch.Generator().manual_seed(5)

    def batch() -> list[FakeSeq]:
        out = []
        for i in range(rows):
            p = SamplingParams(temperature=0.0 if i == 3 else 0.5 + 0.1 * i, top_k=5 + 7 * i, top_p=0.6 + 0.03 * i,
                               min_p=0.05 if i % 2 else 0.0, typical_p=0.9 if i % 3 == 0 else 1.0,
                               repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1,
                               logit_bias={i: 2.0}, seed=100 + i)
            out.append(FakeSeq(p, list(range(i, i + 20))))
        return out

    fast, ref = batch(), batch()
    s_fast, s_ref = Sampler({0}, fused=True), Sampler({0}, fused=False)
    for _ in range(4):
        logits = (torch.randn(rows, vocab, generator=gen) * 2).to(DEVICE)
        a = s_fast.sample(logits, fast).token_ids
        b = s_ref.sample(logits, ref).token_ids
        assert a == b
        for sa, sb, t in zip(fast, ref, a, strict=True):
            sa.token_ids.append(t)
            sb.token_ids.append(t)


def test_position_keys_equal_row_key() -> None:
    from halfbyte.kernels.sampling import position_keys, row_key, seed_key

    seeds = [0, 1, 2**40 + 7, 2**62 - 1, 123456789]
    positions = [0, 5, 2**31 + 3, 77, 4096]
    got = position_keys(torch.tensor([seed_key(s) for s in seeds]), torch.tensor(positions))
    assert got.tolist() == [row_key(s, p) for s, p in zip(seeds, positions, strict=True)]


def test_batch_cache_follows_batch_changes() -> None:
    """A changed batch (a row gone, a new one, another order) rebuilds the cached row tensors:
    each row samples as it does alone."""
    from halfbyte.engine.sampler import Sampler
    from halfbyte.sampling_params import SamplingParams
    from tests.test_sampling_reference import FakeSeq

    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    seqs = [FakeSeq(SamplingParams(temperature=1.0, top_k=10 + i, seed=i), [1, 2, 3]) for i in range(4)]
    alone = [Sampler().sample(logits[i : i + 1], [s]).token_ids[0] for i, s in enumerate(seqs)]
    sampler = Sampler()
    assert sampler.sample(logits, seqs).token_ids == alone
    order = [2, 0, 3]
    assert sampler.sample(logits[order], [seqs[i] for i in order]).token_ids == [alone[i] for i in order]
    assert sampler.sample(logits, seqs).token_ids == alone
