"""The one-launch peer all-reduce (distributed/peer_all_reduce.py) against the plain sum: one
rank with its peers' buffers and flags set up as they would leave them (runs in Triton's
interpreter), and on a GPU two ranks at once on two streams of the same device."""

from __future__ import annotations

import pytest
import torch

from halfbyte.distributed.peer_all_reduce import BLOCK, PeerAllReduce
from tests.kernel_testing import DEVICE


def _ptrs(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)


class _Ranks:
    """world ranks' buffers (two slots of `capacity`) and signal pads, on one device."""

    def __init__(self, world: int, capacity: int, dtype: torch.dtype, pad_ints: int = 256) -> None:
        self.buffers = [torch.full((2 * capacity,), float("nan"), dtype=dtype, device=DEVICE) for _ in range(world)]
        self.pads = [torch.zeros(pad_ints, dtype=torch.int32, device=DEVICE) for _ in range(world)]
        self.ops = [PeerAllReduce(_ptrs(self.buffers), _ptrs(self.pads), r, world, capacity, dtype, pad_ints)
                    for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n", [576, 2 * BLOCK + 8])
def test_one_rank_sums_in_rank_order_and_signals_its_peers(world: int, n: int) -> None:
    capacity, rank = 4 * BLOCK, world - 1
    ranks = _Ranks(world, capacity, torch.float16)
    op = ranks.ops[rank]
    programs = -(-n // BLOCK)
    g = torch.Generator().manual_seed(n + world)
    for epoch in (1, 2, 3):  # slots 1, 0, 1
        parts = [torch.randn(n, generator=g).half().to(DEVICE) for _ in range(world)]
        slot = (epoch % 2) * capacity
        for peer in range(world - 1):  # what the peers would have done before this rank waits
            ranks.buffers[peer][slot:slot + n] = parts[peer]
            ranks.pads[rank][torch.arange(programs) * world + peer] = epoch
        out = op(parts[rank].view(1, n))
        ref = torch.stack(parts).float().sum(0)
        assert out.shape == (1, n) and out.dtype == torch.float16
        torch.testing.assert_close(out.view(-1).float(), ref.half().float(), rtol=0, atol=0)  # fp32 sum, one rounding
        assert torch.equal(ranks.buffers[rank][slot:slot + n], parts[rank])
        for peer in range(world - 1):  # its flag raised in every peer's pad, for every program
            assert ranks.pads[peer][torch.arange(programs) * world + rank].tolist() == [epoch] * programs
    assert op.fits(torch.empty(1, n, dtype=torch.float16, device=DEVICE))
    assert not op.fits(torch.empty(1, capacity + 1, dtype=torch.float16, device=DEVICE))
    assert not op.fits(torch.empty(1, n, dtype=torch.float32, device=DEVICE))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="two ranks at once need concurrent kernels (GPU)")
@pytest.mark.parametrize("n", [8192, 5 * BLOCK + 3])
def test_two_ranks_on_two_streams_agree_with_the_sum(n: int) -> None:
    ranks = _Ranks(2, 8 * BLOCK, torch.float16)
    streams = [torch.cuda.Stream() for _ in range(2)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for op in ranks.ops:
        op.compile(torch.empty(1, n, dtype=torch.float16, device="cuda"))  # loading waits for an idle device
    for _ in range(40):  # many epochs: both slots reused many times
        parts = [torch.randn(1, n, device="cuda", generator=g).half() for _ in range(2)]
        outs: list[torch.Tensor] = []
        torch.cuda.synchronize()
        for op, s, x in zip(ranks.ops, streams, parts, strict=True):
            with torch.cuda.stream(s):
                outs.append(op(x))
        torch.cuda.synchronize()
        ref = (parts[0].float() + parts[1].float()).half()
        assert torch.equal(outs[0], outs[1])  # bitwise: the ranks' residual streams must not drift
        assert torch.equal(outs[0], ref)
