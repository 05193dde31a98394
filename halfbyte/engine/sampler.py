"""Batched token sampling on device tensors, one set of parameters per row.

Order per row: logits processors (host callables, only rows that have them) -> one fused pass
of penalties, bias / allowed / banned ids and temperature (kernels/sampling.py) -> min_tokens
suppression -> top-k / top-p / typical / min-p (engine/sampling_filters.py) -> the exponential
race draw. The race's noise is a hash of (request seed, position, token id), so a seeded
request samples the same tokens alone or in any batch. Host work is O(batch) per step; the
one host sync is reading the tokens back (plus one when a top-p row needs the sort fallback).

When every sampling row has a top_k <= 256 (on CUDA), the filters and the draw are one Triton
kernel on the [B, K] topk candidates (kernels/sampling_candidates.py): the same tokens as the
torch path, which stays the definition (tests/test_sampling_candidates.py). The static row
tensors are cached while the batch is the same sequences in the same order: a step sends its
positions, and the noise keys are finished on the device."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from halfbyte.engine.sampling_filters import FilterParams, apply_filters, filter_candidates
from halfbyte.engine.token_state import SampledSequence, TokenStatePool
from halfbyte.kernels.dispatch import use_triton
from halfbyte.kernels.sampling import penalize, position_keys, race, seed_key
from halfbyte.sampling_params import SamplingParams

Logprobs = dict[int, float]  # token id -> logprob: the top-N and the sampled token


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # per row; None where the request did not ask


@dataclass
class _RowTensors:
    floats: torch.Tensor  # [B, 7] fp32: repetition, frequency, presence, 1/temperature, top_p, typical_p, min_p
    ints: torch.Tensor  # [B, 3] int64: seed key (kernels/sampling.seed_key), top_k (vocab where off), greedy
    host_floats: list[list[float]]
    host_ints: list[list[int]]
    positions: torch.Tensor | None = None  # [B] int64 this step's positions (the noise key's other half)

    def keys(self) -> torch.Tensor:
        """[B] int64 noise keys: row_key(seed, position) computed on the device."""
        assert self.positions is not None
        return position_keys(self.ints[:, 0], self.positions)


@dataclass
class _BatchCache:
    """The last batch's static row tensors: reused while the same sequences sample in the same
    order (the steady state of decoding), so a step only sends its positions."""

    refs: list[weakref.ref[Any]]
    vocab: int
    device: torch.device
    rows: _RowTensors
    filters: FilterParams | None

    def matches(self, seqs: Sequence[SampledSequence], vocab: int, dev: torch.device) -> bool:
        return (len(seqs) == len(self.refs) and vocab == self.vocab and dev == self.device
                and all(r() is s for r, s in zip(self.refs, seqs, strict=True)))


class Sampler:
    def __init__(self, eos_token_ids: set[int] | None = None, fused: bool | None = None) -> None:
        """fused: the one-kernel candidates path (kernels/sampling_candidates.py) when every row has
        a top_k <= MAX_CANDIDATES; None = on CUDA tensors (HALFBYTE_REFERENCE=1 turns it off),
        True forces it (the Triton interpreter on the CPU), False keeps the torch reference."""
        self.fused = fused
        self.eos_token_ids: set[int] = set(eos_token_ids or ())  # min_tokens suppresses these
        self._state: TokenStatePool | None = None
        self._seeds: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._batch: _BatchCache | None = None

    def _seed(self, seq: SampledSequence) -> int:
        if seq.params.seed is not None:
            return seq.params.seed
        seed = self._seeds.get(seq)
        if seed is None:  # drawn once from torch's global RNG: torch.manual_seed reproduces runs
            seed = self._seeds[seq] = int(torch.randint(0, 2**62, (1,)).item())
        return seed

    def _token_state(self, vocab: int, device: torch.device) -> TokenStatePool:
        if self._state is None or self._state.vocab != vocab or self._state.device != device:
            self._state = TokenStatePool(vocab, device)
        return self._state

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: Sequence[SampledSequence]) -> SamplerOutput:
        """logits [B, V] (any float dtype) for the batch's sampling sequences, in order."""
        params = [s.params for s in seqs]
        tokens = self.sample_async(logits, seqs)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self.logprobs(logits, tokens, token_list, params))

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, seqs: Sequence[SampledSequence],
                     previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens [B] int64 on the device, not read back (no host sync on the fused path).
        previous_tokens: the in-flight step's tokens, which placeholders in seqs name."""
        x, f, rows = self._scaled_logits(logits, seqs, previous_tokens)
        if f is not None and f.candidates_only and self._use_fused(x, f):
            return self._sample_fused(x, f, rows)
        keys, greedy = rows.keys(), rows.ints[:, 2] != 0
        if f is not None and f.candidates_only:  # the draw sees only [B, K] candidates
            vals, ids = filter_candidates(x, f)
            return race(vals, keys, greedy, ids)  # [B] int64
        return race(apply_filters(x, f) if f is not None else x, keys, greedy)  # [B] int64

    def _use_fused(self, x: torch.Tensor, f: FilterParams) -> bool:
        from halfbyte.kernels.sampling_candidates import MAX_CANDIDATES
        from halfbyte.kernels.triton_utils import HAS_TRITON

        if not HAS_TRITON or f.max_top_k > MAX_CANDIDATES:
            return False
        return use_triton(x) if self.fused is None else self.fused

    @staticmethod
    def _sample_fused(x: torch.Tensor, f: FilterParams, rows: _RowTensors) -> torch.Tensor:
        """topk + one kernel: the same tokens as filter_candidates + race (tests/test_sampling_candidates.py)."""
        from halfbyte.kernels.sampling_candidates import sample_candidates_triton

        vals, ids = x.topk(f.max_top_k, dim=1)  # [B, K] descending
        typical = rows.floats[:, 5] < 1.0 if f.typical_rows is not None else None
        tokens, _ = sample_candidates_triton(vals, ids, f.top_k, rows.floats, rows.ints[:, 0], rows.ints[:, 2],
                                             typical, f.use_top_p, f.use_min_p, positions=rows.positions)
        return tokens

    @torch.inference_mode()
    def filtered_logits(self, logits: torch.Tensor, seqs: Sequence[SampledSequence]) -> torch.Tensor:
        """[B, V] fp32: processed, penalised, scaled and filtered (dropped tokens at -inf);
        softmax of a row is the distribution that row samples from (greedy rows: its argmax)."""
        x, f, _ = self._scaled_logits(logits, seqs)
        if f is None:
            return x
        if not f.candidates_only:
            return apply_filters(x, f)
        vals, ids = filter_candidates(x, f)
        return torch.full_like(x, float("-inf")).scatter_(1, ids, vals)

    def _rows_and_filters(self, seqs: Sequence[SampledSequence], vocab: int,
                          dev: torch.device) -> tuple[_RowTensors, FilterParams | None]:
        """Static row tensors and filter parameters (cached while the batch is the same sequences
        in the same order), plus this step's positions: one small host-to-device copy per step."""
        b = self._batch
        if b is None or not b.matches(seqs, vocab, dev):
            rows = self._row_tensors(seqs, vocab, dev)
            b = self._batch = _BatchCache([weakref.ref(s) for s in seqs], vocab, dev, rows, self._filter_params(rows, vocab))
        positions = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.int64).to(dev, non_blocking=True)
        r = b.rows
        return _RowTensors(r.floats, r.ints, r.host_floats, r.host_ints, positions), b.filters

    def _row_tensors(self, seqs: Sequence[SampledSequence], vocab: int, dev: torch.device) -> _RowTensors:
        """Every static per-row parameter in two host-to-device copies. Greedy rows take the
        argmax whatever their filters say: their filters are off here."""
        floats: list[list[float]] = []
        ints: list[list[int]] = []
        for s in seqs:
            p = s.params
            g = p.greedy
            floats.append([p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                           1.0 if g else 1.0 / p.temperature, 1.0 if g else p.top_p,
                           1.0 if g else p.typical_p, 0.0 if g else p.min_p])
            ints.append([seed_key(self._seed(s)), p.top_k if 0 < p.top_k < vocab and not g else vocab, g])
        # non-blocking: a blocking copy would wait for the step in flight (engine/launched_step.py)
        return _RowTensors(torch.tensor(floats, dtype=torch.float32).reshape(-1, 7).to(dev, non_blocking=True),
                           torch.tensor(ints, dtype=torch.int64).reshape(-1, 3).to(dev, non_blocking=True), floats, ints)

    def _scaled_logits(
        self, logits: torch.Tensor, seqs: Sequence[SampledSequence], previous_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, FilterParams | None, _RowTensors]:
        vocab = logits.shape[1]
        dev = logits.device
        params = [s.params for s in seqs]
        if any(p.logits_processors for p in params):
            logits = logits.float().clone()
            for i, (seq, p) in enumerate(zip(seqs, params, strict=True)):
                for proc in p.logits_processors:
                    logits[i] = proc(list(seq.token_ids[len(seq.prompt_token_ids):]), logits[i])
        rows, filters = self._rows_and_filters(seqs, vocab, dev)
        if any(p.needs_token_state for p in params):
            pool = self._token_state(vocab, dev)
            slots = pool.slots_for(seqs, previous_tokens)
            x = penalize(logits, slots, pool.counts, pool.prompt_seen, pool.additive, rows.floats[:, :4])
        else:
            x = logits.float() * rows.floats[:, 3:4]  # [B, V] fp32; a copy, never the model's buffer
        self._suppress_stops(x, seqs)
        return x, filters, rows

    def _suppress_stops(self, x: torch.Tensor, seqs: Sequence[SampledSequence]) -> None:
        flat: list[int] = []
        vocab = x.shape[1]
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.min_tokens and len(seq.token_ids) - len(seq.prompt_token_ids) < p.min_tokens:
                flat.extend(i * vocab + t for t in self.eos_token_ids | set(p.stop_token_ids) if t < vocab)
        if flat:
            x.view(-1).index_fill_(0, torch.tensor(flat, dtype=torch.int64).to(x.device, non_blocking=True), float("-inf"))

    @staticmethod
    def _filter_params(rows: _RowTensors, vocab: int) -> FilterParams | None:
        top_k = [r[1] for r in rows.host_ints]
        max_top_k = max((k for k in top_k if k < vocab), default=0)
        use_top_p = any(r[4] < 1.0 for r in rows.host_floats)
        typical_rows = [i for i, r in enumerate(rows.host_floats) if r[5] < 1.0]
        use_min_p = any(r[6] > 0.0 for r in rows.host_floats)
        if not (max_top_k or use_top_p or typical_rows or use_min_p):
            return None
        dev = rows.floats.device
        return FilterParams(
            top_k=rows.ints[:, 1], top_p=rows.floats[:, 4], typical_p=rows.floats[:, 5], min_p=rows.floats[:, 6],
            max_top_k=max_top_k, use_top_p=use_top_p,
            typical_rows=torch.tensor(typical_rows, dtype=torch.int64).to(dev, non_blocking=True) if typical_rows else None,
            use_min_p=use_min_p,
            candidates_only=max_top_k > 0 and all(k < vocab or r[2] for k, r in zip(top_k, rows.host_ints, strict=True)),
        )

    @staticmethod
    def logprobs_async(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> PendingLogprobs | None:
        """The model's own distribution (before penalties and filters), fp32, for the rows that
        ask: computed on the device, read later (PendingLogprobs.entries)."""
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not want:
            return None
        idx = torch.tensor(want, dtype=torch.int64).to(raw.device, non_blocking=True)
        logp = raw[idx].float().log_softmax(dim=1)  # [R, V]
        top_n = max(params[i].logprobs or 0 for i in want)
        sampled = logp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1)  # [R]
        top_vals, top_ids = logp.topk(max(top_n, 1), dim=1)  # [R, N]
        return PendingLogprobs(want, [params[i].logprobs or 0 for i in want], sampled, top_vals, top_ids)

    @staticmethod
    def logprobs(raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int], params: list[SamplingParams]) -> list[Logprobs | None]:
        pending = Sampler.logprobs_async(raw, tokens, params)
        return pending.entries(token_list) if pending is not None else [None] * len(params)


@dataclass
class PendingLogprobs:
    """Logprob tensors of the rows that asked (device, or host copies of them)."""

    rows: list[int]  # the batch rows that asked
    top_n: list[int]  # how many top entries each asked for
    sampled: torch.Tensor  # [R] the sampled token's logprob
    top_vals: torch.Tensor  # [R, N]
    top_ids: torch.Tensor  # [R, N]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sampled, self.top_vals, self.top_ids

    def entries(self, token_list: list[int]) -> list[Logprobs | None]:
        """Per batch row (None where not asked): top-N token ids -> logprob, plus the sampled token."""
        out: list[Logprobs | None] = [None] * len(token_list)
        sampled, vals, ids = self.sampled.tolist(), self.top_vals.tolist(), self.top_ids.tolist()
        for r, (i, n) in enumerate(zip(self.rows, self.top_n, strict=True)):
            entry = {int(t): float(v) for t, v in zip(ids[r][:n], vals[r][:n], strict=True)}
            entry[token_list[i]] = sampled[r]
            out[i] = entry
        return out
