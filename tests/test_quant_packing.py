"""The halfbyte quantized weight format: bit packing and the QuantWeight reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from halfbyte.errors import HalfbyteError, QuantizationError
from halfbyte.quant import QuantSlice, QuantWeight, concat_out, pack, unpack

ALL_BITS = (2, 3, 4, 5, 6, 8)


def _to_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _pack_by_bitstream(q: list[list[int]], bits: int) -> list[list[int]]:
    """Slow reference: write each (block, column) as an explicit list of stream bits."""
    n, k = len(q), len(q[0])
    rows = [[0] * n for _ in range(k // 32 * bits)]
    for col in range(n):
        for block in range(k // 32):
            stream = []
            for i in range(32):
                v = q[col][block * 32 + i]
                stream += [(v >> b) & 1 for b in range(bits)]  # little-endian within a value
            for w in range(bits):
                word = sum(stream[32 * w + b] << b for b in range(32))
                rows[block * bits + w][col] = _to_int32(word)
    return rows


# --- packing -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("n,k", [(1, 32), (7, 576), (8, 1536), (3, 4096)])
def test_pack_unpack_roundtrip(bits: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(1000 * bits + k + n)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    packed = pack(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (k // 32 * bits, n)
    assert torch.equal(unpack(packed, bits, k), q.to(torch.int32))


@pytest.mark.parametrize("bits", ALL_BITS)
def test_all_max_values_set_every_bit(bits: int) -> None:
    q = torch.full((5, 64), (1 << bits) - 1, dtype=torch.int32)
    packed = pack(q, bits)
    assert bool((packed == -1).all())  # every stream bit set, the sign bit included
    assert torch.equal(unpack(packed, bits, 64), q)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_matches_explicit_bitstream(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (3, 64), generator=g)
    assert pack(q, bits).tolist() == _pack_by_bitstream(q.tolist(), bits)


def test_4bit_equals_gptq_nibble_layout() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (5, 64), generator=g)
    ql = q.tolist()
    expected = [[0] * 5 for _ in range(64 // 8)]
    for j in range(64 // 8):
        for col in range(5):
            word = 0
            for i in range(8):
                word |= ql[col][8 * j + i] << (4 * i)
            expected[j][col] = _to_int32(word)
    assert pack(q, 4).tolist() == expected


@pytest.mark.parametrize(
    "q,bits",
    [
        (torch.zeros(2, 32, dtype=torch.int32), 7),
        (torch.zeros(2, 48, dtype=torch.int32), 4),  # K not a multiple of 32
        (torch.full((2, 32), 16, dtype=torch.int32), 4),
        (torch.full((2, 32), -1, dtype=torch.int32), 4),
        (torch.zeros(2, 32), 4),  # float values
        (torch.zeros(64, dtype=torch.int32), 4),  # not 2-D
    ],
)
def test_pack_rejects_bad_input(q: torch.Tensor, bits: int) -> None:
    with pytest.raises(QuantizationError):
        pack(q, bits)


def test_unpack_rejects_wrong_rows() -> None:
    with pytest.raises(QuantizationError, match="rows"):
        unpack(torch.zeros(12, 4, dtype=torch.int32), 4, 64)


# --- QuantWeight ---------------------------------------------------------------------------


def _random_weight(
    n: int, k: int, spec: list[tuple[int, int, int]], act_order: bool, seed: int
) -> QuantWeight:
    """spec: (width, bits, group_size) per slice."""
    g = torch.Generator().manual_seed(seed)
    slices, k0 = [], 0
    for width, bits, gs in spec:
        groups = -(-width // gs)
        q = torch.randint(0, 1 << bits, (n, width), generator=g)
        scales = (torch.rand(groups, n, generator=g) * 0.1 + 0.01).half()
        mins = (torch.randn(groups, n, generator=g) * 0.5).half()
        slices.append(QuantSlice.from_values(k0, bits, gs, q, scales, mins))
        k0 += width
    assert k0 == k
    perm = torch.randperm(k, generator=g).to(torch.int32) if act_order else None
    return QuantWeight(n, k, slices, perm)


def _slow_dequantize(w: QuantWeight) -> torch.Tensor:
    """Element by element from the format's definition."""
    out = torch.zeros(w.out_features, w.in_features, dtype=torch.float64)
    perm = w.perm.tolist() if w.perm is not None else list(range(w.in_features))
    for s in w.slices:
        q = unpack(s.qweight, s.bits, s.width).tolist()
        sc, mn = s.scales.double().tolist(), s.mins.double().tolist()
        for n in range(w.out_features):
            for j in range(s.width):
                g = j // s.group_size
                out[n, perm[s.k_start + j]] = q[n][j] * sc[g][n] + mn[g][n]
    return out


CASES = {
    "g32": (64, [(64, 4, 32)], False),
    "g64": (128, [(128, 3, 64)], False),
    "g128_short_last": (576, [(576, 4, 128)], False),
    "per_channel": (96, [(96, 5, 96)], False),
    "perm": (576, [(576, 2, 128)], True),
    "two_slices": (192, [(128, 4, 64), (64, 6, 32)], False),
    "two_slices_perm": (576, [(320, 3, 128), (256, 8, 64)], True),
}


@pytest.mark.parametrize("case", CASES)
def test_dequantize_matches_elementwise_formula(case: str) -> None:
    k, spec, act_order = CASES[case]
    w = _random_weight(3, k, spec, act_order, seed=len(case))
    ref = _slow_dequantize(w)
    got = w.dequantize()
    assert got.dtype == torch.float32 and got.shape == (3, k)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert w.dequantize(torch.float16).dtype == torch.float16


