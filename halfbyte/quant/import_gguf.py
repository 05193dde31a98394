"""GGUF quantized tensors -> QuantWeight, without going through float weights where the format
allows it.

A GGUF weight of HF shape [N, K] is stored as N rows of K/block blocks; every block type below
has a fp16 scale `d` per 32 values (or per sub-block of a 256-value super-block), so it maps onto
halfbyte groups of 32 along K:

| GGUF  | halfbyte                                  | exact? |
|-------|-------------------------------------------|--------|
| Q4_0  | 4 bits, scales = d, mins = -8 d           | yes: -8 d is a power-of-two multiple of a fp16 |
| Q4_1  | 4 bits, scales = d, mins = m              | yes |
| Q5_0  | 5 bits, scales = d, mins = -16 d          | yes |
| Q5_1  | 5 bits, scales = d, mins = m              | yes |
| Q8_0  | 8 bits, q + 128, scales = d, mins = -128 d| yes |
| Q4_K  | 4 bits, scales = fp16(d sc), mins = fp16(-dmin m) | no: d sc and dmin m are products of a fp16 and a 6-bit integer (up to 17 significant bits); each is rounded once to fp16 (<= 2^-11 relative), q is kept |
| Q5_K  | 5 bits, as Q4_K                           | as Q4_K |
| Q6_K  | requantized: 8 bits (or 6), group 32, RTN from the dequantized values | no: its sub-blocks of 16 each have their own scale, and halfbyte's smallest group is 32 |

"Exact" means `QuantWeight.dequantize()` equals `gguf.quants.dequantize` bit for bit: both
compute in float32, q d and the power-of-two mins are exact, so q d + (-z d) = (q - z) d holds
without rounding, and Q4_1/Q5_1 evaluate the same d q + m. Other types are refused; F32/F16/BF16
tensors are dense and not handled here.

Measured on Gaussian weights (std 0.02, 512 x 4096) quantized the llama.cpp way: Q4_K's rounded
sub-block scales add rms 1.3e-5 (max 8.6e-5, at most 1.1% of a quantization step) to Q4_K's own
rms error 1.6e-3; about 5% of the d*sc products fit fp16 exactly. Q6_K requantized to 8 bits adds
rms 9.8e-5 to its own 4.6e-4 (total 4.65e-4, +2%; mean 6% of a Q6_K step, max 1.2 steps where
two neighbouring sub-blocks' scales differ a lot); to 6 bits it adds 4.0e-4 (total +33%).
Storage: Q4_0 4.5 -> 5.0 bits per weight (halfbyte stores the min), Q4_1 5.0 -> 5.0,
Q8_0 8.5 -> 9.0, Q4_K 4.5 -> 5.0, Q6_K 6.56 -> 9.0 (8 bits) or 7.0 (6 bits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from halfbyte.errors import HalfbyteError, QuantizationError, UnsupportedModelError
from halfbyte.quant.import_checkpoint import (
    IMPORTER_VERSION, ImportReport, LayerReport, ShardWriter, bits_per_weight, emit_layer, finish_config,
    plan_layers, progress, write_atomically,
)
from halfbyte.quant.qtensor import QuantSlice, QuantWeight
from halfbyte.quant.rtn import quantize_rtn

try:  # gguf is only needed for the reference dequantization of the inexact types
    from gguf import GGMLQuantizationType as QT
    from gguf import quants as gguf_quants
except ImportError:  # pragma: no cover - gguf is a dependency of the GGUF import
    QT = None  # type: ignore[assignment,misc]
    gguf_quants = None  # type: ignore[assignment]

GROUP = 32
QK_K = 256
# type name -> (values per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}
EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
SUPPORTED_TYPES = tuple(BLOCKS)


@dataclass
class GGUFWeight:
    """One imported GGUF tensor and how faithful it is to GGUF's own dequantization."""

    weight: QuantWeight
    source_type: str
    exact: bool
    max_abs_err: float  # max |dequant(halfbyte) - dequant(gguf)|; 0.0 when exact by construction
    rms_err: float
    rms_weight: float  # rms of the GGUF-dequantized weight, to put the errors in scale
    note: str


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 little-endian -> float32 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Blocks of 16 bytes [B, 16] -> 32 values [B, 32]: the low nibbles are values 0..15, the
    high nibbles 16..31 (the Q4_0/Q4_1/Q5 layout)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[B, 4] uint8 (a little-endian uint32) -> bit j for j < count, [B, count]."""
    word = np.ascontiguousarray(qh).view("<u4")[..., 0].astype(np.uint32)
    return ((word[:, None] >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K/Q5_K super-block -> 8 six-bit scales and 8 six-bit mins."""
    s = s.astype(np.uint8)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _decode_exact(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """[B, bytes] -> (q [B, 32] uint8, scale [B] float32, min [B] float32, bits), where the
    float32 scale/min are fp16 values."""
    d = _f16(blocks[:, 0:2])
    if kind == "Q4_0":
        return _nibbles(blocks[:, 2:18]), d, -8.0 * d, 4
    if kind == "Q4_1":
        return _nibbles(blocks[:, 4:20]), d, _f16(blocks[:, 2:4]), 4
    if kind == "Q5_0":
        q = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6], 32) << 4)
        return q, d, -16.0 * d, 5
    if kind == "Q5_1":
        q = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8], 32) << 4)
        return q, d, _f16(blocks[:, 2:4]), 5
    if kind == "Q8_0":
        return blocks[:, 2:34] ^ np.uint8(0x80), d, -128.0 * d, 8  # int8 q + 128 == its byte ^ 0x80
    raise AssertionError(kind)


