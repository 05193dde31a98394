"""Measured mixed-bit allocation: candidate settings per layer, their measured error, and the
optimiser that picks one candidate per layer within a bits-per-weight budget.

A candidate is a list of K-slices (fraction of K, bits) at one group size: uniform ("4 bits,
group 128") or EXL2-style mixed ("the first 25 % of the act-order columns at 5 bits, the rest
at 4"). With act-order the first stored columns are those with the largest input energy, so the
high-bit slice goes where rounding errors cost most.

measure_candidates gives a candidate's relative output error ||X (W - Wq)^T||^2 / ||X W^T||^2
on the calibration tokens; the converter's measurement pass instead takes the quantized weights
from candidate_weights and measures what they do to the residual stream (block_error.py), which
predicts the model's loss far better. allocate minimises the sum of the errors within the
storage budget.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import torch

from halfbyte.errors import QuantizationError
from halfbyte.quant.gptq import _inverse_cholesky_upper, activation_order, gptq_quantize
from halfbyte.quant.packing import BLOCK_K, SUPPORTED_BITS
from halfbyte.quant.qtensor import CodeSpec, QuantSlice, QuantWeight, slice_storage_bits
from halfbyte.quant.rtn import group_params
from halfbyte.quant.scale_codes import ScaleCodes, grid_steps, snap
from halfbyte.quant.table_codes import choose, fit_tables

PER_CHANNEL = 0  # group_size 0 in a Candidate: one group per slice (the slice width)


@dataclass(frozen=True)
class Candidate:
    """One quantization setting of a layer: `parts` are (fraction of K, bits) in stored order;
    fractions are rounded to multiples of 32 columns when resolved for a K."""

    parts: tuple[tuple[float, int], ...]
    group_size: int
    # False: never act-order (columns in their own order; costs no permutation and keeps a weight
    # that already sits on a group grid exactly representable). True: act-order whenever the
    # conversion allows it.
    act_order: bool = True
    # scales and mins as 8-bit codes (scale_codes.py): 16 bits per group instead of 32
    scale_codes: bool = False
    # act-order moves blocks of this many columns (gptq.activation_order): 32 keeps groups of 32
    # whole, so a slice holding a group keeps a grid the weight already sits on
    order_block: int = 1
    # (scale_bits, min_bits): scales and mins as table codes (table_codes.py) instead
    table: tuple[int, int] | None = None

    @property
    def codes(self) -> CodeSpec:
        """How the candidate's slices store scales and mins (qtensor.CodeSpec)."""
        return self.table if self.table is not None else self.scale_codes

    def uses_act_order(self, allowed: bool) -> bool:
        return allowed and self.act_order

    def sweep_order(self, allowed: bool) -> int:
        """0: column order; else the act-order block (one GPTQ sweep serves each value)."""
        return self.order_block if self.uses_act_order(allowed) else 0

    @property
    def name(self) -> str:
        g = "pc" if self.group_size == PER_CHANNEL else f"g{self.group_size}"
        g += "" if self.act_order else " seq"
        g += " c8" if self.scale_codes else ""
        g += f" t{self.table[0]}{self.table[1]}" if self.table is not None else ""
        g += f" ob{self.order_block}" if self.order_block != 1 else ""
        if len(self.parts) == 1:
            return f"{self.parts[0][1]}b {g}"
        return "+".join(f"{round(f * 100)}%{b}b" for f, b in self.parts) + f" {g}"

    def slices(self, k: int) -> list[tuple[int, int, int, int]]:
        """Concrete (k_start, k_end, bits, group_size) for a weight with K = k columns; a part
        that would round to zero width is dropped."""
        blocks = k // BLOCK_K
        bounds = [0]
        acc = 0.0
        for frac, _ in self.parts[:-1]:
            acc += frac
            bounds.append(max(bounds[-1], min(blocks, round(acc * blocks))))
        bounds.append(blocks)
        out = []
        for (_, bits), b0, b1 in zip(self.parts, bounds[:-1], bounds[1:], strict=True):
            if b1 > b0:
                width = (b1 - b0) * BLOCK_K
                gs = width if self.group_size == PER_CHANNEL or self.group_size >= width else self.group_size
                out.append((b0 * BLOCK_K, b1 * BLOCK_K, bits, gs))
        return out

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"parts": [list(p) for p in self.parts], "group_size": self.group_size,
                                  "act_order": self.act_order}
        if self.scale_codes:
            out["scale_codes"] = True
        if self.order_block != 1:
            out["order_block"] = self.order_block
        if self.table is not None:
            out["table"] = list(self.table)
        return out

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Candidate:
        raw: Any = d  # parsed JSON: the fields' types are checked by the conversions
        parts = tuple((float(f), int(b)) for f, b in raw["parts"])
        table = raw.get("table")
        return cls(parts, int(raw["group_size"]), bool(raw.get("act_order", True)), bool(raw.get("scale_codes", False)),
                   int(raw.get("order_block", 1)), (int(table[0]), int(table[1])) if table is not None else None)


