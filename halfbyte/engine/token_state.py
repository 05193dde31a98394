"""Per-request device rows the penalties and biases read: token counts, prompt mask, additive bias.

A request that needs them (SamplingParams.needs_token_state) gets a slot in a pool of
[slots, vocab] tensors the first time it samples: its prompt is scattered in once, then each
step adds only the tokens appended since (and subtracts those leaving a penalty window), all
batch rows in one index_add_. Host work per step is O(new tokens), never O(vocab) or O(context).
Slot 0 stays zero: rows without state read it. A slot returns to the pool when its sequence is
garbage-collected, so the scheduler only has to hand the sampler its batch's sequences."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from halfbyte.sampling_params import SamplingParams


class SampledSequence(Protocol):
    """What the sampler reads of a sequence (halfbyte/engine/sequence.py's Sequence has it)."""

    params: SamplingParams
    token_ids: list[int]
    prompt_token_ids: list[int]


@dataclass
class _RowState:
    slot: int
    num_seen: int  # tokens of seq.token_ids already counted


class TokenStatePool:
    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab = vocab_size
        self.device = device
        self._alloc(initial_slots)
        self._free = list(range(initial_slots - 1, 0, -1))
        self._released: list[int] = []
        self._rows: weakref.WeakKeyDictionary[Any, _RowState] = weakref.WeakKeyDictionary()
        self._last_slots: tuple[list[int], torch.Tensor] | None = None  # the last batch's slot tensor

    def _alloc(self, slots: int) -> None:
        v, dev = self.vocab, self.device
        self.counts = torch.zeros(slots, v, dtype=torch.int32, device=dev)  # [S, V] tokens in the window
        self.prompt_seen = torch.zeros(slots, v, dtype=torch.int8, device=dev)  # [S, V] in the prompt
        self.additive = torch.zeros(slots, v, dtype=torch.float32, device=dev)  # [S, V] bias, -inf bans

    def _grow(self) -> None:
        old = self.counts.shape[0]
        counts, seen, additive = self.counts, self.prompt_seen, self.additive
        self._alloc(2 * old)
        self.counts[:old], self.prompt_seen[:old], self.additive[:old] = counts, seen, additive
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _release(self, slot: int) -> None:
        # a GC finalizer may run on any thread: only note the slot, the sampling thread clears it
        self._released.append(slot)

    def _reclaim(self) -> None:
        while self._released:
            slot = self._released.pop()
            self.counts[slot].zero_()
            self.prompt_seen[slot].zero_()
            self.additive[slot].zero_()
            self._free.append(slot)

    def _to_device(self, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        """A non-blocking copy: a blocking one would wait for the step in flight."""
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _admit(self, seq: SampledSequence) -> _RowState:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        p = seq.params
        window = p.penalty_window
        prompt = seq.prompt_token_ids
        if window is None:  # vLLM: repetition sees prompt + output; frequency / presence the output
            self.prompt_seen[slot, self._to_device(prompt, torch.int64)] = 1
            counted_from = len(prompt)
        else:  # the window spans prompt and output alike
            counted_from = max(0, len(seq.token_ids) - window)
        known = _known_length(seq.token_ids)  # a trailing placeholder is counted by slots_for
        tail = self._to_device(seq.token_ids[counted_from:known], torch.int64)
        self.counts[slot].index_add_(0, tail, torch.ones_like(tail, dtype=torch.int32))
        additive = self.additive[slot]
        if p.allowed_token_ids is not None:
            additive.fill_(float("-inf"))
            additive[self._to_device(p.allowed_token_ids, torch.int64)] = 0.0
        if p.logit_bias:
            ids = self._to_device(list(p.logit_bias), torch.int64)
            additive[ids] += self._to_device(list(p.logit_bias.values()), torch.float32)
        if p.bad_token_ids:
            additive[self._to_device(p.bad_token_ids, torch.int64)] = float("-inf")
        state = _RowState(slot, known)
        self._rows[seq] = state
        weakref.finalize(seq, self._release, slot)
        return state

    def slots_for(self, seqs: Sequence[SampledSequence], previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """[B] int32 slot per row (0 where none), after counting each row's new tokens. A token
        still in flight is a placeholder naming a row of previous_tokens (engine/launched_step.py):
        it is counted on the device."""
        self._reclaim()
        slots: list[int] = []
        flat: list[int] = []  # slot * vocab + token
        delta: list[int] = []
        pending_base: list[int] = []  # slot * vocab of each placeholder ...
        pending_row: list[int] = []  # ... and the previous_tokens row it names
        for seq in seqs:
            if not seq.params.needs_token_state:
                slots.append(0)
                continue
            state = self._rows.get(seq)
            if state is None:
                state = self._admit(seq)
            tokens = seq.token_ids
            window = seq.params.penalty_window
            base = state.slot * self.vocab
            for i in range(state.num_seen, len(tokens)):  # usually one token per step
                if tokens[i] < 0:  # in flight; a window's leaving token is always known
                    pending_base.append(base)
                    pending_row.append(-1 - tokens[i])
                else:
                    flat.append(base + tokens[i])
                    delta.append(1)
                if window is not None and i - window >= 0:
                    flat.append(base + tokens[i - window])
                    delta.append(-1)
            state.num_seen = len(tokens)
            slots.append(state.slot)
        if flat:
            self.counts.view(-1).index_add_(
                0, self._to_device(flat, torch.int64), self._to_device(delta, torch.int32),
            )
        if pending_base:
            assert previous_tokens is not None, "a placeholder token without the step it names"
            rows, bases = self._to_device(pending_row, torch.int64), self._to_device(pending_base, torch.int64)
            self.counts.view(-1).index_add_(0, bases + previous_tokens[rows], torch.ones_like(bases, dtype=torch.int32))
        last = self._last_slots
        if last is not None and last[0] == slots:  # the same batch as last step: no copy
            return last[1]
        out = self._to_device(slots, torch.int32)
        self._last_slots = (slots, out)
        return out


def _known_length(tokens: list[int]) -> int:
    """How many tokens are known: placeholders (negative, still in flight) only ever trail."""
    n = len(tokens)
    while n and tokens[n - 1] < 0:
        n -= 1
    return n
