"""Incoherence by rotation: the float checkpoint seen through fixed orthogonal rotations that
leave the model's function unchanged and spread each matrix's outlier columns over all of them,
so that low-bit group grids fit its weights better (QuaRot / SpinQuant's offline rotations,
here for weight-only GPTQ).

Row vectors throughout (y = x W^T). With Q [hidden, hidden] orthogonal and the residual stream
carried as h Q, RMSNorm commutes with Q (||h Q|| = ||h||), so after folding each norm's weight g
into the matrices that read it:
    readers (q, k, v, gate, up, lm_head):  W -> W diag(g) Q,  the norm's weight -> 1
    writers (o, down; their biases):       W -> Q^T W,        b -> Q^T b
    embedding:                             E -> E Q
and with R [head_dim, head_dim] orthogonal per value head (attention mixes whole value rows):
    v:  W -> R^T W (per head block, its bias too),   o:  W -> W R (per head block of its input)
q and k (RoPE pairs), gate/up's outputs and down's input (through SiLU) are not rotated.

A tied embedding becomes two tensors (E Q and the head's E diag(g) Q): the converter writes an
untied head. Nothing changes at run time: the quantized model is an ordinary Llama whose norm
weights start at 1. Measured on SmolLM2-135M (BENCHMARKS.md, issue 3): plain 3-bit g64 GPTQ
gains (held-out KL 0.813 -> 0.687), round-to-nearest alone loses (2.29 -> 3.24: only a
Hessian-aware quantizer uses the incoherence), and the 3.25 bpw default loses (ppl 45.08 ->
48.46): SmolLM2's weights come from a Q4_1 GGUF and sit on 4-bit group-32 grids, which the
allocator's 4-bit group-32 settings hold exactly and a rotation destroys. Hence opt-in
(`halfbyte convert --rotate`)."""

from __future__ import annotations

import re

import torch

from halfbyte.model.config import ModelConfig
from halfbyte.quant.layer_forward import WeightSource

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_READS_INPUT_NORM = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_READS_POST_NORM = ("mlp.gate_proj", "mlp.up_proj")
_WRITERS = ("self_attn.o_proj", "mlp.down_proj")


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal [n, n] float64 matrix (QR of a Gaussian with the signs fixed),
    the same for the same seed on every machine (torch's CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


class RotatedSource:
    """A WeightSource whose tensors are the rotated model's (module doc), computed per read in
    float64. lm_head.weight always exists (untied)."""

    def __init__(self, src: WeightSource, cfg: ModelConfig, seed: int) -> None:
        self.src, self.cfg = src, cfg
        self.q = random_orthogonal(cfg.hidden_size, seed)
        self.r = random_orthogonal(cfg.head_dim, seed + 1)

    def has(self, name: str) -> bool:
        return name == "lm_head.weight" or self.src.has(name)

    def get_optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None

    def get(self, name: str) -> torch.Tensor:
        """The rotated tensor in the dtype of the first tensor its computation reads (its own,
        or for an untied head from a tied embedding, the embedding's)."""
        self._dtype: torch.dtype | None = None
        t = self._rotated(name)
        assert self._dtype is not None
        return t.to(self._dtype)

    def _read(self, name: str) -> torch.Tensor:
        t = self.src.get(name)
        self._dtype = self._dtype or t.dtype
        return t.double()

    def _rotated(self, name: str) -> torch.Tensor:
        cfg, q = self.cfg, self.q
        if name == "model.embed_tokens.weight":
            return self._read(name) @ q
        if name == "lm_head.weight":
            head = "lm_head.weight" if self.src.has("lm_head.weight") and not cfg.tie_word_embeddings else "model.embed_tokens.weight"
            return self._read(head) * self._read("model.norm.weight") @ q
        if name == "model.norm.weight":
            return torch.ones_like(self._read(name))
        m = _LAYER.fullmatch(name)
        if m is None:
            return self._read(name)
        base, rest = f"model.layers.{m.group(1)}", m.group(2)
        unit, _, kind = rest.rpartition(".")
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return torch.ones_like(self._read(name))
        t = self._read(name)
        if unit in _READS_INPUT_NORM + _READS_POST_NORM and kind == "weight":
            norm = "input_layernorm" if unit in _READS_INPUT_NORM else "post_attention_layernorm"
            t = t * self._read(f"{base}.{norm}.weight") @ q
        if unit == "self_attn.v_proj":  # output rows, per value head: R^T W (and R^T b)
            heads = t.reshape(cfg.num_kv_heads, cfg.head_dim, -1)
            t = torch.einsum("ji,hjk->hik", self.r, heads).reshape(t.shape)
        if unit in _WRITERS:
            if unit == "self_attn.o_proj" and kind == "weight":  # input columns per head: W R
                t = torch.einsum("nhj,jk->nhk", t.reshape(t.shape[0], cfg.num_heads, cfg.head_dim), self.r).reshape(t.shape)
            t = q.T @ t
        return t
