"""Rotary position embedding on q and k ("rotate half" layout, as Hugging Face Llama), fused with
writing k and v into the paged KV cache: one launch per layer instead of four."""

from __future__ import annotations

import torch

from halfbyte.kernels.attention import store_kv_ref
from halfbyte.kernels.dispatch import use_triton
from halfbyte.kernels.triton_utils import HAS_TRITON, pdl_args, pdl_sync, tl, triton


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D] (fp32) -> rotated q, k in the inputs' dtype.
    Computed in fp32 and rounded once."""
    cos = cos.float().unsqueeze(1)
    sin = sin.float().unsqueeze(1)
    if q.dtype == torch.float32 and k.dtype == torch.float32:  # no conversions to pay for
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    qf, kf = q.float(), k.float()
    return (
        (qf * cos + _rotate_half(qf) * sin).to(q.dtype),
        (kf * cos + _rotate_half(kf) * sin).to(k.dtype),
    )


def rope_and_store_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> torch.Tensor:
    """Rotates q and k, stores k and v at their cache slots, returns rotated q."""
    q, k = apply_rotary_ref(q, k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


if HAS_TRITON:

    @triton.jit
    def _rope_store_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, kc_ptr, vc_ptr, slot_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
        num_q_heads, num_kv_heads,
        HALF: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_sync(PDL)
        # one program per (token, head); heads [0, Hq) are q, [Hq, Hq + Hkv) are k (+ v)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + t * stride_ct + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_ct + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_ct + HALF + offs).to(tl.float32)
        if h < num_q_heads:
            src = q_ptr + t * stride_qt + h * stride_qh
            x1 = tl.load(src + offs).to(tl.float32)
            x2 = tl.load(src + HALF + offs).to(tl.float32)
            q_dst = q_out_ptr + (t * num_q_heads + h) * 2 * HALF
            tl.store(q_dst + offs, (x1 * c1 - x2 * s1).to(q_out_ptr.dtype.element_ty))
            tl.store(q_dst + HALF + offs, (x2 * c2 + x1 * s2).to(q_out_ptr.dtype.element_ty))
        else:
            kh = h - num_q_heads
            slot = tl.load(slot_ptr + t).to(tl.int64)
            kv_dst = (slot * num_kv_heads + kh) * 2 * HALF
            src = k_ptr + t * stride_kt + kh * stride_kh
            x1 = tl.load(src + offs).to(tl.float32)
            x2 = tl.load(src + HALF + offs).to(tl.float32)
            tl.store(kc_ptr + kv_dst + offs, (x1 * c1 - x2 * s1).to(kc_ptr.dtype.element_ty))
            tl.store(kc_ptr + kv_dst + HALF + offs, (x2 * c2 + x1 * s2).to(kc_ptr.dtype.element_ty))
            vsrc = v_ptr + t * stride_vt + kh * stride_vh
            tl.store(vc_ptr + kv_dst + offs, tl.load(vsrc + offs).to(vc_ptr.dtype.element_ty))
            tl.store(vc_ptr + kv_dst + HALF + offs, tl.load(vsrc + HALF + offs).to(vc_ptr.dtype.element_ty))


def rope_and_store_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    # q, k, v may be strided views of the fused qkv output: only the last dim must be contiguous
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_store_kernel[(tokens, num_q_heads + num_kv_heads)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        num_q_heads, num_kv_heads, HALF=head_dim // 2, num_warps=1, **pdl_args(q.device),
    )
    return q_out


def rope_and_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    if use_triton(q):
        return rope_and_store_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_and_store_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
