"""The measurement pass for one decoder layer: what each candidate setting of each matrix does
to the residual stream.

EXL2-style: every candidate of a matrix is quantized (GPTQ against the matrix's Hessian from all
calibration tokens) and the layer's block (attention: qkv + o_proj; MLP: gate_up + down_proj)
is run again on a subsample of the calibration tokens with that one matrix replaced. The error
of a candidate is the block's output error relative to the residual stream it is added to,
per token, averaged over tokens:

    err = mean_t ||block_q(x_t) - block(x_t)||^2 / ||r_t||^2

with r_t the residual stream entering the block. This is the noise-to-signal ratio the
candidate injects into the stream; the next RMSNorm divides by the stream's norm, so this is
what the rest of the model sees. Per-token normalisation keeps the few "attention sink" tokens,
whose residual norms are ~100x the rest, from dominating (a mean of powers would), and going
through the block's nonlinearity (softmax, SiLU x up) measures how much a q/k or gate error
actually reaches the output instead of assuming it does in proportion.

Errors of different matrices are assumed to add, which is what the allocator minimises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfbyte.kernels.rms_norm import rms_norm
from halfbyte.model.config import ModelConfig
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.quant.layer_forward import UNITS, LayerWeights, attention_core, mlp_act, run_layer
from halfbyte.quant.measure import Candidate, candidate_weights, sweep_groups

# candidates quantized together in one GPTQ sweep: as many as keep each [C, N, K] sweep tensor
# under this many elements (1 GiB in fp32), so memory is bounded by the matrix, not by a fixed
# candidate count (a 70B gate_up matrix takes one at a time, SmolLM2's take all of one order)
_SWEEP_ELEMENTS = 2**28


def sweep_chunks(candidates: list[Candidate], n: int, k: int, act_order: bool) -> list[list[int]]:
    """Indices of candidates grouped by column order (measure.sweep_groups) and cut into chunks
    that fit _SWEEP_ELEMENTS."""
    per_chunk = max(1, _SWEEP_ELEMENTS // (n * k))
    chunks: list[list[int]] = []
    for idx in sweep_groups(candidates, act_order).values():
        chunks += [idx[i : i + per_chunk] for i in range(0, len(idx), per_chunk)]
    return chunks


def subsample(lengths: list[int], max_tokens: int) -> tuple[int, list[int]]:
    """(rows, lengths) of the leading whole calibration sequences with at most max_tokens tokens
    (at least one sequence)."""
    rows = 0
    out: list[int] = []
    for n in lengths:
        if out and rows + n > max_tokens:
            break
        out.append(n)
        rows += n
    return rows, out


def _relative(err: torch.Tensor, inv_power: torch.Tensor) -> float:
    """mean_t ||err_t||^2 / ||r_t||^2 for err [T, hidden], inv_power [T] = 1 / ||r_t||^2."""
    return float((err.square().sum(1) * inv_power).mean())


def measure_layer(
    cfg: ModelConfig,
    lw: LayerWeights,
    stream: torch.Tensor,  # [T, hidden] residual stream entering the layer (float model)
    lengths: list[int],
    rotary: RotaryEmbedding,
    candidates: list[Candidate],
    *,
    act_order: bool,
    damp: float,
    max_tokens: int = 1024,
    clip_search: bool = False,
) -> tuple[dict[str, list[float]], torch.Tensor]:
    """Per unit, the error (module docstring) of every candidate; and the stream after the float
    layer. act_order: whether the conversion allows act-order candidates to use it."""
    hessians: dict[str, torch.Tensor] = {}

    def keep(unit: str, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        hessians[unit] = h
        return w

    after = run_layer(cfg, lw, stream, lengths, rotary, keep)

    rows, sub_lengths = subsample(lengths, max_tokens)
    eps = cfg.rms_norm_eps
    w_qkv, w_o, w_gu, w_d = (lw.matrices[u] for u in UNITS)
    with torch.no_grad():
        r1 = stream[:rows]  # [t, hidden]
        x1 = rms_norm(r1, lw.input_norm.float(), eps)
        o_in = attention_core(cfg, lw, x1, sub_lengths, rotary, w_qkv)  # [t, q_size]
        b_o = lw.biases[UNITS[1]]
        r2 = r1 + F.linear(o_in, w_o, b_o.float() if b_o is not None else None)  # [t, hidden]
        x2 = rms_norm(r2, lw.post_norm.float(), eps)
        act = mlp_act(lw, x2, w_gu)  # [t, intermediate]
        inv1 = 1.0 / r1.square().sum(1).clamp_min(1e-30)
        inv2 = 1.0 / r2.square().sum(1).clamp_min(1e-30)

        def error(unit: str, wq: torch.Tensor) -> float:
            if unit == UNITS[0]:  # bias and o_proj are linear: only the changed o input matters
                return _relative(F.linear(attention_core(cfg, lw, x1, sub_lengths, rotary, wq) - o_in, w_o), inv1)
            if unit == UNITS[1]:
                return _relative(F.linear(o_in, wq - w_o), inv1)
            if unit == UNITS[2]:
                return _relative(F.linear(mlp_act(lw, x2, wq) - act, w_d), inv2)
            return _relative(F.linear(act, wq - w_d), inv2)

        errors: dict[str, list[float]] = {}
        for unit in UNITS:
            errs = [0.0] * len(candidates)
            n, k = lw.matrices[unit].shape
            for chunk in sweep_chunks(candidates, n, k, act_order):
                deq = candidate_weights(lw.matrices[unit], hessians[unit], [candidates[i] for i in chunk],
                                        act_order=act_order, damp=damp, clip_search=clip_search)
                for c, i in enumerate(chunk):
                    errs[i] = error(unit, deq[c])
                del deq
            errors[unit] = errs
    return errors, after
