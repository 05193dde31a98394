"""End-to-end tuning of the float parameters around fixed quantized values ("E2E-QP", norm
tweaking): after GPTQ has chosen every integer q, the RMSNorm weights and the group scales and
mins (for a coded slice: its per-column fp16 steps, the 8-bit codes fixed) are still free. The
dequantized weight q * scale + min is linear in them, so plain gradients (no straight-through
estimator) of KL(reference || quantized) over the calibration windows tune them with q unchanged.

The whole quantized decoder is held in memory (q as uint8), so this stage is for models whose
quantized weights fit in RAM several times over; the converter can skip it (--no-tune)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from halfbyte.model.config import ModelConfig
from halfbyte.model.rope import RotaryEmbedding
from halfbyte.quant.layer_forward import UNITS
from halfbyte.quant.packing import unpack
from halfbyte.quant.qtensor import QuantSlice, QuantWeight
from halfbyte.quant.scale_codes import _MIN_STEP, ScaleCodes, decode, encode
from halfbyte.quant.table_codes import TableCodes

class TunableSlice:
    """One slice: q fixed (uint8 [N, width]); trainable fp32 per-column steps (coded) or per-group
    scales and mins (fp16 slices), initialised from the stored values."""

    def __init__(self, s: QuantSlice) -> None:
        self.s = s
        self.q = unpack(s.qweight, s.bits, s.width).to(torch.uint8)
        self.group = torch.arange(s.width) // s.group_size
        if isinstance(s.codes, TableCodes):
            c = s.codes
            self.index = (c.scale_index.long(), c.min_index.long())  # [G, N] each
            self.base = [c.scale_base.float(), c.scale_table.float(), c.min_table.float()]
        elif s.codes is not None:
            code_s, code_m = encode(s.scales, s.mins, s.codes, "tune")
            self.code_s, self.code_m = code_s.float(), code_m.float()  # [G, N]
            self.base = [s.codes.scale_step.float(), s.codes.min_step.float()]  # [N] each
        else:
            self.base = [s.scales.float(), s.mins.float()]  # [G, N] each
        # trained as factors on the stored values (init 1): one learning rate fits every scale
        self.params = [torch.ones_like(b, requires_grad=True) for b in self.base]

    def values(self) -> list[torch.Tensor]:
        return [b * f for b, f in zip(self.base, self.params, strict=True)]

    def scales_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[G, N] fp32, differentiable."""
        if isinstance(self.s.codes, TableCodes):
            base, st, mt = self.values()
            sc = base[None, :] * st[self.index[0]]
            return sc, sc * mt[self.index[1]]
        a, b = self.values()
        if self.s.codes is not None:
            return self.code_s * a, self.code_m * b
        return a, b

    def weight(self) -> torch.Tensor:
        """[N, width] fp32 in stored order."""
        sc, mn = self.scales_mins()
        return self.q.float() * sc.t()[:, self.group] + mn.t()[:, self.group]

    def frozen(self) -> QuantSlice:
        """The slice with its tuned values rounded to what the format stores (q untouched)."""
        s = self.s
        if isinstance(s.codes, TableCodes):
            base, st, mt = (v.detach() for v in self.values())
            c = s.codes
            t = TableCodes(c.scale_bits, c.min_bits, base.clamp_min(2.0**-24).half(), st.clamp_min(2.0**-24).half(), mt.half(),
                           c.scale_index, c.min_index)
            scales, mins = t.decode()
            return QuantSlice(s.k_start, s.k_end, s.bits, s.group_size, s.qweight, scales, mins, t)
        a, b = (v.detach() for v in self.values())
        if s.codes is not None:
            codes = ScaleCodes(a.clamp_min(_MIN_STEP).half(), b.clamp_min(_MIN_STEP).half())
            scales, mins = decode(self.code_s.to(torch.uint8), self.code_m.to(torch.int8), codes)
            return QuantSlice(s.k_start, s.k_end, s.bits, s.group_size, s.qweight, scales, mins, codes)
        return QuantSlice(s.k_start, s.k_end, s.bits, s.group_size, s.qweight, a.half(), b.half())


class TunableWeight:
    def __init__(self, qw: QuantWeight) -> None:
        self.qw = qw
        self.slices = [TunableSlice(s) for s in qw.slices]
        self.inverse = torch.argsort(qw.perm.long()) if qw.perm is not None else None

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for s in self.slices for p in s.params]

    def weight(self) -> torch.Tensor:
        """[N, K] fp32 in the original column order, differentiable in the params."""
        w = torch.cat([s.weight() for s in self.slices], dim=1)
        return w[:, self.inverse] if self.inverse is not None else w

    def frozen(self) -> QuantWeight:
        return QuantWeight(self.qw.out_features, self.qw.in_features, [s.frozen() for s in self.slices], self.qw.perm)


@dataclass
class Layer:
    """One decoder layer's weights for `forward`: matrices (float tensors or TunableWeight),
    biases, and the two norm weights (fp32, trainable when tuned)."""

    matrices: dict[str, torch.Tensor | TunableWeight]
    biases: dict[str, torch.Tensor | None]
    input_norm: torch.Tensor
    post_norm: torch.Tensor


def _w(m: torch.Tensor | TunableWeight) -> torch.Tensor:
    return m.weight() if isinstance(m, TunableWeight) else m


