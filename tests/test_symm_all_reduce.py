"""The collectives' choice between symmetric memory and NCCL (halfbyte/distributed/symm_all_reduce.py).
The kernel itself: tests/test_kernels_peer_all_reduce.py (one rank in the interpreter, two ranks on
one GPU); across GPUs bench/tp_parity.py and bench/tensor_parallel.py run it
(HALFBYTE_TP_ALLREDUCE=symm). Here, the dispatch around it and the fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from halfbyte.distributed.collectives import Collectives
from halfbyte.distributed.symm_all_reduce import ENV, make_symm_all_reduce
from halfbyte.errors import InvalidParameterError


class _Recorder:
    """Stands in for PeerAllReduce: records calls, returns a new tensor as the real one does."""

    def __init__(self, fits: bool) -> None:
        self._fits = fits
        self.calls = 0

    def fits(self, t: torch.Tensor) -> bool:
        return self._fits

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return t * 2


@pytest.fixture
def nccl_calls(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """dist.all_reduce as the collectives see it, recorded (doubling in place, as 2 equal ranks would)."""
    calls: list[torch.Tensor] = []

    def fake(t: torch.Tensor, group: object = None) -> None:
        calls.append(t)
        t.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", fake)
    return calls


def test_small_tensors_take_the_symmetric_path_and_its_result_is_used(nccl_calls: list[torch.Tensor]) -> None:
    rec = _Recorder(fits=True)
    comm = Collectives(None, 0, 2, symm=rec)  # type: ignore[arg-type]
    t = torch.ones(4)
    out = comm.all_reduce(t)
    assert rec.calls == 1 and not nccl_calls
    assert torch.equal(out, torch.full((4,), 2.0)) and torch.equal(t, torch.ones(4))


def test_tensors_that_do_not_fit_go_through_the_process_group(nccl_calls: list[torch.Tensor]) -> None:
    rec = _Recorder(fits=False)
    comm = Collectives(None, 0, 2, symm=rec)  # type: ignore[arg-type]
    t = torch.arange(4.0)
    out = comm.all_reduce(t)
    assert rec.calls == 0 and len(nccl_calls) == 1 and out is t and torch.equal(out, torch.arange(4.0) * 2)


def test_cpu_and_the_default_stay_on_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert make_symm_all_reduce(None, torch.device("cpu"), torch.float16) is None  # type: ignore[arg-type]
    monkeypatch.setenv(ENV, "symm")
    assert make_symm_all_reduce(None, torch.device("cpu"), torch.float16) is None  # type: ignore[arg-type]
    assert Collectives.for_ranks(None, 0, 2, torch.device("cpu"), torch.float32).symm is None  # type: ignore[arg-type]


def test_a_bad_choice_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(InvalidParameterError, match=ENV):
        make_symm_all_reduce(None, torch.device("cpu"), torch.float16)  # type: ignore[arg-type]