@pytest.mark.parametrize("case", ["g128_short_last", "perm", "two_slices_perm"])
def test_matmul_equals_dense(case: str) -> None:
    k, spec, act_order = CASES[case]
    w = _random_weight(17, k, spec, act_order, seed=7)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(w.matmul(x), x @ w.dequantize().t(), rtol=1e-4, atol=1e-4)
    x3 = x.reshape(5, 1, k).half()
    y = w.matmul(x3)
    assert y.dtype == torch.float16 and y.shape == (5, 1, 17)


def test_storage_bits_hand_count() -> None:
    w = _random_weight(5, 64, [(64, 3, 32)], act_order=False, seed=1)
    # qweight [64/32*3, 5] int32 = 30 words; scales and mins [2, 5] fp16 each
    assert w.storage_bits() == 30 * 32 + 10 * 16 + 10 * 16 == 1280
    assert w.bits_per_weight() == 1280 / (5 * 64)
    wp = _random_weight(5, 64, [(32, 2, 32), (32, 8, 32)], act_order=True, seed=1)
    # 2-bit: [2, 5], 8-bit: [8, 5] int32; 1 group each side; perm 64 int32
    assert wp.storage_bits() == (10 + 40) * 32 + 2 * (5 + 5) * 16 + 64 * 32


def test_state_dict_roundtrip_through_safetensors(tmp_path) -> None:
    w = _random_weight(9, 576, [(320, 3, 128), (256, 8, 64)], act_order=True, seed=3)
    tensors = w.to_state_dict("layers.0.mlp.down_proj")
    assert set(tensors) == {
        "layers.0.mlp.down_proj.perm",
        *(f"layers.0.mlp.down_proj.{name}.{i}" for name in ("qweight", "scales", "mins") for i in (0, 1)),
    }
    save_file(tensors, str(tmp_path / "w.safetensors"))
    meta = json.loads(json.dumps(w.meta()))
    back = QuantWeight.from_state_dict("layers.0.mlp.down_proj", load_file(str(tmp_path / "w.safetensors")), meta)
    assert back.meta() == w.meta()
    assert torch.equal(back.perm, w.perm)
    for a, b in zip(back.slices, w.slices):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales) and torch.equal(a.mins, b.mins)
    assert torch.equal(back.dequantize(), w.dequantize())


def _mutations() -> dict[str, tuple[str, object]]:
    return {
        "bits7": ("meta", lambda m: m["slices"][0].update(bits=7)),
        "group48": ("meta", lambda m: m["slices"][0].update(group_size=48)),
        "bits_str": ("meta", lambda m: m["slices"][0].update(bits="4")),
        "gap": ("meta", lambda m: m["slices"][1].update(k_start=96)),
        "short_cover": ("meta", lambda m: m.update(in_features=256)),
        "scales_shape": ("tensors", lambda t: t.update({"p.scales.0": t["p.scales.0"][:1]})),
        "scales_dtype": ("tensors", lambda t: t.update({"p.scales.0": t["p.scales.0"].float()})),
        "qweight_shape": ("tensors", lambda t: t.update({"p.qweight.1": t["p.qweight.1"][:, :2]})),
        "missing_mins": ("tensors", lambda t: t.pop("p.mins.1")),
        "perm_dup": ("tensors", lambda t: t.update({"p.perm": torch.zeros(192, dtype=torch.int32)})),
        "perm_int64": ("tensors", lambda t: t.update({"p.perm": t["p.perm"].long()})),
    }


@pytest.mark.parametrize("name", list(_mutations()))
def test_from_state_dict_rejects_bad_checkpoints(name: str) -> None:
    w = _random_weight(4, 192, [(128, 4, 64), (64, 6, 32)], act_order=True, seed=5)
    tensors, meta = dict(w.to_state_dict("p")), w.meta()
    target, mutate = _mutations()[name]
    mutate(meta if target == "meta" else tensors)  # type: ignore[operator]
    with pytest.raises(QuantizationError) as info:
        QuantWeight.from_state_dict("p", tensors, meta)
    assert isinstance(info.value, HalfbyteError)
    assert str(info.value).startswith("p") and "\n" not in str(info.value)


def test_quant_slice_rejects_unsupported_bits_and_group() -> None:
    q = torch.zeros(2, 64, dtype=torch.int32)
    s = torch.ones(1, 2, dtype=torch.float16)
    with pytest.raises(QuantizationError, match="group size 48"):
        QuantWeight(2, 64, [QuantSlice(0, 64, 4, 48, pack(q, 4), torch.ones(2, 2).half(), s.repeat(2, 1))])
    with pytest.raises(QuantizationError, match="bits"):
        QuantWeight(2, 64, [QuantSlice(0, 64, 7, 64, torch.zeros(14, 2, dtype=torch.int32), s, s)])


def test_concat_out_fuses_along_n() -> None:
    spec = [(128, 4, 64), (64, 2, 32)]
    ws = [_random_weight(n, 192, spec, act_order=False, seed=n) for n in (8, 3, 3)]
    fused = concat_out(ws)
    assert fused.out_features == 14
    assert torch.equal(fused.dequantize(), torch.cat([w.dequantize() for w in ws]))
    with pytest.raises(QuantizationError, match="slices"):
        concat_out([ws[0], _random_weight(3, 192, [(128, 4, 32), (64, 2, 32)], False, seed=1)])
    with pytest.raises(QuantizationError, match="permutation"):
        concat_out([ws[0], _random_weight(3, 192, spec, act_order=True, seed=1)])
