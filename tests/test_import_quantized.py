"""Imports of GPTQ, AWQ and GGUF quantized checkpoints into the halfbyte format, checked against
checkpoints written here by independent packers (plain loops over the documented layouts) and
against each format's reference dequantization."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from halfbyte.errors import CorruptFileError, HalfbyteError, QuantizationError, UnsupportedModelError
from halfbyte.quant.import_awq import awq_to_quant_weight
from halfbyte.quant.import_checkpoint import convert_if_foreign, import_checkpoint
from halfbyte.quant.import_gguf import gguf_to_quant_weight, permute_out, unpermute_rope_rows
from halfbyte.quant.import_gptq import gptq_to_quant_weight
from halfbyte.quant.rtn import quantize_rtn

gguf = pytest.importorskip("gguf")

# --- independent packers ---------------------------------------------------------------------------


def _pack_words_gptq(values: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ packing of values [L, C] along L (qweight: L = K; qzeros: values transposed, L = N)
    into uint32 words [L * bits / 32, C], written out word by word as AutoGPTQ documents it."""
    length, cols = values.shape
    v = values.astype(np.uint64)
    words = np.zeros((length * bits // 32, cols), dtype=np.uint64)
    if bits in (2, 4, 8):
        per = 32 // bits
        for j in range(length // per):
            for i in range(per):
                words[j] |= v[per * j + i] << np.uint64(bits * i)
    else:  # 3 bits: 32 values in 3 words; values 10 and 21 straddle word boundaries
        assert bits == 3
        for b in range(length // 32):
            base, w = 32 * b, 3 * b
            for i in range(10):
                words[w] |= v[base + i] << np.uint64(3 * i)
            words[w] |= (v[base + 10] & np.uint64(0b11)) << np.uint64(30)
            words[w + 1] |= v[base + 10] >> np.uint64(2)
            for i in range(10):
                words[w + 1] |= v[base + 11 + i] << np.uint64(3 * i + 1)
            words[w + 1] |= (v[base + 21] & np.uint64(1)) << np.uint64(31)
            words[w + 2] |= v[base + 21] >> np.uint64(1)
            for i in range(10):
                words[w + 2] |= v[base + 22 + i] << np.uint64(3 * i + 2)
    return (words & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def _i32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def make_gptq(
    q: np.ndarray, z: np.ndarray, s: np.ndarray, g_idx: np.ndarray, bits: int, v1: bool = True
) -> dict[str, torch.Tensor]:
    """q [N, K], z [G, N] (true zero points), s fp16 [G, N], g_idx [K] -> GPTQ tensors."""
    stored_z = (z - 1) & ((1 << bits) - 1) if v1 else z
    return {
        "qweight": _i32(_pack_words_gptq(q.T, bits)),  # [K * bits / 32, N]
        "qzeros": _i32(_pack_words_gptq(stored_z.T, bits).T),  # [G, N * bits / 32]
        "scales": torch.from_numpy(s.astype(np.float16)),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }


def gptq_reference(q: np.ndarray, z: np.ndarray, s: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """GPTQ's meaning: W[n, k] = (q[n, k] - z[g_idx[k], n]) * s[g_idx[k], n], in float64."""
    return (q - z[g_idx].T) * s.astype(np.float64)[g_idx].T


AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _pack_awq(values: np.ndarray) -> torch.Tensor:
    """values [R, N] -> int32 [R, N / 8]: nibble i of word c holds column 8c + AWQ_PACK_ORDER[i]."""
    rows, n = values.shape
    words = np.zeros((rows, n // 8), dtype=np.uint64)
    for c in range(n // 8):
        for i in range(8):
            words[:, c] |= values[:, 8 * c + AWQ_PACK_ORDER[i]].astype(np.uint64) << np.uint64(4 * i)
    return _i32(words)


def _random_case(bits: int, n: int, k: int, group: int, act_order: bool, rng: np.random.Generator, zero_lo: int = 1):
    gs = k if group == -1 else group
    groups = math.ceil(k / gs)
    q = rng.integers(0, 1 << bits, size=(n, k))
    z = rng.integers(zero_lo, 1 << bits, size=(groups, n))
    s = (rng.uniform(2e-4, 2e-2, size=(groups, n))).astype(np.float16)
    if act_order:
        order = rng.permutation(k)
        g_idx = np.empty(k, dtype=np.int64)
        g_idx[order] = np.arange(k) // gs  # GPTQ quantizes in `order`, groups in that order
    else:
        g_idx = np.arange(k) // gs
    return q, z, s, g_idx


def _assert_within_min_rounding(got: torch.Tensor, ref: np.ndarray, z: np.ndarray, s: np.ndarray, g_idx: np.ndarray) -> None:
    """The documented bound: |fp16(-z s) + z s| <= 2^-11 |z s| (2^-25 absolute below fp16's
    normal range), plus one float32 rounding of q s + min."""
    zs = np.abs(z[g_idx].T * s.astype(np.float64)[g_idx].T)
    bound = 2.0**-11 * zs + 2.0**-23 * (np.abs(ref) + zs) + 2.0**-25
    diff = np.abs(got.double().numpy() - ref)
    assert (diff <= bound).all(), float((diff - bound).max())


# --- GPTQ ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matches_reference_formula(bits: int, act_order: bool) -> None:
    rng = np.random.default_rng(bits * 10 + act_order)
    q, z, s, g_idx = _random_case(bits, 64, 256, 64, act_order, rng)
    t = make_gptq(q, z, s, g_idx, bits)
    w = gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, 64)
    assert (w.perm is not None) == act_order
    _assert_within_min_rounding(w.dequantize(), gptq_reference(q, z, s, g_idx), z, s, g_idx)


@pytest.mark.parametrize(("group", "expect_gs"), [(-1, 512), (256, 128), (32, 32)])
def test_gptq_group_sizes_map_exactly(group: int, expect_gs: int) -> None:
    rng = np.random.default_rng(group + 1000)
    q, z, s, g_idx = _random_case(4, 32, 512, group, True, rng)
    t = make_gptq(q, z, s, g_idx, 4, v1=False)
    w = gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, group, zero_offset=0)
    assert w.slices[0].group_size == expect_gs
    assert (w.perm is None) == (group == -1)  # one group: column order is irrelevant
    _assert_within_min_rounding(w.dequantize(), gptq_reference(q, z, s, g_idx), z, s, g_idx)


def test_gptq_symmetric_is_exact() -> None:
    rng = np.random.default_rng(7)
    q, _, s, g_idx = _random_case(4, 32, 256, 128, True, rng)
    z = np.full((2, 32), 8)  # symmetric: z = 2^(bits-1), so -z * s is exact in fp16
    t = make_gptq(q, z, s, g_idx, 4)
    w = gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 128)
    ref = torch.from_numpy(gptq_reference(q, z, s, g_idx)).float()
    assert torch.equal(w.dequantize(), ref)


def test_gptq_v1_zero_of_zero_reads_as_two_to_the_bits() -> None:
    # classic GPTQ stores z - 1; z = 0 wraps to 15, which its kernels read back as 16
    rng = np.random.default_rng(3)
    q, z, s, g_idx = _random_case(4, 32, 64, 32, False, rng)
    z[:] = 0
    t = make_gptq(q, z, s, g_idx, 4, v1=True)
    w = gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 32)
    ref = gptq_reference(q, np.full_like(z, 16), s, g_idx)
    assert np.array_equal(w.dequantize().double().numpy(), ref)


def test_gptq_bad_inputs_are_one_line_errors() -> None:
    rng = np.random.default_rng(5)
    q, z, s, g_idx = _random_case(4, 32, 128, 32, False, rng)
    t = make_gptq(q, z, s, g_idx, 4)
    with pytest.raises(QuantizationError, match="unsupported GPTQ bits 5"):
        gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 5, 32)
    with pytest.raises(QuantizationError, match=r"layer\.x: qzeros has 4 groups, scales 3"):
        gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"][:3], None, 4, 32, where="layer.x")
    with pytest.raises(QuantizationError, match=r"layer\.x: zeros has shape \[3, 32\], expected \[4, 32\]"):
        gptq_to_quant_weight(t["qweight"], t["qzeros"][:3], t["scales"][:3], None, 4, 32, where="layer.x")
    bad_g = t["g_idx"].clone()
    bad_g[0] = 1  # group 0 now has 31 columns, group 1 has 33
    with pytest.raises(QuantizationError, match="does not split K = 128 into groups of 32") as e:
        gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"], bad_g, 4, 32)
    assert "\n" not in str(e.value)


# --- AWQ -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 128])
def test_awq_interleaved_order_matches_reference(group: int) -> None:
    rng = np.random.default_rng(group)
    n, k = 64, 256
    q = rng.integers(0, 16, size=(n, k))
    z = rng.integers(0, 16, size=(k // group, n))
    s = rng.uniform(2e-4, 2e-2, size=(k // group, n)).astype(np.float16)
    w = awq_to_quant_weight(_pack_awq(q.T), _pack_awq(z), torch.from_numpy(s), group)
    g_idx = np.arange(k) // group
    _assert_within_min_rounding(w.dequantize(), gptq_reference(q, z, s, g_idx), z, s, g_idx)
    # the plain (non-interleaved) order would be a different weight: the test can tell them apart
    with pytest.raises(QuantizationError, match="unsupported AWQ bits 8"):
        awq_to_quant_weight(_pack_awq(q.T), _pack_awq(z), torch.from_numpy(s), group, bits=8)


# --- GGUF tensors -----------------------------------------------------------------------------------


def test_gguf_file_q4_0_q4_1_q8_0_q5_import_bit_exactly(tmp_path: Path) -> None:
    qt = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    types = [qt.Q4_0, qt.Q4_1, qt.Q8_0, qt.Q5_0, qt.Q5_1]
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for i, t in enumerate(types):
        data = (rng.standard_normal((48, 96)) * 0.05).astype(np.float32)
        data[0, :32] = 0.0  # a constant block (d = 0)
        writer.add_tensor(f"w{i}", gguf.quants.quantize(data, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    assert len(reader.tensors) == len(types)
    for t in reader.tensors:
        shape = (int(t.shape[1]), int(t.shape[0]))
        imported = gguf_to_quant_weight(np.asarray(t.data), t.tensor_type, shape, t.name)
        ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))
        assert imported.exact
        assert torch.equal(imported.weight.dequantize(), ref), t.tensor_type.name


def _random_k_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid super-blocks: random bytes with realistic fp16 d (and dmin)."""
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    blocks = rng.integers(0, 256, size=(n * k // 256, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-3, size=blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "Q6_K":
        blocks[:, 208:210] = d
    else:
        blocks[:, 0:2] = d
        blocks[:, 2:4] = rng.uniform(1e-4, 1e-3, size=blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_gguf_k_quants_keep_q_and_round_scales_once(kind: str) -> None:
    rng = np.random.default_rng(1)
    n, k = 32, 512
    raw = _random_k_blocks(kind, n, k, rng)
    imported = gguf_to_quant_weight(raw, kind, (n, k))
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k))
    diff = (imported.weight.dequantize() - ref).abs()
    assert imported.weight.slices[0].bits == (4 if kind == "Q4_K" else 5)
    # each of d*sc and dmin*m (<= 63 * 1e-3) is rounded once to fp16 (2^-11 relative); q <= 31
    qmax = 15 if kind == "Q4_K" else 31
    bound = 2.0**-11 * 63e-3 * (qmax + 1) + 2.0**-22
    assert diff.max().item() <= bound
    assert imported.max_abs_err == pytest.approx(diff.max().item())
    assert imported.rms_err < 1e-3 * imported.rms_weight


@pytest.mark.parametrize("bits", [8, 6])
def test_gguf_q6_k_requantized_within_half_a_step(bits: int) -> None:
    rng = np.random.default_rng(2)
    n, k = 32, 512
    raw = _random_k_blocks("Q6_K", n, k, rng)
    imported = gguf_to_quant_weight(raw, "Q6_K", (n, k), q6k_bits=bits)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(n, k))
    groups = ref.reshape(n, k // 32, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / ((1 << bits) - 1)  # RTN grid of each group
    diff = (imported.weight.dequantize() - ref).abs().reshape(n, k // 32, 32).amax(-1)
    # half a step, plus the fp16 rounding of scale (times up to 2^bits - 1) and min
    assert (diff <= 0.5 * step * (1 + 2.0**-9 * (1 << bits)) + 2.0**-11 * groups.abs().amax(-1) + 1e-7).all()
    assert not imported.exact and "requantized" in imported.note


def test_gguf_unsupported_type_and_truncated_tensor() -> None:
    raw = np.zeros((4, 84), dtype=np.uint8)
    with pytest.raises(QuantizationError, match="GGUF type Q2_K cannot be imported quantized"):
        gguf_to_quant_weight(raw, "Q2_K", (4, 256))
    with pytest.raises(QuantizationError, match="truncated"):
        gguf_to_quant_weight(np.zeros(100, dtype=np.uint8), "Q4_0", (4, 64))


def test_unpermute_rope_rows_undoes_llama_cpp_permutation() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    heads = 4
    # llama.cpp's convert: w.reshape(heads, 2, rows/heads/2, K).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, 64 // heads // 2, 64).transpose(1, 2).reshape(64, 64)
    qw = quantize_rtn(permuted, 8, 32)
    restored = permute_out(qw, unpermute_rope_rows(64, heads))
    # RTN works row by row, so quantizing the un-permuted rows gives exactly the restored weight
    assert torch.equal(restored.dequantize(), quantize_rtn(w, 8, 32).dequantize())
    assert not torch.equal(qw.dequantize(), restored.dequantize())