def _lin(x: torch.Tensor, layer: Layer, unit: str) -> torch.Tensor:
    b = layer.biases[unit]
    return F.linear(x, _w(layer.matrices[unit]), b.float() if b is not None else None)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def forward_hidden(
    cfg: ModelConfig, layers: list[Layer], final_norm: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding
) -> torch.Tensor:
    """The decoder on one sequence: embeddings x [T, hidden] -> final normed hidden states."""
    t, eps, d = x.shape[0], cfg.rms_norm_eps, cfg.head_dim
    cos, sin = rotary.cos_sin(torch.arange(t), seq_len=t)
    cos, sin = cos[:, None].float(), sin[:, None].float()
    rep = cfg.num_heads // cfg.num_kv_heads
    for layer in layers:
        h = F.rms_norm(x, (x.shape[-1],), layer.input_norm, eps)
        q, k, v = _lin(h, layer, UNITS[0]).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = _rope(q.view(t, cfg.num_heads, d), cos, sin).transpose(0, 1)
        k = _rope(k.view(t, cfg.num_kv_heads, d), cos, sin).transpose(0, 1).repeat_interleave(rep, 0)
        v = v.view(t, cfg.num_kv_heads, d).transpose(0, 1).repeat_interleave(rep, 0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        x = x + _lin(o.transpose(0, 1).reshape(t, cfg.q_size), layer, UNITS[1])
        h = F.rms_norm(x, (x.shape[-1],), layer.post_norm, eps)
        gate, up = _lin(h, layer, UNITS[2]).chunk(2, dim=-1)
        x = x + _lin(F.silu(gate) * up, layer, UNITS[3])
    return F.rms_norm(x, (x.shape[-1],), final_norm, eps)


class TunableModel:
    """A quantized decoder from its per-layer tensors (the converter's layer files) and metadata,
    with trainable norm factors and slice parameters."""

    def __init__(self, layer_tensors: list[dict[str, torch.Tensor]], metas: list[dict[str, Any]], final_norm: torch.Tensor) -> None:
        self.tensors = layer_tensors
        self.weights = [
            {u: TunableWeight(QuantWeight.from_state_dict(f"model.layers.{i}.{u}", t, metas[i][u])) for u in UNITS}
            for i, t in enumerate(layer_tensors)
        ]
        self.norm_keys = [k for i in range(len(layer_tensors)) for k in (_norm_key(i, "input"), _norm_key(i, "post"))]
        self.norm_base = [self.tensors[int(k.split(".")[2])][k].float() for k in self.norm_keys] + [final_norm.float()]
        self.final_dtype = final_norm.dtype
        self.norm_factors = [torch.ones_like(b, requires_grad=True) for b in self.norm_base]

    def scale_params(self) -> list[torch.Tensor]:
        return [p for ws in self.weights for w in ws.values() for p in w.params]

    def layers(self) -> tuple[list[Layer], torch.Tensor]:
        """(layers for forward_hidden, final norm weight), differentiable in every parameter."""
        n = [b * f for b, f in zip(self.norm_base, self.norm_factors, strict=True)]
        layers = [
            Layer(dict(ws), {u: (t.get(f"model.layers.{i}.{u}.bias")) for u in UNITS}, n[2 * i], n[2 * i + 1])
            for i, (ws, t) in enumerate(zip(self.weights, self.tensors, strict=True))
        ]
        return layers, n[-1]

    def state_dicts(self) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """Per layer the stored tensors with tuned norms, scales and mins (q untouched), and the
        final norm; norms in their original dtype."""
        with torch.no_grad():
            n = [(b * f) for b, f in zip(self.norm_base, self.norm_factors, strict=True)]
            out = []
            for i, (ws, t) in enumerate(zip(self.weights, self.tensors, strict=True)):
                d = dict(t)
                for j, kind in enumerate(("input", "post")):
                    key = _norm_key(i, kind)
                    d[key] = n[2 * i + j].to(t[key].dtype)
                for u, w in ws.items():
                    d.update(w.frozen().to_state_dict(f"model.layers.{i}.{u}"))
                out.append(d)
            return out, n[-1].to(self.final_dtype)


def _norm_key(i: int, kind: str) -> str:
    return f"model.layers.{i}.{'input_layernorm' if kind == 'input' else 'post_attention_layernorm'}.weight"


def _kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(ref || model)."""
    lp, lr = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    return (lr.exp() * (lr - lp)).sum(-1).mean()


def tune(
    cfg: ModelConfig,
    model: TunableModel,
    rotary: RotaryEmbedding,
    embed: torch.Tensor,  # [vocab, hidden] fp32 input embeddings
    head: torch.Tensor,  # [vocab, hidden] fp32 head of the quantized model
    ref_head: torch.Tensor,  # [vocab, hidden] fp32 head of the reference
    windows: list[list[int]],
    ref_hidden: list[torch.Tensor],  # per window, the reference's final normed hidden states
    steps: int,
    lr_norm: float,
    lr_scale: float,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Adam on KL(reference || quantized) of the output logits, one calibration window per step
    in a fixed order (deterministic). Returns the loss of every step."""
    opt = torch.optim.Adam([{"params": model.norm_factors, "lr": lr_norm}, {"params": model.scale_params(), "lr": lr_scale}])
    losses = []
    for step in range(steps):
        w = step % len(windows)
        layers, final_norm = model.layers()
        h = forward_hidden(cfg, layers, final_norm, embed[torch.tensor(windows[w])], rotary)
        with torch.no_grad():
            ref_logits = ref_hidden[w] @ ref_head.t()
        loss = _kl(h @ head.t(), ref_logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
