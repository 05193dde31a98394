"""Imports of GPTQ, AWQ and GGUF quantized checkpoints into the halfbyte format, checked against
checkpoints written here by independent packers (plain loops over the documented layouts) and
against each format's reference dequantization."""

from __future__ import annotations

import json
import shutil
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from halfbyte.errors import CorruptFileError, HalfbyteError, QuantizationError, UnsupportedModelError
from halfbyte.quant.import_awq import awq_to_quant_weight
from halfbyte.quant.import_checkpoint import convert_if_foreign, fuse, import_checkpoint
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
    with pytest.raises(QuantizationError, match=r"layer\.x: scales has 3 groups; K = 128 with group size 32 needs 4"):
        gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"][:3], None, 4, 32, where="layer.x")
    with pytest.raises(QuantizationError, match=r"layer\.x: qzeros has 3 groups, scales 4"):
        gptq_to_quant_weight(t["qweight"], t["qzeros"][:3], t["scales"], None, 4, 32, where="layer.x")
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


def test_fuse_widens_bits_and_splits_groups_exactly() -> None:
    # a Q4_K_M-like mix: q/k in 4 bits, v requantized from Q6_K to 8 bits; plus a GPTQ g128 part
    rng = np.random.default_rng(4)
    q = gguf_to_quant_weight(_random_k_blocks("Q4_K", 64, 256, rng), "Q4_K", (64, 256)).weight
    v = gguf_to_quant_weight(_random_k_blocks("Q6_K", 32, 256, rng), "Q6_K", (32, 256)).weight
    qq, z, s, g_idx = _random_case(3, 32, 256, 128, False, rng)
    t = make_gptq(qq, z, s, g_idx, 3)
    g = gptq_to_quant_weight(t["qweight"], t["qzeros"], t["scales"], None, 3, 128)
    fused, note = fuse([q, v, g])
    assert fused is not None and "stored at 8 bits g32" in note
    assert (fused.slices[0].bits, fused.slices[0].group_size) == (8, 32)
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), v.dequantize(), g.dequantize()]))
    t2 = make_gptq(qq, z, s, np.random.default_rng(9).permutation(256) // 128, 3)
    g2 = gptq_to_quant_weight(t2["qweight"], t2["qzeros"], t2["scales"], t2["g_idx"], 3, 128)
    assert fuse([g, g2]) == (None, "act-order permutations differ")


# --- whole checkpoints --------------------------------------------------------------------------

PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
INPUT_OF = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
            "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    out = tmp_path_factory.mktemp("hf") / "m"
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def _quantize_test(w: np.ndarray, order: np.ndarray, bits: int, gs: int):
    """A plain min/max quantizer in GPTQ's terms: groups of `gs` columns taken in `order`."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    g_idx = np.empty(k, dtype=np.int64)
    g_idx[order] = np.arange(k) // gs
    groups = math.ceil(k / gs)
    s = np.empty((groups, n), dtype=np.float16)
    z = np.empty((groups, n), dtype=np.int64)
    for g in range(groups):
        cols = w[:, order[g * gs:(g + 1) * gs]]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        s[g] = ((hi - lo) / maxq).astype(np.float16)
        z[g] = np.clip(np.round(-lo / s[g].astype(np.float64)), 1, maxq)  # v1 cannot store z = 0
    q = np.clip(np.round(w / s.astype(np.float64)[g_idx].T) + z[g_idx].T, 0, maxq).astype(np.int64)
    return q, z, s, g_idx


def _write_foreign(src: Path, out: Path, method: str, perms: str, bits: int = 4, gs: int = 32) -> tuple[Path, Path]:
    """(a GPTQ/AWQ checkpoint of the tiny model, its dense twin holding the reference weights)."""
    rng = np.random.default_rng(42)
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    quant: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        shared: dict[str, np.ndarray] = {}
        for proj in PROJ:
            name = f"model.layers.{i}.{proj}"
            w = tensors.pop(f"{name}.weight").double().numpy()
            k = w.shape[1]
            if perms == "none":
                order = np.arange(k)
            elif perms == "shared" and proj in INPUT_OF:
                order = shared.setdefault(INPUT_OF[proj], rng.permutation(k))
            else:
                order = rng.permutation(k)
            q, z, s, g_idx = _quantize_test(w, order, bits, gs)
            twin[f"{name}.weight"] = torch.from_numpy(gptq_reference(q, z, s, g_idx)).float()
            if method == "gptq":
                for key, t in make_gptq(q, z, s, g_idx, bits).items():
                    quant[f"{name}.{key}"] = t
            else:
                quant[f"{name}.qweight"] = _pack_awq(q.T)
                quant[f"{name}.qzeros"] = _pack_awq(z)
                quant[f"{name}.scales"] = torch.from_numpy(s)
    qcfg = {"quant_method": method, "bits": bits, "group_size": gs}
    qcfg.update({"desc_act": perms != "none", "sym": False, "checkpoint_format": "gptq"} if method == "gptq"
                else {"version": "gemm", "zero_point": True})
    dirs = (out / method, out / "twin")
    for d, payload, extra in ((dirs[0], {**tensors, **quant}, True), (dirs[1], {**tensors, **twin}, False)):
        d.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in payload.items()}, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg} if extra else cfg))
    return dirs


def _logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from halfbyte.engine.scoring import score_tokens
    from halfbyte.io.model_dir import read_json
    from halfbyte.model.config import ModelConfig
    from halfbyte.model.loader import load_model

    cfg = ModelConfig.from_hf(read_json(model_dir / "config.json"))
    return score_tokens(load_model(model_dir, cfg, torch.float32, torch.device("cpu")), ids)


IDS = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize(("method", "perms"), [("gptq", "none"), ("gptq", "shared"), ("gptq", "distinct"), ("awq", "none")])
def test_foreign_checkpoint_loads_like_its_reference_weights(tiny_hf: Path, tmp_path: Path, method: str, perms: str) -> None:
    foreign, twin = _write_foreign(tiny_hf, tmp_path, method, perms)
    report = import_checkpoint(foreign, tmp_path / "hb")
    layers = json.loads((tmp_path / "hb" / "config.json").read_text())["quantization"]["layers"]
    qkv = layers.get("model.layers.0.self_attn.qkv_proj")
    if perms == "distinct":  # q/k/v act-order permutations differ: written dense, said so
        assert qkv is None and "model.layers.0.mlp.down_proj" in layers
        assert any("permutations differ" in n for n in report.notes)
    else:
        assert qkv is not None and qkv["act_order"] == (perms == "shared")
        assert "model.layers.1.mlp.gate_up_proj" in layers
    # |z s| is about the group's |min| (< 0.2 for this init): the min-form rounding is below 2^-11 of it
    assert len(report.layers) == 14 and 0 < max(r.max_abs_err for r in report.layers) <= 2.0**-11 * 0.2
    _assert_dir_weights_near(tmp_path / "hb", twin)
    # the weights differ from the reference by the min-form rounding only (above); through two
    # layers that moves these logits (|logit| ~ 1) by a few 1e-4, a wrong layout by far more
    diff = (_logits(tmp_path / "hb", IDS) - _logits(twin, IDS)).abs().max().item()
    assert diff <= 2e-3, diff


def _assert_dir_weights_near(hb: Path, twin: Path, tol: float = 2.0**-11 * 0.2) -> None:
    """Every projection of the halfbyte directory (fused or dense), split back into the HF
    matrices, is within `tol` of the twin's weights (default: 2^-11 |z s| with |z s| < 0.2)."""
    from halfbyte.quant.qtensor import QuantWeight

    cfg = json.loads((hb / "config.json").read_text())
    tensors, ref = load_file(hb / "model.safetensors"), load_file(twin / "model.safetensors")
    got: dict[str, torch.Tensor] = {}
    for prefix, meta in cfg["quantization"]["layers"].items():
        w = QuantWeight.from_state_dict(prefix, tensors, meta).dequantize()
        base, fused = prefix.rsplit(".", 1)
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(fused, [fused])
        sizes = [ref[f"{base}.{p}.weight"].shape[0] for p in parts]
        for p, chunk in zip(parts, torch.split(w, sizes)):
            got[f"{base}.{p}.weight"] = chunk
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            got[name] = t
    assert set(got) == {n for n in ref if n.endswith("_proj.weight")}
    for name, w in got.items():
        assert (w.float() - ref[name]).abs().max().item() <= tol, name


def test_unfusable_parts_can_stay_quantized_under_their_own_names(tiny_hf: Path, tmp_path: Path) -> None:
    foreign, _ = _write_foreign(tiny_hf, tmp_path, "gptq", "distinct")
    import_checkpoint(foreign, tmp_path / "hb", unfusable="separate")
    layers = json.loads((tmp_path / "hb" / "config.json").read_text())["quantization"]["layers"]
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.up_proj"} <= set(layers)
    assert layers["model.layers.0.self_attn.q_proj"]["act_order"]
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.\w+\.\w+_proj: parts cannot be fused"):
        import_checkpoint(foreign, tmp_path / "hb2", unfusable="error")
    assert not (tmp_path / "hb2").exists()  # nothing half-written


def test_convert_if_foreign_caches_and_passes_others_through(tiny_hf: Path, tmp_path: Path) -> None:
    foreign, twin = _write_foreign(tiny_hf, tmp_path, "gptq", "shared")
    cache = tmp_path / "cache"
    first = convert_if_foreign(foreign, cache)
    assert first.parent == cache and (first / "config.json").is_file()
    stamp = (first / "config.json").stat().st_mtime_ns
    assert convert_if_foreign(foreign, cache) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert convert_if_foreign(twin, cache) == twin
    assert convert_if_foreign(first, cache) == first
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (foreign / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="quant_method 'bitsandbytes' is not supported"):
        convert_if_foreign(foreign, cache)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        ({"bits": 5}, QuantizationError, "unsupported GPTQ bits 5"),
        ({"checkpoint_format": "marlin"}, UnsupportedModelError, "checkpoint_format 'marlin'"),
        ({"group_size": 64}, QuantizationError, r"model\.layers\.0\.\w+\.\w+_proj: scales has \d+ groups; K = \d+ with group size 64"),
        ({"quant_method": "hqq"}, UnsupportedModelError, "quant_method 'hqq' is not supported"),
    ],
)
def test_bad_checkpoints_are_one_line_errors(tiny_hf: Path, tmp_path: Path, edit: dict, error: type, message: str) -> None:
    foreign, _ = _write_foreign(tiny_hf, tmp_path, "gptq", "none")
    cfg = json.loads((foreign / "config.json").read_text())
    cfg["quantization_config"].update(edit)
    (foreign / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=message) as e:
        import_checkpoint(foreign, tmp_path / "hb")
    assert "\n" not in str(e.value) and not (tmp_path / "hb").exists()


