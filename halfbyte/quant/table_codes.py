"""Table-coded group scales and mins: a few bits per group index two small per-slice tables.

A table-coded slice stores, per output column n, one float16 `scale_base[n]`, per slice two
float16 tables, `scale_table` (2^scale_bits entries, factors on the base) and `min_table`
(2^min_bits entries, mins in units of the group's scale), and per group two indices:

    scales[g, n] = fp16(scale_base[n] * scale_table[si[g, n]])
    mins[g, n]   = fp16(scales[g, n] * min_table[mi[g, n]])

(each product of two fp16 values computed in float32, which is exact, then rounded once to
float16). The indices are stored as one packed bitstream of scale_bits + min_bits bits per group
(`pack_indices`). A 4-bit group-32 slice with 4 + 5 index bits costs 4 + 9 / 32 + 16 / K bits per
weight (plus the tables): 4.30 for SmolLM2's K = 576, against 4.56 for 8-bit codes
(scale_codes.py) and 5.06 for fp16 scales and mins.

Why the min is coded relative to the scale: a Q4_1 group (or any min-max grid) has
m = -c * d with c spread around 2^bits / 2, and the weight error of a coded group,
dd * (q - q_mid) + dc, is relative to d; so the scale gets relative (log-spaced) precision and
the min a precision in units of the scale. The tables are fitted per slice (`fit_tables`:
Lloyd-Max in the log of the scale and in min / scale, each group weighted by its scale
squared, as the error it takes is). As with 8-bit codes, the decoded fp16 scales and mins are
what loaders hand to the kernels; the codes exist in the file and the bit accounting."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from halfbyte.errors import QuantizationError

MAX_INDEX_BITS = 8  # per table; both indices together at most 16 bits per group
_LLOYD_ITERS = 25
_TINY = 2.0**-24  # fp16's smallest subnormal


@dataclass
class TableCodes:
    """A table-coded slice's stored parts: index widths, the base per column, both tables, and
    the indices [G, N] (uint8; kept in memory so the file is written without searching)."""

    scale_bits: int
    min_bits: int
    scale_base: torch.Tensor  # float16 [N]
    scale_table: torch.Tensor  # float16 [2^scale_bits]
    min_table: torch.Tensor  # float16 [2^min_bits]
    scale_index: torch.Tensor  # uint8 [G, N]
    min_index: torch.Tensor  # uint8 [G, N]

    def to(self, device: torch.device | str) -> TableCodes:
        return TableCodes(self.scale_bits, self.min_bits, self.scale_base.to(device), self.scale_table.to(device),
                          self.min_table.to(device), self.scale_index.to(device), self.min_index.to(device))

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp16 scales and mins [G, N]."""
        scales = (self.scale_base.float()[None, :] * self.scale_table.float()[self.scale_index.long()]).half()
        mins = (scales.float() * self.min_table.float()[self.min_index.long()]).half()
        return scales, mins

    def validate(self, groups: int, n: int, where: str) -> None:
        check_index_bits(self.scale_bits, self.min_bits, where)
        shapes = (("scale_base", self.scale_base, torch.float16, (n,)),
                  ("scale_table", self.scale_table, torch.float16, (1 << self.scale_bits,)),
                  ("min_table", self.min_table, torch.float16, (1 << self.min_bits,)),
                  ("scale_index", self.scale_index, torch.uint8, (groups, n)),
                  ("min_index", self.min_index, torch.uint8, (groups, n)))
        for name, t, dtype, shape in shapes:
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise QuantizationError(f"{where}: {name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
        for name, t in (("scale_base", self.scale_base), ("scale_table", self.scale_table), ("min_table", self.min_table)):
            if not bool(torch.isfinite(t).all()):
                raise QuantizationError(f"{where}: {name} has non-finite entries")
        if not bool((self.scale_base > 0).all()) or not bool((self.scale_table > 0).all()):
            raise QuantizationError(f"{where}: scale_base and scale_table must be positive")
        if self.scale_index.numel() and (int(self.scale_index.max()) >> self.scale_bits or int(self.min_index.max()) >> self.min_bits):
            raise QuantizationError(f"{where}: table index out of range")
        scales, mins = self.decode()
        if not bool(torch.isfinite(scales).all()) or not bool(torch.isfinite(mins).all()):
            raise QuantizationError(f"{where}: decoded scales or mins overflow float16")

    def storage_bits(self) -> int:
        groups, n = self.scale_index.shape
        return table_storage_bits(groups, n, self.scale_bits, self.min_bits)


def check_index_bits(scale_bits: object, min_bits: object, where: str) -> None:
    for name, b in (("scale_bits", scale_bits), ("min_bits", min_bits)):
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= MAX_INDEX_BITS:
            raise QuantizationError(f"{where}: {name} must be an integer in 1..{MAX_INDEX_BITS}, got {b!r}")


def table_storage_bits(groups: int, n: int, scale_bits: int, min_bits: int) -> int:
    """Bits of a table-coded slice's scales and mins: the packed indices (whole bytes), the fp16
    base per column, and both fp16 tables."""
    return 8 * packed_bytes(groups * n, scale_bits + min_bits) + 16 * n + 16 * ((1 << scale_bits) + (1 << min_bits))


def packed_bytes(count: int, width: int) -> int:
    return -(-count * width // 8)


def pack_indices(scale_index: torch.Tensor, min_index: torch.Tensor, scale_bits: int, min_bits: int) -> torch.Tensor:
    """[G, N] indices -> uint8 bitstream: field j = g * N + n is scale_index | min_index << scale_bits,
    scale_bits + min_bits wide, at stream bits [j * width, (j + 1) * width), least significant bit
    first; stream bit b is bit b % 8 of byte b // 8."""
    width = scale_bits + min_bits
    field = scale_index.reshape(-1).to(torch.int32) | (min_index.reshape(-1).to(torch.int32) << scale_bits)
    bits = ((field[:, None] >> torch.arange(width, dtype=torch.int32)) & 1).to(torch.uint8).reshape(-1)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8))
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.int32)
    return (bits.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


def unpack_indices(
    packed: torch.Tensor, groups: int, n: int, scale_bits: int, min_bits: int, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    width = scale_bits + min_bits
    count = groups * n
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (packed_bytes(count, width),):
        raise QuantizationError(
            f"{where}: packed table indices must be uint8 [{packed_bytes(count, width)}], got {packed.dtype} {list(packed.shape)}"
        )
    bits = ((packed.to(torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32)) & 1).reshape(-1)[: count * width]
    field = (bits.view(count, width) << torch.arange(width, dtype=torch.int32)).sum(1).to(torch.int32)
    scale_index = (field & ((1 << scale_bits) - 1)).to(torch.uint8).view(groups, n)
    min_index = (field >> scale_bits).to(torch.uint8).view(groups, n)
    return scale_index, min_index


# --- fitting and encoding ------------------------------------------------------------------------


def _lloyd(x: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd-Max) of x with k centres, started on quantiles; sorted."""
    x, weight = x.reshape(-1).float(), weight.reshape(-1).float()
    sample = x if x.numel() <= 1 << 22 else x[:: math.ceil(x.numel() / (1 << 22))]
    centres = torch.quantile(sample, (torch.arange(k, dtype=torch.float32) + 0.5) / k)
    for _ in range(_LLOYD_ITERS):
        idx = torch.bucketize(x, (centres[1:] + centres[:-1]) / 2)
        total = torch.zeros(k).index_add_(0, idx, x * weight)
        mass = torch.zeros(k).index_add_(0, idx, weight)
        moved = torch.where(mass > 0, total / mass.clamp_min(1e-30), centres).sort().values
        if torch.equal(moved, centres):  # a fixed point: further iterations change nothing
            break
        centres = moved
    return centres


def group_grid(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's min-max grid of w [N, width]: (scale, min) float32 [G, N]."""
    n, width = w.shape
    pad = -width % group_size
    wg = torch.nn.functional.pad(w.float(), (0, pad), value=float("nan")).view(n, -1, group_size)
    lo = torch.nan_to_num(wg, nan=float("inf")).amin(-1)
    hi = torch.nan_to_num(wg, nan=float("-inf")).amax(-1)
    return ((hi - lo) / ((1 << bits) - 1)).t(), lo.t()


def fit_tables(
    w: torch.Tensor, bits: int, group_size: int, scale_bits: int, min_bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale_base [N], scale_table, min_table), float16, for quantizing w [N, width] at `bits`:
    the base is each column's largest group scale; the tables are Lloyd-Max fits to the groups'
    min-max grids (log scale / base, and min / scale), weighted by the scale squared."""
    check_index_bits(scale_bits, min_bits, "table codes")
    scale, mn = group_grid(w, bits, group_size)  # [G, N]
    base = scale.amax(0).clamp_min(2.0**-14).half()  # fp16 normal: base * table stays nonzero
    floor = base.float()[None, :] * 2.0**-10
    s = torch.maximum(scale, floor)
    wt = scale.square()
    if not bool((wt > 0).any()):
        wt = torch.ones_like(wt)
    log_t = _lloyd((s / base.float()[None, :]).log(), wt, 1 << scale_bits)
    scale_table = log_t.exp().clamp(2.0**-10, 16.0).half()
    min_table = _lloyd(mn / s, wt, 1 << min_bits).clamp(-60000, 60000).half()
    return base, scale_table, min_table


def choose(
    w: torch.Tensor, base: torch.Tensor, scale_table: torch.Tensor, min_table: torch.Tensor, maxq: int,
    col_weight: torch.Tensor | None = None, window: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The coded grid for one group of columns w [R, G] (rows with their column's base [R]):
    per row the (scale, min) among the table entries near its min-max grid (`window` scale
    entries each side of the nearest, each with the min nearest to the group's lowest value and
    to its least-squares min) with the least (col_weight-weighted) rounding error.
    Returns (scale, min) float32 holding fp16 values, and their indices (int64) [R]."""
    w = w.float()
    cw = torch.ones(w.shape[1]) if col_weight is None else col_weight.float()
    cw = cw / cw.sum().clamp_min(1e-30)
    lo, hi = w.amin(1), w.amax(1)
    b = base.float()
    st, mt = scale_table.float(), min_table.float()
    log_st = st.log()
    ideal = ((hi - lo) / maxq).clamp_min(_TINY) / b
    near = torch.bucketize(ideal.log(), (log_st[1:] + log_st[:-1]) / 2)
    m_edges = (mt[1:] + mt[:-1]) / 2
    # every trial at once (one tensor op per step instead of one per trial: this runs once per
    # group and candidate inside GPTQ's column loop): scale entries near[r] + off, each with the
    # min nearest the group's lowest value and the min nearest its least-squares min
    offs = torch.arange(-window, window + 1)
    si = (near[None, :] + offs[:, None]).clamp(0, st.numel() - 1)  # [O, R]
    sc = (b[None, :] * st[si]).half().float()
    qr = torch.clamp(torch.round((w[None] - lo[None, :, None]) / sc[..., None]), 0, maxq)
    target = torch.stack([lo.expand_as(sc), ((w[None] - qr * sc[..., None]) * cw).sum(-1)], 1)  # [O, 2, R]
    sc2 = sc[:, None, :].expand_as(target)
    mi = torch.bucketize(target / sc2, m_edges)
    mn = (sc2 * mt[mi]).half().float()
    q = torch.clamp(torch.round((w[None, None] - mn[..., None]) / sc2[..., None]), 0, maxq)
    err = ((q * sc2[..., None] + mn[..., None] - w[None, None]).square() * cw).sum(-1)  # [O, 2, R]
    # the first trial (in the order off, then lowest before least-squares) with the least error
    best = err.reshape(-1, w.shape[0]).argmin(0)  # [R]
    rows = torch.arange(w.shape[0])
    pick = lambda t: t.reshape(-1, w.shape[0])[best, rows]  # noqa: E731
    return pick(sc2), pick(mn), pick(si[:, None, :].expand_as(target)), pick(mi)
