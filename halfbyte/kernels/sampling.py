"""Sampling kernels: penalties + bias + temperature in one pass, and the exponential race.

penalize: x = logits (fp32); tokens seen (prompt mask or count > 0) get the repetition
penalty (x / r where x > 0, x * r otherwise); x -= frequency * count + presence * (count > 0);
x += additive (logit bias, -inf for banned tokens); x *= 1 / temperature. Per-request rows of
counts / prompt mask / additive live in a slot pool; row b reads slot slots[b] (slot 0 is all
zeros: a request without such state).

race: token = argmax_v (x_v - log E_v), E_v = -log U_v ~ Exp(1). In the probability domain
that is argmax p_v / E_v, the exponential race: an exact draw from softmax(x), no cumulative sum.
U_v is a hash of (row key, v), so a request's noise depends only on its own key (seed and
position), never on the batch it is in or the other rows' vocab filters. Greedy rows take argmax x."""

from __future__ import annotations

import torch

from halfbyte.kernels.dispatch import use_triton
from halfbyte.kernels.triton_utils import HAS_TRITON, next_power_of_2, tl, triton

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


_POSITION_SALT = 0x27D4EB2F


def seed_key(seed: int) -> int:
    """The 32-bit part of a row's noise key that depends on its seed only (cached per request)."""
    return _fmix32_int(_fmix32_int(((seed >> 32) + _GOLDEN) & _MASK32) ^ (seed & _MASK32))


def row_key(seed: int, position: int) -> int:
    """The 32-bit noise key of a row from its seed and the position it samples (plain ints: the
    host's per-row cost stays a few microseconds)."""
    return _fmix32_int(seed_key(seed) ^ _fmix32_int((position & _MASK32) ^ _POSITION_SALT))


