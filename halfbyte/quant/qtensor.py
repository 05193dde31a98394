"""QuantWeight: one quantized linear weight in the halfbyte format, and its torch reference.

`dequantize` and `matmul` here define what the stored tensors mean; GPU kernels are tested
against them. Layout and key names are specified in docs/format.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from halfbyte.errors import QuantizationError
from halfbyte.quant.packing import BLOCK_K, check_bits, pack, packed_rows, unpack
from halfbyte.quant.scale_codes import ScaleCodes, check_codes, decode, encode
from halfbyte.quant.table_codes import TableCodes, check_index_bits, pack_indices, table_storage_bits, unpack_indices

# how a slice stores its scales and mins: False fp16, True 8-bit codes (scale_codes.py),
# (scale_bits, min_bits) table codes (table_codes.py)
CodeSpec = bool | tuple[int, int]

ALLOWED_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
FORMAT_VERSION = 1


def slice_storage_bits(width: int, bits: int, group_size: int, n: int, coded: CodeSpec) -> int:
    """Stored bits of one slice (docs/format.md's accounting), from its shape alone: packed
    values, then per group an fp16 scale and min (32 bits), or their 8-bit codes (16 bits) plus
    two fp16 steps per column, or table indices (table_codes.table_storage_bits)."""
    groups = math.ceil(width / group_size)
    if isinstance(coded, tuple):
        return width * bits * n + table_storage_bits(groups, n, *coded)
    return width * bits * n + (16 * groups * n + 32 * n if coded else 32 * groups * n)


def code_spec(codes: ScaleCodes | TableCodes | None) -> CodeSpec:
    if isinstance(codes, TableCodes):
        return (codes.scale_bits, codes.min_bits)
    return codes is not None


@dataclass
class QuantSlice:
    """Columns k_start..k_end of W in stored (permuted) order, all with one bits/group size.

    Groups are counted from k_start: value k of the slice uses group (k - k_start) // group_size.
    """

    k_start: int
    k_end: int
    bits: int
    group_size: int
    qweight: torch.Tensor  # int32 [(k_end - k_start) / 32 * bits, N]
    scales: torch.Tensor  # float16 [num_groups, N]
    mins: torch.Tensor  # float16 [num_groups, N]
    # stored as 8-bit codes with per-column steps (scale_codes.py) or as table codes
    # (table_codes.py); scales and mins above are their decoded values either way
    codes: ScaleCodes | TableCodes | None = None

    @property
    def width(self) -> int:
        return self.k_end - self.k_start

    @property
    def num_groups(self) -> int:
        return math.ceil(self.width / self.group_size)

    @classmethod
    def from_values(
        cls, k_start: int, bits: int, group_size: int, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
        codes: ScaleCodes | TableCodes | None = None,
    ) -> QuantSlice:
        """Pack q [N, width] with its fp16 scales/mins [num_groups, N]."""
        return cls(k_start, k_start + q.shape[1], bits, group_size, pack(q, bits), scales, mins, codes)

    def validate(self, out_features: int, where: str = "slice") -> None:
        """Raise QuantizationError naming `where` if any field disagrees with the format."""
        check_bits(self.bits, where)
        if self.k_start < 0 or self.k_end <= self.k_start:
            raise QuantizationError(f"{where}: empty or negative k range [{self.k_start}, {self.k_end})")
        if self.k_start % BLOCK_K or self.width % BLOCK_K:
            raise QuantizationError(
                f"{where}: k range [{self.k_start}, {self.k_end}) must start and end on multiples of {BLOCK_K}"
            )
        gs = self.group_size
        if gs not in ALLOWED_GROUP_SIZES and gs != self.width:
            raise QuantizationError(
                f"{where}: group size {gs} not allowed; expected one of {ALLOWED_GROUP_SIZES} "
                f"or the slice width {self.width} (per-channel)"
            )
        expect_q = (packed_rows(self.width, self.bits), out_features)
        if self.qweight.dtype != torch.int32 or tuple(self.qweight.shape) != expect_q:
            raise QuantizationError(
                f"{where}: qweight must be int32 {list(expect_q)}, "
                f"got {self.qweight.dtype} {list(self.qweight.shape)}"
            )
        expect_s = (self.num_groups, out_features)
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t.dtype != torch.float16 or tuple(t.shape) != expect_s:
                raise QuantizationError(
                    f"{where}: {name} must be float16 {list(expect_s)}, got {t.dtype} {list(t.shape)}"
                )
        if isinstance(self.codes, TableCodes):
            self.codes.validate(self.num_groups, out_features, where)
            scales, mins = self.codes.decode()
            if not (torch.equal(scales, self.scales) and torch.equal(mins, self.mins)):
                raise QuantizationError(f"{where}: scales or mins differ from their table codes")
        elif self.codes is not None:
            check_codes(self.codes, out_features, where)
            encode(self.scales, self.mins, self.codes, where)  # raises unless exactly coded

    def dequantize(self) -> torch.Tensor:
        """float32 [N, width]: q * scales[g] + mins[g], computed in float32."""
        q = unpack(self.qweight, self.bits, self.width).float()  # [N, width]
        group = torch.arange(self.width, device=q.device) // self.group_size
        return q * self.scales.float().t()[:, group] + self.mins.float().t()[:, group]

    def storage_bits(self) -> int:
        return slice_storage_bits(self.width, self.bits, self.group_size, self.scales.shape[1], code_spec(self.codes))

    def meta(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {"k_start": self.k_start, "k_end": self.k_end, "bits": self.bits,
                                     "group_size": self.group_size}
        if isinstance(self.codes, TableCodes):
            out.update(scale_codes="table", scale_bits=self.codes.scale_bits, min_bits=self.codes.min_bits)
        elif self.codes is not None:
            out["scale_codes"] = 8
        return out

    def to(self, device: torch.device | str) -> QuantSlice:
        return QuantSlice(self.k_start, self.k_end, self.bits, self.group_size, self.qweight.to(device),
                          self.scales.to(device), self.mins.to(device),
                          self.codes.to(device) if self.codes is not None else None)

    @classmethod
    def from_stored(
        cls, k_start: int, k_end: int, bits: int, group_size: int, qweight: torch.Tensor, scales: torch.Tensor,
        mins: torch.Tensor, codes: ScaleCodes | None, where: str,
    ) -> QuantSlice:
        """A slice from its stored tensors: with codes, `scales` / `mins` are the uint8 / int8 codes."""
        if codes is None:
            return cls(k_start, k_end, bits, group_size, qweight, scales, mins)
        if scales.dtype != torch.uint8 or mins.dtype != torch.int8:
            raise QuantizationError(f"{where}: coded scales / mins must be uint8 / int8, got {scales.dtype} / {mins.dtype}")
        check_codes(codes, scales.shape[-1], where)
        fp_scales, fp_mins = decode(scales, mins, codes)
        return cls(k_start, k_end, bits, group_size, qweight, fp_scales, fp_mins, codes)

    @classmethod
    def from_table(
        cls, k_start: int, k_end: int, bits: int, group_size: int, qweight: torch.Tensor, packed: torch.Tensor,
        scale_base: torch.Tensor, scale_table: torch.Tensor, min_table: torch.Tensor, scale_bits: int, min_bits: int,
        where: str,
    ) -> QuantSlice:
        """A table-coded slice from its stored tensors (packed indices, base, tables)."""
        check_index_bits(scale_bits, min_bits, where)
        if k_end <= k_start or group_size <= 0 or scale_base.dim() != 1:
            raise QuantizationError(f"{where}: bad k range, group size or scale_base shape")
        groups, n = math.ceil((k_end - k_start) / group_size), scale_base.shape[0]
        si, mi = unpack_indices(packed, groups, n, scale_bits, min_bits, where)
        codes = TableCodes(scale_bits, min_bits, scale_base, scale_table, min_table, si, mi)
        codes.validate(groups, n, where)
        scales, mins = codes.decode()
        return cls(k_start, k_end, bits, group_size, qweight, scales, mins, codes)


@dataclass
class QuantWeight:
    """A quantized [out_features, in_features] weight: K-slices of possibly different bits, and an
    optional act-order permutation (stored column j is original column perm[j])."""

    out_features: int
    in_features: int
    slices: list[QuantSlice]
    perm: torch.Tensor | None = None  # int32 [K]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "weight") -> None:
        if self.out_features <= 0 or self.in_features <= 0:
            raise QuantizationError(f"{where}: bad shape [{self.out_features}, {self.in_features}]")
        if not self.slices:
            raise QuantizationError(f"{where}: no slices")
        k = 0
        for i, s in enumerate(self.slices):
            if s.k_start != k:
                raise QuantizationError(
                    f"{where}: slice {i} starts at {s.k_start}, expected {k} (slices must tile K)"
                )
            s.validate(self.out_features, f"{where} slice {i}")
            k = s.k_end
        if k != self.in_features:
            raise QuantizationError(f"{where}: slices cover K = {k}, in_features is {self.in_features}")
        if self.perm is not None:
            p = self.perm
            if p.dtype != torch.int32 or tuple(p.shape) != (self.in_features,):
                raise QuantizationError(
                    f"{where}: perm must be int32 [{self.in_features}], got {p.dtype} {list(p.shape)}"
                )
            if p.numel() and (
                int(p.min()) < 0
                or int(p.max()) >= self.in_features
                or not bool((torch.bincount(p.long(), minlength=self.in_features) == 1).all())
            ):
                raise QuantizationError(f"{where}: perm is not a permutation of 0..{self.in_features - 1}")

    # --- the reference meaning --------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in the ORIGINAL column order (the permutation undone)."""
        stored = torch.cat([s.dequantize() for s in self.slices], dim=1)  # [N, K], stored order
        if self.perm is None:
            return stored.to(dtype)
        w = torch.empty_like(stored)
        w[:, self.perm.long()] = stored
        return w.to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N] in x's dtype; the kernels' way: permute x, one matmul per
        slice, float32 accumulation."""
        if x.shape[-1] != self.in_features:
            raise QuantizationError(f"matmul: x has {x.shape[-1]} features, weight expects {self.in_features}")
        xf = x.float()
        if self.perm is not None:
            xf = xf[..., self.perm.long()]
        y = torch.zeros(*x.shape[:-1], self.out_features, dtype=torch.float32, device=x.device)
        for s in self.slices:
            y += xf[..., s.k_start : s.k_end] @ s.dequantize().t()
        return y.to(x.dtype)

    # --- accounting ---------------------------------------------------------------------------

    def storage_bits(self) -> int:
        """Every stored bit: packed words, fp16 scales and mins (or their 8-bit codes and steps), and
        the int32 perm if present."""
        perm_bits = self.perm.numel() * 32 if self.perm is not None else 0
        return sum(s.storage_bits() for s in self.slices) + perm_bits

    def bits_per_weight(self) -> float:
        return self.storage_bits() / (self.out_features * self.in_features)

    # --- serialisation ------------------------------------------------------------------------

    def to_state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors under `{prefix}.qweight.{i}`, `.scales.{i}`, `.mins.{i}` (i = slice), `.perm`."""
        out: dict[str, torch.Tensor] = {}
        for i, s in enumerate(self.slices):
            out[f"{prefix}.qweight.{i}"] = s.qweight
            if isinstance(s.codes, TableCodes):
                c = s.codes
                out[f"{prefix}.codes.{i}"] = pack_indices(c.scale_index, c.min_index, c.scale_bits, c.min_bits)
                out[f"{prefix}.scale_base.{i}"] = c.scale_base
                out[f"{prefix}.scale_table.{i}"] = c.scale_table
                out[f"{prefix}.min_table.{i}"] = c.min_table
            elif s.codes is not None:
                out[f"{prefix}.scales.{i}"], out[f"{prefix}.mins.{i}"] = encode(s.scales, s.mins, s.codes, prefix)
                out[f"{prefix}.scale_step.{i}"] = s.codes.scale_step
                out[f"{prefix}.min_step.{i}"] = s.codes.min_step
            else:
                out[f"{prefix}.scales.{i}"] = s.scales
                out[f"{prefix}.mins.{i}"] = s.mins
        if self.perm is not None:
            out[f"{prefix}.perm"] = self.perm
        return out

    def meta(self) -> dict[str, Any]:
        """JSON-able per-layer entry of config.json's `quantization.layers`."""
        return {
            "out_features": self.out_features,
            "in_features": self.in_features,
            "act_order": self.perm is not None,
            "slices": [s.meta() for s in self.slices],
        }

    @classmethod
    def from_state_dict(
        cls, prefix: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> QuantWeight:
        """Rebuild from `to_state_dict` tensors and `meta()`; every mismatch is a QuantizationError
        naming the layer."""
        if not isinstance(meta, dict):
            raise QuantizationError(f"{prefix}: quantization metadata must be an object, got {type(meta).__name__}")
        n = _meta_int(meta, "out_features", prefix)
        k = _meta_int(meta, "in_features", prefix)
        slice_metas = meta.get("slices")
        if not isinstance(slice_metas, list) or not slice_metas:
            raise QuantizationError(f"{prefix}: metadata 'slices' must be a non-empty list")

        def get(key: str) -> torch.Tensor:
            if key not in tensors:
                raise QuantizationError(f"{prefix}: missing tensor {key!r}")
            return tensors[key]

        slices = []
        for i, sm in enumerate(slice_metas):
            where = f"{prefix} slice {i}"
            if not isinstance(sm, dict):
                raise QuantizationError(f"{where}: metadata must be an object")
            codes = None
            if sm.get("scale_codes") == "table":
                slices.append(
                    QuantSlice.from_table(
                        _meta_int(sm, "k_start", where), _meta_int(sm, "k_end", where), _meta_int(sm, "bits", where),
                        _meta_int(sm, "group_size", where), get(f"{prefix}.qweight.{i}"), get(f"{prefix}.codes.{i}"),
                        get(f"{prefix}.scale_base.{i}"), get(f"{prefix}.scale_table.{i}"), get(f"{prefix}.min_table.{i}"),
                        _meta_int(sm, "scale_bits", where), _meta_int(sm, "min_bits", where), where,
                    )
                )
                continue
            if "scale_codes" in sm:
                if sm["scale_codes"] != 8:
                    raise QuantizationError(f"{where}: scale_codes must be 8 or \"table\", got {sm['scale_codes']!r}")
                codes = ScaleCodes(get(f"{prefix}.scale_step.{i}"), get(f"{prefix}.min_step.{i}"))
            slices.append(
                QuantSlice.from_stored(
                    _meta_int(sm, "k_start", where), _meta_int(sm, "k_end", where), _meta_int(sm, "bits", where),
                    _meta_int(sm, "group_size", where), get(f"{prefix}.qweight.{i}"), get(f"{prefix}.scales.{i}"),
                    get(f"{prefix}.mins.{i}"), codes, where,
                )
            )
        act_order = meta.get("act_order", False)
        if not isinstance(act_order, bool):
            raise QuantizationError(f"{prefix}: metadata 'act_order' must be true or false")
        perm = get(f"{prefix}.perm") if act_order else None
        if not act_order and f"{prefix}.perm" in tensors:
            raise QuantizationError(f"{prefix}: tensor {prefix}.perm present but act_order is false")
        # bypass __post_init__ so that validation errors name this layer, not "weight"
        w = cls.__new__(cls)
        w.out_features, w.in_features, w.slices, w.perm = n, k, slices, perm
        w.validate(prefix)
        return w

    def to(self, device: torch.device | str) -> QuantWeight:
        slices = [s.to(device) for s in self.slices]
        perm = self.perm.to(device) if self.perm is not None else None
        return QuantWeight(self.out_features, self.in_features, slices, perm)


def _meta_int(meta: dict[str, Any], key: str, where: str) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise QuantizationError(f"{where}: metadata {key!r} must be an integer, got {v!r}")
    return v


def concat_out(weights: list[QuantWeight]) -> QuantWeight:
    """Fuse weights along out_features (q/k/v -> qkv, gate/up): they must share in_features,
    slice boundaries, bits, group sizes and permutation."""
    if not weights:
        raise QuantizationError("concat_out: no weights")
    first = weights[0]
    for j, w in enumerate(weights[1:], start=1):
        if w.in_features != first.in_features:
            raise QuantizationError(
                f"concat_out: weight {j} has in_features {w.in_features}, not {first.in_features}"
            )
        if [s.meta() for s in w.slices] != [s.meta() for s in first.slices]:
            raise QuantizationError(f"concat_out: weight {j} has different slices (k ranges, bits or group size)")
        same_perm = (w.perm is None and first.perm is None) or (
            w.perm is not None and first.perm is not None and torch.equal(w.perm, first.perm)
        )
        if not same_perm:
            raise QuantizationError(f"concat_out: weight {j} has a different act-order permutation")
    slices = []
    for i, s in enumerate(first.slices):
        parts = [w.slices[i] for w in weights]
        codes = [p.codes for p in parts if p.codes is not None]  # all or none: the metas matched
        slices.append(
            QuantSlice(
                s.k_start, s.k_end, s.bits, s.group_size,
                torch.cat([p.qweight for p in parts], dim=1),
                torch.cat([p.scales for p in parts], dim=1),
                torch.cat([p.mins for p in parts], dim=1),
                _cat_codes(codes) if codes else None,
            )
        )
    out_features = sum(w.out_features for w in weights)
    return QuantWeight(out_features, first.in_features, slices, first.perm)


def _cat_codes(codes: list[ScaleCodes | TableCodes]) -> ScaleCodes | TableCodes:
    """The codes of slices fused along N: 8-bit steps concatenate; table codes only when every
    part has the same tables (they are per slice)."""
    if not isinstance(codes[0], TableCodes):
        return ScaleCodes.cat(codes)  # type: ignore[arg-type]
    first = codes[0]
    for c in codes[1:]:
        assert isinstance(c, TableCodes)
        if not (torch.equal(c.scale_table, first.scale_table) and torch.equal(c.min_table, first.min_table)):
            raise QuantizationError("concat_out: table-coded slices with different tables cannot be fused")
    tcs = [c for c in codes if isinstance(c, TableCodes)]
    return TableCodes(first.scale_bits, first.min_bits, torch.cat([c.scale_base for c in tcs]), first.scale_table,
                      first.min_table, torch.cat([c.scale_index for c in tcs], dim=1), torch.cat([c.min_index for c in tcs], dim=1))