def test_truncated_files_are_corrupt_file_errors(tiny_hf: Path, tmp_path: Path) -> None:
    foreign, _ = _write_foreign(tiny_hf, tmp_path, "awq", "none")
    weights = foreign / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CorruptFileError, match="truncated or corrupt"):
        import_checkpoint(foreign, tmp_path / "hb")
    gguf_file = tmp_path / "cut.gguf"
    header = gguf.GGUFWriter(str(tmp_path / "full.gguf"), "llama")
    header.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(np.ones((32, 64), np.float32), gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    header.write_header_to_file()
    header.write_kv_data_to_file()
    header.write_tensors_to_file()
    header.close()
    full = (tmp_path / "full.gguf").read_bytes()
    gguf_file.write_bytes(full[: len(full) - 100])
    with pytest.raises(HalfbyteError, match="cut.gguf"):
        import_checkpoint(gguf_file, tmp_path / "hb")


@pytest.mark.slow
def test_default_model_gguf_imports_exactly_and_matches_the_float_import(default_model_dir: Path, tmp_path: Path) -> None:
    from halfbyte.io.default_model import default_gguf_path

    out = convert_if_foreign(default_gguf_path(), tmp_path / "cache")
    layers = json.loads((out / "config.json").read_text())["quantization"]["layers"]
    assert len(layers) == 30 * 4  # qkv, o, gate_up, down per layer; the tied Q8_0 embedding is dense
    assert all(s["bits"] == 4 and s["group_size"] == 32 for m in layers.values() for s in m["slices"])
    # bit for bit the weights `import-gguf` dequantizes (q/k un-permuted the same way), Q8_0 embedding included
    _assert_dir_weights_near(out, default_model_dir, tol=0.0)
    ours, theirs = load_file(out / "model.safetensors"), load_file(default_model_dir / "model.safetensors")
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    ids = list(range(1000, 1040))
    diff = (_logits(out, ids) - _logits(default_model_dir, ids)).abs().max().item()
    assert diff <= 1e-4, diff


def test_import_subcommand_prints_the_report(tiny_hf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from halfbyte.quant.import_checkpoint import add_import_subcommand

    foreign, _ = _write_foreign(tiny_hf, tmp_path, "awq", "none")
    parser = argparse.ArgumentParser()
    add_import_subcommand(parser.add_subparsers())
    args = parser.parse_args(["import", str(foreign), str(tmp_path / "hb")])
    assert args.func(args) == 0
    assert "AWQ 4-bit g32 (GEMM)" in capsys.readouterr().out and (tmp_path / "hb" / "config.json").is_file()


@pytest.fixture(scope="module")
def biased_import(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a halfbyte import of a GPTQ checkpoint with q/k/v/o biases, its dense reference twin)."""
    tmp = tmp_path_factory.mktemp("biased")
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, attention_bias=True,
    )
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # transformers initialises them to zero, which would prove nothing
    model.save_pretrained(tmp / "m", safe_serialization=True)
    foreign, twin = _write_foreign(tmp / "m", tmp, "gptq", "shared")
    import_checkpoint(foreign, tmp / "hb")
    return tmp / "hb", twin


def test_biases_are_fused_with_their_projections(biased_import: tuple[Path, Path]) -> None:
    hb, twin = biased_import
    ours, ref = load_file(hb / "model.safetensors"), load_file(twin / "model.safetensors")
    fused = torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(ours["model.layers.0.self_attn.qkv_proj.bias"], fused)
    assert torch.equal(ours["model.layers.0.self_attn.o_proj.bias"], ref["model.layers.0.self_attn.o_proj.bias"])


def test_quantized_layers_with_biases_load(biased_import: tuple[Path, Path]) -> None:
    hb, twin = biased_import
    diff = (_logits(hb, IDS) - _logits(twin, IDS)).abs().max().item()
    assert diff <= 2e-3, diff


def test_large_outputs_are_sharded_with_an_index(tiny_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import halfbyte.quant.import_checkpoint as ic

    foreign, _ = _write_foreign(tiny_hf, tmp_path, "gptq", "shared")
    import_checkpoint(foreign, tmp_path / "one")
    monkeypatch.setattr(ic, "SHARD_BYTES", 64 << 10)
    import_checkpoint(foreign, tmp_path / "many")
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3 and not (tmp_path / "many" / "model.safetensors").exists()
    assert torch.equal(_logits(tmp_path / "many", IDS), _logits(tmp_path / "one", IDS))


def test_foreign_checkpoints_load_directly(
    tiny_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model_dir: Path
) -> None:
    """LLM(path) / --model path on a GPTQ or AWQ directory imports it once into the cache and loads it."""
    from halfbyte.api import LLM, SamplingParams

    monkeypatch.setenv("HALFBYTE_CACHE", str(tmp_path / "cache"))
    for method in ("gptq", "awq"):
        perms = "shared" if method == "gptq" else "none"  # AWQ has no act-order permutation
        foreign, twin = _write_foreign(tiny_hf, tmp_path / method, method, perms)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the tiny model has none of its own
            shutil.copy(default_model_dir / name, foreign / name)
        with LLM(foreign, device="cpu") as llm:
            imported = llm.engine.model_dir
            out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert imported != foreign and "quantization" in json.loads((imported / "config.json").read_text())
        assert len(out[0].token_ids) == 4
        # the cached import is reused, and computes what the dequantized dense twin computes
        assert convert_if_foreign(foreign) == imported
        assert (_logits(imported, IDS) - _logits(twin, IDS)).abs().max().item() <= 2e-3