def _decode_k(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Q4_K/Q5_K super-blocks [B, bytes] -> per 32-value sub-block (q [8B, 32], exact float32
    scale d*sc [8B], exact float32 min -dmin*m [8B], bits)."""
    nb = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    if kind == "Q4_K":
        qs, bits, high = blocks[:, 16:144], 4, None
    else:
        qs, bits, high = blocks[:, 48:176], 5, blocks[:, 16:48]
    # 4 chunks of 32 bytes: sub-block 2c in the low nibbles of chunk c, 2c+1 in the high ones
    chunks = qs.reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (chunks & 0x0F).reshape(nb, 8, 32)
    if high is not None:  # bit j of byte i is the fifth bit of value i of sub-block j
        q = q | (((high[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    scale = d[:, None] * sc.astype(np.float32)  # exact in float32: 11 + 6 significant bits
    mins = -(dmin[:, None] * mn.astype(np.float32))
    return q.reshape(nb * 8, 32), scale.reshape(-1), mins.reshape(-1), bits


def type_name(qtype: object) -> str:
    """A GGMLQuantizationType, its int value or its name -> the name ("Q4_1")."""
    if isinstance(qtype, str):
        return qtype
    if QT is not None:
        try:
            return QT(int(qtype)).name  # type: ignore[call-overload]
        except ValueError:
            pass
    return str(getattr(qtype, "name", qtype))


def gguf_reference_dequantize(data: np.ndarray, kind: str, n: int, k: int) -> torch.Tensor:
    """gguf's own dequantization, float32 [N, K]."""
    if gguf_quants is None:  # pragma: no cover
        raise QuantizationError("the gguf package is needed to dequantize GGUF tensors")
    return torch.from_numpy(np.asarray(gguf_quants.dequantize(np.asarray(data).reshape(n, -1), QT[kind])).reshape(n, k).copy())


def gguf_to_quant_weight(
    data: np.ndarray, qtype: object, shape: tuple[int, int], where: str = "gguf", q6k_bits: int = 8, measure: bool = True
) -> GGUFWeight:
    """Raw GGUF tensor bytes (uint8, N rows of K/block blocks) of HF shape (N, K) -> GGUFWeight.

    measure: for the inexact types compare against gguf's dequantization (costs one dense pass)."""
    kind = type_name(qtype)
    if kind not in BLOCKS:
        raise QuantizationError(
            f"{where}: GGUF type {kind} cannot be imported quantized; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    n, k = shape
    block, nbytes = BLOCKS[kind]
    if n <= 0 or k <= 0 or k % block:
        raise QuantizationError(f"{where}: shape [{n}, {k}] is not whole {kind} blocks of {block} along K")
    raw = np.asarray(data)
    if raw.dtype != np.uint8 or raw.size != n * (k // block) * nbytes:
        raise QuantizationError(
            f"{where}: {kind} [{n}, {k}] needs {n * (k // block) * nbytes} bytes, got {raw.size} ({raw.dtype}); truncated?"
        )
    blocks = raw.reshape(n * (k // block), nbytes)

    if kind == "Q6_K":
        return _requantize(raw, kind, n, k, q6k_bits, where)
    if kind in EXACT_TYPES:
        q, scale, mins, bits = _decode_exact(kind, blocks)
    else:
        q, scale, mins, bits = _decode_k(kind, blocks)
    groups = k // GROUP
    scales16 = torch.from_numpy(scale.astype(np.float16).reshape(n, groups).T.copy())  # [groups, N]
    mins16 = torch.from_numpy(mins.astype(np.float16).reshape(n, groups).T.copy())
    if not (bool(torch.isfinite(scales16).all()) and bool(torch.isfinite(mins16).all())):
        raise QuantizationError(f"{where}: a {kind} scale or min overflows float16 in the min form")
    values = torch.from_numpy(q.reshape(n, k).astype(np.int32))
    weight = QuantWeight(n, k, [QuantSlice.from_values(0, bits, GROUP, values, scales16, mins16)], None)

    if kind in EXACT_TYPES:
        return GGUFWeight(weight, kind, True, 0.0, 0.0, float("nan"), f"{kind}: exact, {bits} bits g{GROUP}")
    exact_params = bool(
        np.array_equal(scales16.numpy().T.reshape(-1).astype(np.float32), scale)
        and np.array_equal(mins16.numpy().T.reshape(-1).astype(np.float32), mins)
    )
    note = f"{kind}: {bits} bits g{GROUP}, q kept, sub-block scale d*sc and min dmin*m rounded to fp16"
    if exact_params:
        note = f"{kind}: {bits} bits g{GROUP}, every d*sc and dmin*m happened to fit fp16"
    return _measured(weight, raw, kind, n, k, note, measure, exact_params)


def _measured(
    weight: QuantWeight, raw: np.ndarray, kind: str, n: int, k: int, note: str, measure: bool, exact_params: bool = False
) -> GGUFWeight:
    if not measure:
        return GGUFWeight(weight, kind, exact_params, float("nan"), float("nan"), float("nan"), note)
    ref = gguf_reference_dequantize(raw, kind, n, k)
    diff = weight.dequantize() - ref
    return GGUFWeight(
        weight, kind, bool(exact_params and not diff.any()),
        float(diff.abs().max()), float(diff.square().mean().sqrt()), float(ref.square().mean().sqrt()), note,
    )


def _requantize(raw: np.ndarray, kind: str, n: int, k: int, bits: int, where: str) -> GGUFWeight:
    if bits not in (6, 8):
        raise QuantizationError(f"{where}: Q6_K requantizes to 6 or 8 bits, not {bits!r}")
    ref = gguf_reference_dequantize(raw, kind, n, k)
    if not bool(torch.isfinite(ref).all()):
        raise QuantizationError(f"{where}: {kind} tensor holds inf or nan")
    weight = quantize_rtn(ref, bits, GROUP)
    diff = weight.dequantize() - ref
    note = (
        f"{kind}: requantized from its dequantized values to {bits} bits g{GROUP} (RTN): "
        f"its 16-wide sub-blocks have their own scales, smaller than halfbyte's smallest group"
    )
    return GGUFWeight(
        weight, kind, False, float(diff.abs().max()), float(diff.square().mean().sqrt()),
        float(ref.square().mean().sqrt()), note,
    )


def permute_out(weight: QuantWeight, rows: torch.Tensor) -> QuantWeight:
    """The same weight with its output rows reordered: new row i is old row rows[i]. Exact: only
    columns of qweight/scales/mins move (used to undo llama.cpp's q/k head permutation)."""
    idx = rows.long()
    slices = [
        QuantSlice(s.k_start, s.k_end, s.bits, s.group_size,
                   s.qweight[:, idx].contiguous(), s.scales[:, idx].contiguous(), s.mins[:, idx].contiguous())
        for s in weight.slices
    ]
    return QuantWeight(weight.out_features, weight.in_features, slices, weight.perm)


def unpermute_rope_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's conversion permutation of q_proj/k_proj, which stores each
    head's rows interleaved (pairs (i, i + head_dim/2) next to each other) for its rotary layout.
    HF row r of head h, r = j + half*half_dim, sits at GGUF row h*head_dim + 2j + half."""
    if n_heads <= 0 or n_rows % (2 * n_heads):
        raise QuantizationError(f"cannot split {n_rows} rows into {n_heads} heads of even size")
    head_dim = n_rows // n_heads
    # GGUF index of each HF row: build the inverse of llama.cpp's reshape(h, 2, hd/2).swap(1, 2)
    gguf_of_hf = torch.arange(n_rows).reshape(n_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)
    return gguf_of_hf


# --- a whole GGUF file -> a halfbyte quantized model directory ------------------------------------

_LINEAR = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
           ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")
_DENSE_TYPES = ("F32", "F16", "BF16")


def import_gguf_quantized(
    path: Path, out: Path, *, overwrite: bool = False, unfusable: str = "dense", q6k_bits: int = 8, measure: bool = True,
    show_progress: bool = False,
) -> ImportReport:
    """A llama GGUF file -> a halfbyte quantized model directory: linear weights quantized as the
    table above says, everything else (embeddings, norms) dense float32 as gguf dequantizes it;
    config.json and tokenizer files exactly as `halfbyte import-gguf` writes them."""
    # The metadata side is halfbyte.io.gguf_import's: one reading of GGUF configs and tokenizers.
    from halfbyte.io import gguf_import as gi
    from halfbyte.io.gguf_tokenizer import tokenizer_from_gguf

    path, out = Path(path), Path(out)
    if out.exists() and not overwrite:
        raise HalfbyteError(f"{out} already exists; remove it or choose another output directory")
    reader = gi.open_gguf(path)
    meta = gi.gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    gi._check_bounds(reader, path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    rope = next((t for t in reader.tensors if t.name == gi._ROPE_FREQS), None)
    cfg = gi._config(meta, shapes, gi._dequantized(rope, {}) if rope is not None else None)
    plan = gi._check_tensors(reader, cfg, shapes)  # [(GGUF tensor, HF name)], names and shapes checked
    tokenizer = tokenizer_from_gguf(meta)
    tok_cfg = gi._tokenizer_config(meta, cfg)
    by_name = {name: t for t, name in plan}
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}

    def is_quantized_linear(name: str) -> bool:
        linear = name.endswith(_LINEAR) or name == "lm_head.weight"
        return linear and type_name(by_name[name].tensor_type) not in _DENSE_TYPES

    prefixes = [n.removesuffix(".weight") for n in by_name if is_quantized_linear(n)]
    report = ImportReport(f"GGUF {path.name}", out)

    def read(prefix: str) -> QuantWeight:
        t = by_name[f"{prefix}.weight"]
        n, k = shapes[t.name]  # a linear layer's weight: two dimensions (checked with the plan)
        imported = gguf_to_quant_weight(np.asarray(t.data), t.tensor_type, (n, k), prefix, q6k_bits, measure)
        err = imported.max_abs_err
        report.layers.append(LayerReport(prefix, imported.source_type, imported.exact, 0.0 if err != err else err, imported.note))
        if not imported.exact:
            report.notes.append(f"{prefix}: {imported.note} (max |error| {err:.3g}, rms {imported.rms_err:.3g} of rms weight {imported.rms_weight:.3g})")
        w = imported.weight
        kind = prefix.rsplit(".", 1)[-1]
        return permute_out(w, unpermute_rope_rows(w.out_features, heads[kind])) if kind in heads else w

    def fill(tmp: Path) -> None:
        writer, layers, written = ShardWriter(tmp), {}, []  # type: ignore[var-annotated]
        for fused_prefix, members in progress(plan_layers(prefixes), f"importing {path.name}", show_progress):
            parts: list[tuple[str, QuantWeight, torch.Tensor | None]] = [(p, read(p), None) for p in members]
            written.extend(w for _, w, _ in parts)
            emit_layer(writer, layers, report, fused_prefix, parts, unfusable)
        quantized = {f"{p}.weight" for p in prefixes}
        for name, t in by_name.items():
            if name not in quantized:  # dequantized (and q/k un-permuted) as import-gguf does
                writer.add(name, torch.from_numpy(gi._dequantized(t, cfg).copy()))
        writer.close()
        report.bits_per_weight = bits_per_weight(iter(written))
        source = {"format": "gguf", "importer_version": IMPORTER_VERSION, "path": str(path)}
        (tmp / "config.json").write_text(json.dumps(finish_config(cfg, layers, report.bits_per_weight, source), indent=2) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
        gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    write_atomically(out, overwrite, fill)
    return report
