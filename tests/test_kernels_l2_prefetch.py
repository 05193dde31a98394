"""The L2 prefetch (kernels/l2_prefetch.py): which bytes each thread asks for, held to the
reference plan through the kernel's record mode (the interpreter here, natively on a GPU), and
on a GPU a graphed decode with each prefetch mode bit-identical to one without."""

from __future__ import annotations

import random

import pytest
import torch

from halfbyte.kernels import l2_prefetch as lp
from tests.kernel_testing import DEVICE, graphed_decode_logits


def _random_regions(rng: random.Random, unit: int) -> list[tuple[int, int]]:
    """1-4 disjoint regions of whole units, some shorter than a chunk, at fake addresses."""
    out, addr = [], unit * rng.randrange(1, 1 << 20)
    for _ in range(rng.randint(1, lp.MAX_REGIONS)):
        n = unit * rng.choice([1, 3, rng.randrange(1, 200), rng.randrange(200, 5000)])
        out.append((addr, n))
        addr += n + unit * rng.randrange(0, 1000)
    return out


@pytest.mark.parametrize("trial", range(6))
def test_each_thread_asks_for_the_reference_plans_chunk(trial: int) -> None:
    rng = random.Random()
    region_list = _random_regions(rng, 16)
    programs = rng.randint(1, 5)
    record = torch.full((8 * lp.LANES * programs * 2,), -7, dtype=torch.int64, device=DEVICE)
    chunk, grid = lp.launch(region_list, DEVICE, "record", programs, record)
    pairs = record[: grid * lp.LANES * 2].view(-1, 2).tolist()
    asked = [(a, n) for a, n in pairs if n > 0]
    plan = lp.chunk_plan(region_list, chunk)
    assert asked == plan, (region_list, programs, chunk)
    assert all(n <= 0 for _, n in pairs[len(plan) :])  # the threads past the plan ask for nothing
    assert chunk % 16 == 0 and grid * lp.LANES >= len(plan)


@pytest.mark.parametrize("trial", range(4))
def test_the_plan_covers_each_region_exactly_once(trial: int) -> None:
    rng = random.Random()
    unit = rng.choice([16, 128])
    region_list = _random_regions(rng, unit)
    chunk = lp.chunk_bytes(sum(n for _, n in region_list), rng.randint(1, 8), unit)
    plan = lp.chunk_plan(region_list, chunk)
    assert chunk % unit == 0 and all(0 < n <= chunk for _, n in plan)
    for start, n in region_list:
        inside = sorted((a, m) for a, m in plan if start <= a < start + n)
        assert inside[0][0] == start and sum(m for _, m in inside) == n
        assert all(a + m == b for (a, m), (b, _) in zip(inside, inside[1:]))


def test_regions_stay_inside_each_tensor() -> None:
    base = torch.empty(4096, dtype=torch.int8)
    view = base[3:1003]  # starts 3 bytes past an aligned address
    start, end = view.data_ptr(), view.data_ptr() + 1000
    [(b0, bn)] = lp.regions([view], lines=False)
    assert b0 % 16 == 0 and bn % 16 == 0 and start <= b0 and b0 + bn <= end and bn >= 1000 - 30
    [(l0, ln)] = lp.regions([view], lines=True)  # every line holding a byte of the view, whole
    assert l0 % 128 == 0 and ln % 128 == 0 and l0 <= start and l0 + ln >= end and l0 + ln - 128 < end
    strided = torch.empty(64, 64)[:, ::2]
    assert lp.regions([strided, torch.empty(0), base[5:9]], lines=False) == []  # skipped, empty, no whole unit


def test_a_weight_over_the_cap_is_skipped_or_cut_to_a_prefix_of_each_region() -> None:
    regs = [(1 << 20, 160_000), (4 << 20, 4_960), (8 << 20, 4_960)]  # words, scales, mins
    assert lp.within_cap(regs, 200_000, prefix=False, unit=16) == regs
    assert lp.within_cap(regs, 100_000, prefix=False, unit=16) == []
    cut = lp.within_cap(regs, 100_000, prefix=True, unit=16)
    assert [a for a, _ in cut] == [a for a, _ in regs]  # each from its start
    assert sum(n for _, n in cut) <= 100_000 and all(n % 16 == 0 for _, n in cut)
    for (_, n), (_, m) in zip(regs, cut):  # the same fraction of each, to a unit
        assert abs(m / n - 100_000 / sum(r[1] for r in regs)) < 16 / n
    assert lp.within_cap([(0, 4096)], 100, prefix=True, unit=128) == []  # not one whole line


def test_prefetch_is_off_by_default_and_refuses_an_unknown_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HALFBYTE_L2_PREFETCH", raising=False)
    assert lp.prefetch_mode() is None
    monkeypatch.setenv("HALFBYTE_L2_PREFETCH", "bulk")
    assert lp.prefetch_mode() == "bulk"
    lp.l2_prefetch([torch.ones(1024)])  # a CPU tensor: nothing to prefetch, no launch
    monkeypatch.setenv("HALFBYTE_L2_PREFETCH", "tma")
    with pytest.raises(ValueError, match="HALFBYTE_L2_PREFETCH='tma'"):
        lp.prefetch_mode()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("side", ["0", "1"])
@pytest.mark.parametrize("mode", lp.MODES)
def test_graphed_decode_is_the_same_with_and_without_the_prefetch(
    monkeypatch: pytest.MonkeyPatch, mode: str, side: str
) -> None:
    if mode == "bulk" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("not run: the bulk prefetch needs sm_90")
    monkeypatch.setenv("HALFBYTE_L2_PREFETCH", "0")
    without = graphed_decode_logits(1, 16)
    monkeypatch.setenv("HALFBYTE_L2_PREFETCH", mode)
    monkeypatch.setenv("HALFBYTE_L2_PREFETCH_SIDE", side)  # 1: on a side stream the graph forks and joins
    with_prefetch = graphed_decode_logits(1, 16)
    assert torch.isfinite(without).all()
    assert torch.equal(with_prefetch, without)
