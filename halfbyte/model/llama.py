"""The Llama-family network (llama, mistral, qwen2, SmolLM) over a flat batch of tokens.

The batch is flat: T tokens from any number of sequences, with positions and an
AttentionMetadata saying where each sequence's tokens and KV pages are. The network knows
nothing of requests; it calls ops only through halfbyte.kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from halfbyte.kernels.activation import silu_and_mul
from halfbyte.kernels.attention import AttentionMetadata, paged_attention
from halfbyte.kernels.embedding import embedding
from halfbyte.kernels.gemv_w4_i8 import XPlanes
from halfbyte.kernels import l2_prefetch
from halfbyte.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_planes
from halfbyte.kernels.rotary import rope_and_store
from halfbyte.model.config import ModelConfig
from halfbyte.model.linear import Linear
from halfbyte.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from halfbyte.model.quant_linear import QuantLinear

KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: k, v [num_pages, page_size, Hkv, D]
WARM_MAX_ROWS = 16  # decode-sized batches stream their weights; prefill's matmuls do not wait on them


def warm_l2(linear: nn.Module, x: torch.Tensor) -> None:
    """Ask the L2 for linear's weights now, so that the small kernels launched before its GEMV
    run while they stream in (kernels/l2_prefetch.py: off unless HALFBYTE_L2_PREFETCH is set)."""
    if x.is_cuda and x.shape[0] <= WARM_MAX_ROWS and l2_prefetch.prefetch_mode() is not None:
        l2_prefetch.l2_prefetch([*linear.parameters(), *linear.buffers()])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_bias, dtype, device)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        x_planes: XPlanes | None = None,  # x as int8 planes, where qkv_proj asked for them
    ) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj(x, x_planes)
        warm_l2(self.o_proj, x)  # during RoPE and attention
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = kv_cache
        q = rope_and_store(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, cfg.sliding_window)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, dtype, device)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, x_planes: XPlanes | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, x_planes)
        warm_l2(self.down_proj, x)  # during SiLU-mul
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype, device=device), False)
        self.post_attention_layernorm = nn.Parameter(
            torch.empty(cfg.hidden_size, dtype=dtype, device=device), False
        )
        self.self_attn = Attention(cfg, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def _pre_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, consumer: Linear | QuantLinear
    ) -> tuple[torch.Tensor, torch.Tensor, XPlanes | None]:
        """(norm(x + r), x + r, None): the residual add is fused into the norm. Where the consumer
        takes x as int8 planes (one row, 4 bits: gemv_w4_i8), the norm writes them too."""
        group = consumer.x_planes_group(x)
        if group is not None:
            return rms_norm_planes(x, residual, weight, self.eps, group)
        if residual is None:
            return rms_norm(x, weight, self.eps), x, None
        h, summed = add_rms_norm(x, residual, weight, self.eps)
        return h, summed, None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        warm_l2(self.self_attn.qkv_proj, x)  # during the norm
        h, residual, planes = self._pre_norm(x, residual, self.input_layernorm, self.self_attn.qkv_proj)
        h = self.self_attn(h, cos, sin, kv_cache, meta, planes)
        warm_l2(self.mlp.gate_up_proj, h)
        h, residual, planes = self._pre_norm(h, residual, self.post_attention_layernorm, self.mlp.gate_up_proj)
        return self.mlp(h, planes), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), False
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype, device=device), False)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, False, dtype, device
        )
        self.rotary = RotaryEmbedding(
            # cos/sin stay fp32 whatever the weights: rotation is computed in fp32 and rounded once
            cfg.rope_scaling, cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device, torch.float32
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden]."""
        cos, sin = self.rotary.cos_sin(positions, seq_len=max(meta.seq_lens))
        x = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv, meta)
        assert residual is not None
        x, _ = add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        l2_prefetch.join(x.device)  # prefetches launched on a side stream, if any
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]. A seam: the tensor-parallel model (parallel_llama.py) looks up its
        vocabulary shard here and all-reduces."""
        return embedding(input_ids, self.embed_tokens)

    def prepare_for_inference(self) -> None:
        """Lay weights out for the device after loading. On the CPU, W^T halves the GEMV time
        of the big matrices (LM head: 10.4 -> 5.7 ms for SmolLM2, 2 cores)."""
        from halfbyte.model.quant_linear import QuantLinear

        for module in self.modules():
            if isinstance(module, QuantLinear):
                module.prepare_for_inference(self.device)
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return  # (bf16 on the CPU: F.linear on W beat mm on W^T, 3.1 vs 5.0 ms for SmolLM2's head)
        for module in self.modules():
            if isinstance(module, Linear):
                module.transpose_weight()
        if self.lm_head is None:  # tied: a transposed copy for the head, the table for lookups
            self.lm_head = Linear(self.cfg.hidden_size, self.cfg.vocab_size, False, self.dtype, self.device)
            self.lm_head.weight = nn.Parameter(self.embed_tokens.data.t().contiguous(), False)
            self.lm_head.transposed = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embed_tokens).float()
        return self.lm_head(hidden).float()