def default_candidates(group_size: int | None = None, low_bits: bool = False) -> list[Candidate]:
    """Candidates at groups 32/64/128: 2 and 3 bits with act-order (where GPTQ gains most from
    it), 4 bits with and without, 5/6/8 bits in column order ("seq": no permutation to store,
    and a weight that already sits on a group grid stays exactly representable), and act-order
    two-slice mixes, half of K at b+1 bits and half at b (and 4 / 2, 8 / 6), at group 128.
    `group_size` restricts every candidate to that group size. Act-order candidates fall back to
    column order when the conversion runs without act-order. low_bits (budgets below
    LOW_BITS_BELOW bpw): also the table-coded candidates that only pay there."""
    groups = (32, 64, 128) if group_size is None else (group_size,)
    # 2 and 3 bits with fp16 scales only at group 128: at 32 and 64 their coded twins below cost
    # half the scale bits for nearly the same error
    cands = [Candidate(((1.0, b),), g) for b in (2, 3) for g in groups if g > 64 or group_size is not None]
    cands += [Candidate(((1.0, 4),), g) for g in groups]
    cands += [Candidate(((1.0, b),), g, act_order=False) for b in (4, 5, 6, 8) for g in groups]
    mix_groups = (128,) if group_size is None else (group_size,)
    for lo, hi in ((2, 3), (3, 4), (4, 5), (5, 6), (2, 4), (6, 8)):
        for g in mix_groups:
            cands.append(Candidate(((0.5, hi), (0.5, lo)), g))
    # 8-bit coded scales and mins at groups 32 / 64: 4 bits in column order (a weight on a 4-bit
    # group-32 grid stays nearly exact at 4.5 bpw), 2 and 3 bits with act-order
    coded_groups = tuple(g for g in groups if g <= 64)
    cands += [Candidate(((1.0, 4),), g, act_order=False, scale_codes=True) for g in coded_groups]
    cands += [Candidate(((1.0, b),), g, scale_codes=True) for b in (2, 3) for g in coded_groups]
    # ... and coded two-slice mixes at group 32 with act-order by whole groups: the high-energy
    # groups keep 4 bits (a 4-bit group-32 grid stays exact there), the rest take 3 (or 3 / 2)
    if 32 in groups:
        for hi_frac, hi, lo in ((0.75, 4, 3), (0.5, 4, 3), (0.25, 4, 3), (0.5, 3, 2)):
            cands.append(Candidate(((hi_frac, hi), (1 - hi_frac, lo)), 32, scale_codes=True, order_block=32))
        # table codes at group 32 (8-10 bits per group, table_codes.py): 4 bits in column order
        # holds a 4-bit group-32 grid closely at ~4.31-4.33 bpw; 3 bits with act-order. (4 + 4
        # index bits was never chosen at 4.25 and cost conversion time: dropped.)
        cands += [Candidate(((1.0, 4),), 32, act_order=False, table=t) for t in ((4, 5), (4, 6))]
        cands.append(Candidate(((1.0, 3),), 32, table=(4, 4)))
    if low_bits:
        # table codes at 2 and 3 bits, groups 32 / 64 (~2.1-3.1 bpw: a 3.25 budget then need not
        # drop a quarter of the matrices to 2 bits), and a 4 / 3 mix at group 64. Measured on
        # SmolLM2: predicted error at 3.25 -7.5%, at 2.5 -10%, at 4.25 -0.4% for ~10 s of
        # measurement each, so only low budgets measure them; held-out ppl 3.25 -3%, but 2.5 +5%
        # (BENCHMARKS.md: the error model mispredicts at 2 bits).
        table_groups = tuple(g for g in groups if g in (32, 64))
        cands += [Candidate(((1.0, 3),), g, table=(4, 4)) for g in table_groups if g != 32]
        cands += [Candidate(((1.0, 2),), g, table=(4, 4)) for g in table_groups]
        if 64 in groups:
            cands.append(Candidate(((0.25, 4), (0.75, 3)), 64, table=(4, 4)))
    return cands