def position_keys(seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """row_key on device tensors: [B] int64 seed keys and positions -> [B] int64 noise keys."""
    return _fmix32(seed_keys ^ _fmix32((positions & _MASK32) ^ _POSITION_SALT))


def row_keys(seeds: list[int], positions: list[int]) -> list[int]:
    return [row_key(s, p) for s, p in zip(seeds, positions, strict=True)]


def uniform_noise_ref(keys: torch.Tensor, vocab: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """U [B, V] in [2^-24, 1 - 2^-24], a pure function of (key, token id). 23 bits: with 24,
    (2^24 - 0.5) rounds to 2^24 in fp32, U = 1, E = 0 and a -inf logit would score NaN."""
    if token_ids is None:
        token_ids = torch.arange(vocab, dtype=torch.int64, device=keys.device).unsqueeze(0)
    h = _fmix32(token_ids.long() ^ keys.unsqueeze(1))  # [B, V]
    h = _fmix32((h + keys.unsqueeze(1)) & _MASK32)
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def race_ref(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, V] fp32 (filtered tokens at -inf), keys [B] int64, greedy [B] bool -> tokens [B] int64.
    With token_ids [B, K], x holds only those candidates: the noise is hashed from their ids, so
    the draw equals the full-vocabulary one with every other token at -inf."""
    pos = x.argmax(dim=1)
    drawn = (~greedy).nonzero().squeeze(1)  # noise only where it is used: [B, V] hashes are costly
    if drawn.numel():
        xd = x[drawn]
        ids = None if token_ids is None else token_ids[drawn]
        alive = xd > float("-inf")
        if int(alive.sum()) * 4 < alive.numel():
            # mostly filtered (top-k / top-p / min-p): hash only the live tokens; the others
            # stay at -inf, so the draw is the same
            r, c = alive.nonzero(as_tuple=True)
            u = uniform_noise_ref(keys[drawn][r], 1, (c if ids is None else ids[r, c]).unsqueeze(1)).squeeze(1)
            scored = torch.full_like(xd, float("-inf"))
            scored[r, c] = xd[r, c] - torch.log(-torch.log(u))
        else:
            scored = xd - torch.log(-torch.log(uniform_noise_ref(keys[drawn], x.shape[1], ids)))
        pos[drawn] = scored.argmax(dim=1)
    return pos if token_ids is None else token_ids.long().gather(1, pos.unsqueeze(1)).squeeze(1)


def penalize_ref(
    logits: torch.Tensor,  # [B, V]
    slots: torch.Tensor,  # [B] int32
    counts: torch.Tensor,  # [S, V] int32
    prompt_seen: torch.Tensor,  # [S, V] int8
    additive: torch.Tensor,  # [S, V] fp32
    row_params: torch.Tensor,  # [B, 4] fp32: repetition, frequency, presence, 1 / temperature
) -> torch.Tensor:
    x = logits.float()
    idx = slots.long()
    c = counts[idx].float()
    seen = (prompt_seen[idx] != 0) | (c > 0)
    rep, freq, pres, inv_temp = (row_params[:, i : i + 1] for i in range(4))
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * c - pres * (c > 0).float()
    x = x + additive[idx]
    return x * inv_temp


if HAS_TRITON:

    @triton.jit
    def _fmix32_tl(h):
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _penalize_kernel(
        logits_ptr, slots_ptr, counts_ptr, seen_ptr, add_ptr, params_ptr, out_ptr,
        vocab, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab
        slot = tl.load(slots_ptr + row).to(tl.int64)
        rep = tl.load(params_ptr + row * 4)
        freq = tl.load(params_ptr + row * 4 + 1)
        pres = tl.load(params_ptr + row * 4 + 2)
        inv_temp = tl.load(params_ptr + row * 4 + 3)
        x = tl.load(logits_ptr + row * vocab + cols, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(counts_ptr + slot * vocab + cols, mask=mask, other=0).to(tl.float32)
        seen = (tl.load(seen_ptr + slot * vocab + cols, mask=mask, other=0) != 0) | (c > 0)
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
        x = x - freq * c - pres * (c > 0).to(tl.float32)
        x = x + tl.load(add_ptr + slot * vocab + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * vocab + cols, x * inv_temp, mask=mask)

    @triton.jit
    def _race_kernel(x_ptr, keys_ptr, greedy_ptr, ids_ptr, out_ptr, vocab, HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row, streaming the vocabulary: running (best score, its token)
        row = tl.program_id(0).to(tl.int64)
        key = tl.load(keys_ptr + row)
        noisy = tl.load(greedy_ptr + row) == 0
        best = tl.full([], float("-inf"), tl.float32)
        best_tok = tl.full([], 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            x = tl.load(x_ptr + row * vocab + cols, mask=mask, other=float("-inf"))
            if HAS_IDS:
                tok = tl.load(ids_ptr + row * vocab + cols, mask=mask, other=0).to(tl.int64)
            else:
                tok = cols.to(tl.int64)
            h = _fmix32_tl(tok ^ key)
            h = _fmix32_tl((h + key) & 0xFFFFFFFF)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            score = tl.where(noisy, x - tl.log(-tl.log(u)), x)
            score = tl.where(mask, score, float("-inf"))
            block_best = tl.max(score, axis=0)
            block_tok = tl.argmax(score, axis=0).to(tl.int64) + start  # a position; ids mapped at the end
            better = block_best > best  # strict: the first maximum wins, as torch.argmax
            best_tok = tl.where(better, block_tok, best_tok)
            best = tl.where(better, block_best, best)
        if HAS_IDS:
            best_tok = tl.load(ids_ptr + row * vocab + best_tok).to(tl.int64)
        tl.store(out_ptr + row, best_tok)


def penalize_triton(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
                    additive: torch.Tensor, row_params: torch.Tensor) -> torch.Tensor:
    logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    block = 1024
    _penalize_kernel[(rows, triton.cdiv(vocab, block))](
        logits, slots.to(torch.int32).contiguous(), counts, prompt_seen, additive, row_params.float().contiguous(),
        out, vocab, BLOCK=block, num_warps=4,
    )
    return out


def race_triton(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    x = x.float().contiguous()
    ids = token_ids.to(torch.int64).contiguous() if token_ids is not None else keys
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    block = min(4096, next_power_of_2(vocab))
    _race_kernel[(rows,)](x, keys.to(torch.int64).contiguous(), greedy.to(torch.int32).contiguous(), ids, out, vocab,
                          HAS_IDS=token_ids is not None, BLOCK=block, num_warps=8 if block >= 1024 else 4)
    return out


def penalize(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
             additive: torch.Tensor, row_params: torch.Tensor) -> torch.Tensor:
    if use_triton(logits):
        return penalize_triton(logits, slots, counts, prompt_seen, additive, row_params)
    return penalize_ref(logits, slots, counts, prompt_seen, additive, row_params)


def race(x: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        return race_triton(x, keys, greedy, token_ids)
    return race_ref(x, keys, greedy, token_ids)
