"""One fused kernel for the candidates-only sampling path (every sampling row has a top_k).

Input: the [B, K] top-k candidates of the scaled logits (torch.topk, descending) and their
token ids. One program per row keeps everything in registers and does, in the reference's
order (engine/sampling_filters.filter_candidates): top-k mask -> top-p (mass before a
candidate in rank order, renormalised over top-k's survivors) -> typical (entropy of the
survivors, rank by |-log p - H|) -> min-p (threshold on the logits) -> the exponential race
with the hash noise of kernels/sampling.py (same token ids, same noise, same draw).
Ranked masses come from a [K, K] pairwise sum instead of a sort or a scan: K is small
(<= MAX_CANDIDATES), so the whole tail of the sampler is one launch instead of ~30 small ops.
It writes the filtered candidate logits too (dropped at -inf) so tests can compare masks."""

from __future__ import annotations

import torch

from halfbyte.kernels.triton_utils import HAS_TRITON, next_power_of_2, tl, triton

MAX_CANDIDATES = 256  # the [K, K] pairwise masses stay in registers up to here

if HAS_TRITON:

    @triton.jit
    def _fmix32_c(h):
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _candidates_kernel(
        vals_ptr, ids_ptr, top_k_ptr, floats_ptr, floats_stride, keys_ptr, pos_ptr, greedy_ptr, typ_ptr,
        out_tok_ptr, out_vals_ptr, K,
        USE_TOP_P: tl.constexpr, USE_TYPICAL: tl.constexpr, USE_MIN_P: tl.constexpr, HAS_POS: tl.constexpr,
        KP: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        pos = tl.arange(0, KP)
        inb = pos < K
        x = tl.load(vals_ptr + row * K + pos, mask=inb, other=float("-inf")).to(tl.float32)
        top_k = tl.load(top_k_ptr + row)
        x = tl.where(pos.to(tl.int64) < top_k, x, float("-inf"))
        ii = pos[:, None]  # ranked "before" token i
        jj = pos[None, :]  # token j
        if USE_TOP_P:
            top_p = tl.load(floats_ptr + row * floats_stride + 4)
            m = tl.max(x, axis=0)
            e = tl.exp(x - m)
            p = e / tl.sum(e, axis=0)
            before = tl.sum(tl.where(ii < jj, p[:, None], 0.0), axis=0)  # mass ranked above j
            x = tl.where((before < top_p) | (pos == 0), x, float("-inf"))
        if USE_TYPICAL:
            if tl.load(typ_ptr + row) != 0:
                typical_p = tl.load(floats_ptr + row * floats_stride + 5)
                m = tl.max(x, axis=0)
                logp = x - m - tl.log(tl.sum(tl.exp(x - m), axis=0))
                p = tl.exp(logp)
                ent = -tl.sum(tl.where(p == 0, 0.0, p * logp), axis=0)
                gap = tl.where(p == 0, float("inf"), tl.abs(-logp - ent))
                gi = gap[:, None]
                gj = gap[None, :]
                ahead = (gi < gj) | ((gi == gj) & (ii < jj))  # a stable rank by gap
                before = tl.sum(tl.where(ahead, p[:, None], 0.0), axis=0)
                first = tl.sum(ahead.to(tl.int32), axis=0) == 0
                x = tl.where((before < typical_p) | first, x, float("-inf"))
        if USE_MIN_P:
            min_p = tl.load(floats_ptr + row * floats_stride + 6)
            x = tl.where(x < tl.max(x, axis=0) + tl.log(min_p), float("-inf"), x)
        tl.store(out_vals_ptr + row * K + pos, x, mask=inb)
        tok = tl.load(ids_ptr + row * K + pos, mask=inb, other=0).to(tl.int64)
        key = tl.load(keys_ptr + row)
        if HAS_POS:  # key = seed key: finish kernels/sampling.row_key with the row's position
            p32 = (tl.load(pos_ptr + row) & 0xFFFFFFFF) ^ 0x27D4EB2F
            key = _fmix32_c(key ^ _fmix32_c(p32))
        h = _fmix32_c(tok ^ key)
        h = _fmix32_c((h + key) & 0xFFFFFFFF)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        noisy = tl.load(greedy_ptr + row) == 0
        score = tl.where(noisy, x - tl.log(-tl.log(u)), x)
        score = tl.where(inb, score, float("-inf"))
        best = tl.argmax(score, axis=0)  # the first maximum, as torch.argmax
        tl.store(out_tok_ptr + row, tl.load(ids_ptr + row * K + best).to(tl.int64))


def sample_candidates_triton(
    vals: torch.Tensor,  # [B, K] fp32 top-k candidates, descending
    ids: torch.Tensor,  # [B, K] int64 their token ids
    top_k: torch.Tensor,  # [B] int64
    floats: torch.Tensor,  # [B, >= 7] fp32 row parameters (sampler's layout: top_p 4, typical 5, min_p 6)
    keys: torch.Tensor,  # [B] int64 noise keys, or seed keys (kernels/sampling.seed_key) with positions
    greedy: torch.Tensor,  # [B] bool / int
    typical_rows: torch.Tensor | None,  # [B] bool/int: rows with typical_p < 1; None = none
    use_top_p: bool,
    use_min_p: bool,
    positions: torch.Tensor | None = None,  # [B] int64: keys are seed keys, the kernel finishes row_key
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [B] int64, filtered candidate logits [B, K] fp32)."""
    rows, k = vals.shape
    assert k <= MAX_CANDIDATES
    vals = vals.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    floats = floats.float()
    if floats.stride(1) != 1:
        floats = floats.contiguous()
    out_tok = torch.empty(rows, dtype=torch.int64, device=vals.device)
    out_vals = torch.empty_like(vals)
    typ = typical_rows if typical_rows is not None else greedy
    kp = max(16, next_power_of_2(k))
    _candidates_kernel[(rows,)](
        vals, ids, top_k.to(torch.int64).contiguous(), floats, floats.stride(0), keys.to(torch.int64).contiguous(),
        positions.to(torch.int64).contiguous() if positions is not None else keys,
        greedy.to(torch.int32).contiguous(), typ.to(torch.int32).contiguous(), out_tok, out_vals, k,
        USE_TOP_P=use_top_p, USE_TYPICAL=typical_rows is not None, USE_MIN_P=use_min_p, HAS_POS=positions is not None, KP=kp,
        num_warps=4 if kp <= 64 else 8,
    )
    return out_tok, out_vals