# budgets below this many bits per weight measure default_candidates(low_bits=True)
LOW_BITS_BELOW = 4.0


def storage_bits(cand: Candidate, n: int, k: int, act_order: bool) -> int:
    """QuantWeight.storage_bits() of the weight this candidate makes, from shapes alone;
    act_order: whether the conversion allows act-order."""
    total = 32 * k if cand.uses_act_order(act_order) else 0
    for k0, k1, bits, gs in cand.slices(k):
        total += slice_storage_bits(k1 - k0, bits, gs, n, cand.codes)
    return total


def _prepare(
    w: torch.Tensor, hessian: torch.Tensor, act_order: bool, order_block: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """gptq_quantize's preprocessing: dead inputs zeroed with a unit diagonal, act-order
    permutation by descending input energy. Returns (weight, H, perm) in stored order."""
    h = hessian.float().clone()
    weight = w.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    perm = None
    if act_order:
        perm = activation_order(torch.diag(h), order_block)
        weight = weight[:, perm]
        h = h[perm][:, perm]
    return weight, h, perm


@dataclass
class _GroupJob:
    """Candidates whose groups start at one column and end at the same column with the same bits:
    their grids come from one batched group_params call (table-coded ones each from choose)."""

    idx: list[int]
    end: int
    bits: int
    codes: list[ScaleCodes | None]  # per candidate: its slice's 8-bit code steps, if coded
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # a table-coded candidate's (base, scale table, min table)


def _group_jobs(weight: torch.Tensor, candidates: list[Candidate]) -> tuple[torch.Tensor, dict[int, list[_GroupJob]]]:
    """Per stored column and candidate its max q [K, C]; per column the groups starting there."""
    k = weight.shape[1]
    maxq = torch.empty(k, len(candidates))
    jobs: dict[int, list[_GroupJob]] = {}
    plain: dict[tuple[int, int, int], _GroupJob] = {}
    for ci, cand in enumerate(candidates):
        for k0, k1, bits, gs in cand.slices(k):
            maxq[k0:k1, ci] = (1 << bits) - 1
            codes = grid_steps(weight[:, k0:k1], bits, gs) if cand.scale_codes else None
            tables = fit_tables(weight[:, k0:k1], bits, gs, *cand.table) if cand.table is not None else None
            for g0 in range(k0, k1, gs):
                g1 = min(g0 + gs, k1)
                if tables is not None:
                    jobs.setdefault(g0, []).append(_GroupJob([ci], g1, bits, [None], tables))
                    continue
                job = plain.get((g0, g1, bits))
                if job is None:
                    job = plain[(g0, g1, bits)] = _GroupJob([], g1, bits, [])
                    jobs.setdefault(g0, []).append(job)
                job.idx.append(ci)
                job.codes.append(codes)
    return maxq, jobs


def _sweep(
    weight: torch.Tensor, h: torch.Tensor, hinv: torch.Tensor, candidates: list[Candidate], block_size: int, clip_search: bool
) -> torch.Tensor:
    """One GPTQ sweep over the columns of weight [n, K] (stored order, preprocessed) for every
    candidate at once, batched along a candidate axis (per-column Python overhead dominates GPTQ
    on small layers). Returns the dequantized weights [K, C, n], stored order.

    Inside a block, a column (or a starting group's columns) takes the block's earlier errors when
    it is reached, as one product with them, instead of every remaining column of the block being
    updated after each column (GPTQ's arithmetic in another order, reading the errors instead of
    rewriting the block); the rest of K takes each block's errors in one in-place product."""
    rows_n, k = weight.shape
    c = len(candidates)
    maxq, jobs = _group_jobs(weight, candidates)  # [K, C], per column
    hdiag = torch.diag(h)  # [K] input energies, stored order
    # columns first, then candidates ([K, C, n]): a column is one contiguous [C, n] tile and the
    # lazy update of the rest of K is a single [K', B] x [B, C * n] product
    wc = weight.t().unsqueeze(1).repeat(1, c, 1)  # [K, C, n], error-updated up to the current block
    deq = torch.empty_like(wc)
    scale = torch.ones(c, rows_n)
    mn = torch.zeros(c, rows_n)
    err = torch.empty(block_size, c, rows_n)  # [B, C, n] this block's scaled errors
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        for i in range(b1 - b0):
            col = b0 + i
            for job in jobs.get(col, ()):
                cols = wc[col : job.end, job.idx]  # [G, C', n]
                if i:  # the block's errors so far (columns past b1 included: they have not had them)
                    cols -= torch.matmul(hinv[b0:col, col : job.end].t(), err[:i, job.idx].flatten(1)).view_as(cols)
                if job.tables is not None:
                    ci = job.idx[0]
                    scale[ci], mn[ci], _, _ = choose(cols[:, 0].t(), *job.tables, (1 << job.bits) - 1, hdiag[col : job.end])
                    continue
                s, m = group_params(cols.permute(1, 2, 0), job.bits, False, clip_search,
                                    hdiag[col : job.end] if clip_search else None)  # [C', n]
                for j, (ci, codes) in enumerate(zip(job.idx, job.codes, strict=True)):
                    scale[ci], mn[ci] = snap(s[j], m[j], codes) if codes is not None else (s[j], m[j])
            wcol = wc[col]  # [C, n]
            if i:
                wcol = wcol - torch.matmul(hinv[b0:col, col], err[:i].flatten(1)).view_as(wcol)
            q = torch.minimum(torch.clamp(torch.round((wcol - mn) / scale), min=0), maxq[col, :, None])
            dq = q * scale + mn
            deq[col] = dq
            torch.div(wcol - dq, hinv[col, col], out=err[i])
        if b1 < k:
            wc[b1:].view(k - b1, -1).addmm_(hinv[b0:b1, b1:].t(), err[: b1 - b0].view(b1 - b0, -1), alpha=-1)
    return deq


def sweep_groups(candidates: list[Candidate], act_order: bool) -> dict[int, list[int]]:
    """Indices of the candidates by Candidate.sweep_order: one GPTQ sweep serves each group."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(candidates):
        groups.setdefault(c.sweep_order(act_order), []).append(i)
    return dict(sorted(groups.items()))


def candidate_weights(
    w: torch.Tensor,
    hessian: torch.Tensor,
    candidates: list[Candidate],
    *,
    act_order: bool = True,
    damp: float = 0.01,
    block_size: int = 32,
    clip_search: bool = False,
) -> torch.Tensor:
    """The dequantized weight [C, N, K] (original column order) that each candidate makes of
    w [N, K] with H [K, K], all through batched GPTQ sweeps: one for the candidates in column
    order, one for the act-order ones. For a uniform candidate this is gptq_quantize's result;
    for a mix, one sweep with per-column bits (quantize_candidate's per-slice runs differ
    slightly). act_order: whether the conversion allows act-order."""
    if not candidates:
        raise QuantizationError("no candidates to measure")
    n, k = w.shape
    out = torch.empty(len(candidates), n, k)
    for order, idx in sweep_groups(candidates, act_order).items():
        weight, h, perm = _prepare(w, hessian, order > 0, max(order, 1))
        hinv = _inverse_cholesky_upper(h, damp)
        deq = _sweep(weight, h, hinv, [candidates[i] for i in idx], block_size, clip_search).permute(1, 2, 0)  # [c, n, K] stored
        if perm is not None:
            deq = deq[:, :, torch.argsort(perm)]
        out[idx] = deq
    return out


def measure_candidates(
    w: torch.Tensor,
    hessian: torch.Tensor,
    candidates: list[Candidate],
    *,
    act_order: bool = True,
    damp: float = 0.01,
    max_rows: int = 256,
    block_size: int = 32,
    seed: int = 0,
    clip_search: bool = False,
) -> list[float]:
    """Relative output error ||X (W - Wq)^T||^2 / ||X W^T||^2 of every candidate on w [N, K]
    with H [K, K]. GPTQ treats rows independently, so a fixed random sample of `max_rows` rows
    estimates the ratio. For a uniform candidate it reproduces gptq_quantize's loss on the same
    rows."""
    if not candidates:
        raise QuantizationError("no candidates to measure")
    n, k = w.shape
    if n > max_rows:
        rows = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_rows].sort().values
        w = w[rows]
    h_orig = hessian.float()
    signal = float(((w.float() @ h_orig) * w.float()).sum())  # ||X W^T||^2 * 2 on these rows
    if signal <= 0:
        return [0.0] * len(candidates)
    deq = candidate_weights(w, hessian, candidates, act_order=act_order, damp=damp, block_size=block_size, clip_search=clip_search)
    delta = w.float().unsqueeze(0) - deq  # [C, n, K]
    losses = (torch.matmul(delta, h_orig) * delta).sum(dim=(1, 2))
    return [float(x) / signal for x in losses]


def quantize_candidate(
    w: torch.Tensor, hessian: torch.Tensor, cand: Candidate, *, act_order: bool = True, damp: float = 0.01,
    clip_search: bool = False,
) -> tuple[QuantWeight, float]:
    """Quantize w [N, K] with one candidate through gptq_quantize; returns (weight, proxy loss
    as gptq_quantize defines it).

    A multi-slice candidate runs gptq_quantize once per slice, in stored order: slice s sees
    the Schur complement of the later columns' Hessian (the error they can still absorb, which
    is what one GPTQ sweep over all columns accounts for), and after it is quantized the later
    columns take the optimal compensating update W_rest += D_s H_s,rest H_rest,rest^-1."""
    n, k = w.shape
    spec = cand.slices(k)
    act_order = cand.uses_act_order(act_order)
    if len(spec) == 1:
        _, _, bits, gs = spec[0]
        return gptq_quantize(w, hessian, bits, gs, damp=damp, act_order=act_order, clip_search=clip_search,
                             scale_codes=cand.codes, order_block=cand.order_block)
    weight, h, perm = _prepare(w, hessian, act_order, cand.order_block)
    # one absolute damping for every slice, as a single sweep over H + lam * I would apply
    lam = damp * float(torch.diag(h).mean())
    slices: list[QuantSlice] = []
    for k0, k1, bits, gs in spec:
        h_ss = h[k0:k1, k0:k1]
        if k1 < k:
            chol = torch.linalg.cholesky(h[k1:, k1:] + lam * torch.eye(k - k1))
            solved = torch.cholesky_solve(h[k1:, k0:k1], chol)  # [rest, s] = (H_rr + lam)^-1 H_rs
            h_ss = h_ss - h[k0:k1, k1:] @ solved
            h_ss = (h_ss + h_ss.t()) / 2
        slice_damp = lam / max(float(torch.diag(h_ss).mean()), 1e-30)
        qw, _ = gptq_quantize(weight[:, k0:k1], h_ss, bits, gs, damp=slice_damp, clip_search=clip_search,
                              scale_codes=cand.codes)
        s = qw.slices[0]
        slices.append(QuantSlice(k0, k1, bits, gs, s.qweight, s.scales, s.mins, s.codes))
        if k1 < k:
            d = weight[:, k0:k1] - qw.dequantize()  # [N, s]
            weight[:, k1:] += d @ solved.t()
    perm32 = perm.to(torch.int32) if perm is not None else None
    qw = QuantWeight(n, k, slices, perm32)
    delta = w.float() - qw.dequantize()
    loss = 0.5 * float(((delta @ hessian.float()) * delta).sum())
    return qw, loss


# --- the optimiser ------------------------------------------------------------------------------


def allocate(costs: list[list[int]], errors: list[list[float]], budget_bits: float) -> list[int]:
    """Pick one candidate per layer (index into its lists) minimising sum(errors) subject to
    sum(costs) <= budget_bits.

    Greedy marginal gain on each layer's lower convex hull of (cost, error), which is the
    Lagrangian relaxation's solution path, then a fill pass that spends what is left on the
    single upgrade (hull or not) with the largest error reduction until none fits."""
    if len(costs) != len(errors):
        raise ValueError("costs and errors differ in length")
    choice: list[int] = []
    hulls: list[list[int]] = []
    for cost, err in zip(costs, errors, strict=True):
        order = sorted(range(len(cost)), key=lambda i: (cost[i], err[i]))
        front: list[int] = []  # Pareto front: strictly decreasing error with cost
        for i in order:
            if not front or err[i] < err[front[-1]]:
                if front and cost[i] == cost[front[-1]]:
                    front.pop()
                front.append(i)
        hull: list[int] = []
        for i in front:
            while len(hull) >= 2:
                a, b = hull[-2], hull[-1]
                # b lies on or above the segment a -> i: not on the lower convex hull
                if (err[b] - err[a]) * (cost[i] - cost[a]) >= (err[i] - err[a]) * (cost[b] - cost[a]):
                    hull.pop()
                else:
                    break
            hull.append(i)
        hulls.append(hull)
        choice.append(hull[0])
    used = sum(costs[l][choice[l]] for l in range(len(costs)))
    if used > budget_bits:
        raise QuantizationError(f"the budget of {budget_bits:.0f} bits is below the smallest candidate set ({used} bits)")

    def step(layer: int, pos: int) -> tuple[float, int, int, int] | None:
        hull = hulls[layer]
        if pos + 1 >= len(hull):
            return None
        a, b = hull[pos], hull[pos + 1]
        gain = (errors[layer][a] - errors[layer][b]) / (costs[layer][b] - costs[layer][a])
        return (-gain, layer, pos + 1, b)

    heap = [s for l in range(len(costs)) if (s := step(l, 0)) is not None]
    heapq.heapify(heap)
    while heap:
        _, layer, pos, cand = heapq.heappop(heap)
        extra = costs[layer][cand] - costs[layer][choice[layer]]
        if used + extra > budget_bits:
            continue  # this layer's later hull steps cost even more
        used += extra
        choice[layer] = cand
        if (s := step(layer, pos)) is not None:
            heapq.heappush(heap, s)

    while True:  # fill: the best affordable single upgrade anywhere
        best: tuple[float, int, int] | None = None
        for layer, (cost, err) in enumerate(zip(costs, errors, strict=True)):
            cur = choice[layer]
            for i in range(len(cost)):
                if err[i] < err[cur] and used + cost[i] - cost[cur] <= budget_bits:
                    gain = err[cur] - err[i]
                    if best is None or gain > best[0]:
                        best = (gain, layer, i)
        if best is None:
            return choice
        _, layer, i = best
        used += costs[layer][i] - costs[layer][choice[layer]]
        choice[layer] = i
