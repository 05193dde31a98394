"""y = x @ dequant(W)^T for one K-slice of a halfbyte quantized weight (docs/format.md).

Layout: qweight int32 [K/32 * bits, N]; the 32 values of a (32-row block, column) form a
little-endian bitstream over `bits` consecutive words of that column. scales, mins fp16
[ceil(K / group_size), N]; W[n, k] = q * scales[k // g, n] + mins[k // g, n].

The Triton kernel dequantizes [BLOCK_K, BLOCK_N] tiles in registers and multiplies them with
tl.dot (M padded to 16), splitting K across programs and summing the fp32 partials after."""

from __future__ import annotations

import os

import torch

from halfbyte.kernels import gemm_w4, gemv_w2, gemv_w4, gemv_w4_i8
from halfbyte.kernels.dispatch import use_triton
from halfbyte.kernels.quant_gemv import gemv_triton
from halfbyte.kernels.triton_utils import HAS_TRITON, tl, triton
from halfbyte.quant.packing import unpack


def dequantize_ref(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int, k: int
) -> torch.Tensor:
    """fp32 [N, K]: the format's definition, on raw tensors."""
    q = unpack(qweight, bits, k).float()
    group = torch.arange(k, device=q.device) // group_size
    return q * scales.float().t()[:, group] + mins.float().t()[:, group]


def quant_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N]."""
    w = dequantize_ref(qweight, scales, mins, bits, group_size, x.shape[1])
    return x.float() @ w.t()


if HAS_TRITON:

    @triton.jit
    def _quant_matmul_kernel(
        x_ptr, qw_ptr, scales_ptr, mins_ptr, out_ptr,
        M, N, K, stride_xm, k_per_split,
        BITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_mask = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + rk  # [BLOCK_K]
            k_mask = kk < k_end
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm < M)[:, None] & k_mask[None, :], other=0.0)
            # where each k's bits are: word row and shift inside its 32-value block
            bit = (kk % 32) * BITS
            row = (kk // 32) * BITS + bit // 32
            shift = (bit % 32).to(tl.uint32)
            ptrs = qw_ptr + row[:, None].to(tl.int64) * N + rn[None, :]
            mask2 = k_mask[:, None] & n_mask[None, :]
            words = tl.load(ptrs, mask=mask2, other=0).to(tl.uint32)
            q = words >> shift[:, None]
            if 32 % BITS != 0:  # 3, 5, 6 bits: a value may continue in the next word
                spill = (shift + BITS > 32) & k_mask
                nxt = tl.load(ptrs + N, mask=spill[:, None] & n_mask[None, :], other=0).to(tl.uint32)
                q = q | tl.where(spill[:, None], nxt << (32 - shift)[:, None], 0)
            q = (q & ((1 << BITS) - 1)).to(tl.float32)
            g = kk // GROUP
            s = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=mask2, other=0.0).to(tl.float32)
            mn = tl.load(mins_ptr + g[:, None] * N + rn[None, :], mask=mask2, other=0.0).to(tl.float32)
            w = (q * s + mn).to(x_ptr.dtype.element_ty)
            acc += tl.dot(x, w)
        out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc, mask=(rm < M)[:, None] & n_mask[None, :])


    @triton.jit
    def _dequant_kernel(
        qw_ptr, scales_ptr, mins_ptr, out_ptr, N, K,
        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # writes W^T [K, N] in out's dtype, ready for a dense matmul x @ W^T
        rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rk < K)[:, None] & (rn < N)[None, :]
        bit = (rk % 32) * BITS
        row = (rk // 32) * BITS + bit // 32
        shift = (bit % 32).to(tl.uint32)
        ptrs = qw_ptr + row[:, None].to(tl.int64) * N + rn[None, :]
        q = tl.load(ptrs, mask=mask, other=0).to(tl.uint32) >> shift[:, None]
        if 32 % BITS != 0:
            spill = (shift + BITS > 32) & (rk < K)
            nxt = tl.load(ptrs + N, mask=spill[:, None] & (rn < N)[None, :], other=0).to(tl.uint32)
            q = q | tl.where(spill[:, None], nxt << (32 - shift)[:, None], 0)
        q = (q & ((1 << BITS) - 1)).to(tl.float32)
        g = rk // GROUP
        s = tl.load(scales_ptr + g[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        m = tl.load(mins_ptr + g[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rk[:, None].to(tl.int64) * N + rn[None, :], (q * s + m).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_t_triton(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int, k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W^T [K, N] in dtype."""
    n = qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k, 64), triton.cdiv(n, 128))
    _dequant_kernel[grid](qweight, scales, mins, out, n, k, BITS=bits, GROUP=group_size, BLOCK_N=128, BLOCK_K=64)
    return out


def quant_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int,
    split_k: int | None = None, block_n: int = 64, block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:
    """x [M, K] fp16/bf16 -> fp32 [M, N]."""
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    block_m = 16
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:  # enough programs to fill ~2 waves of 132 SMs, whole BLOCK_Ks each
        split_k = max(1, min(triton.cdiv(k, block_k), 264 // max(1, tiles)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _quant_matmul_kernel[grid](
        x, qweight, scales, mins, partial, m, n, k, x.stride(0), k_per_split,
        BITS=bits, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return partial.sum(0) if split_k > 1 else partial[0]


DENSE_THRESHOLD_M = 64  # rows above which dequantize + cuBLAS wins (to be tuned on the GPU)


def quant_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """x [M, K] @ dequant(W)^T -> [M, N] in x's dtype (fp32 accumulation): the weight-streaming
    kernel for decode-sized M (its fp16x2 4-bit form where it applies; HALFBYTE_W4_KERNEL=generic
    compares against the generic one), at 4 bits tensor cores for 2-64 rows (gemm_w4), tiles for
    mid-sized M, dequantize + cuBLAS for prefill; one 2-bit row through gemv_w2 with HALFBYTE_GEMV_W2=1."""
    if use_triton(x):
        m = x.shape[0]
        if os.environ.get("HALFBYTE_W4_KERNEL") != "generic":
            if gemv_w4.supports(x, bits, group_size):
                return gemv_w4.gemv_w4(x, qweight, scales, mins, group_size)
            if gemm_w4.supports(x, bits, group_size):
                return gemm_w4.gemm_w4(x, qweight, scales, mins, group_size)
            if gemv_w2.enabled() and gemv_w2.supports(x, bits, group_size):
                return gemv_w2.gemv_w2(x, qweight, scales, mins, group_size)
        if m <= 16 and 32 % bits == 0:
            return gemv_triton(x, qweight, scales, mins, bits, group_size)
        if m <= DENSE_THRESHOLD_M:
            return quant_matmul_triton(x, qweight, scales, mins, bits, group_size).to(x.dtype)
        # prefill: dequantizing once and letting cuBLAS run the big matmul beats re-dequantizing
        # the weight for every 16-row tile
        w_t = dequantize_t_triton(qweight, scales, mins, bits, group_size, x.shape[1], x.dtype)
        return torch.mm(x, w_t)
    return quant_matmul_ref(x, qweight, scales, mins, bits, group_size).to(x.dtype)


def x_planes_group(x: torch.Tensor, n: int, bits: int, group_size: int) -> int | None:
    """The group size in which quant_matmul_planes wants x [1, K] as int8 planes for an [N, K]
    weight, or None where quant_matmul (or the torch reference) is the path."""
    if (not use_triton(x) or os.environ.get("HALFBYTE_W4_KERNEL") == "generic"
            or not gemv_w4_i8.supports(x, bits, group_size) or gemv_w4_i8.config_for(n, x.shape[1]) is None):
        return None
    return group_size


def quant_matmul_planes(
    xp: gemv_w4_i8.XPlanes, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """quant_matmul of the x that the planes stand for (one row, 4 bits): gemv_w4_i8."""
    n, k = qweight.shape[1], xp.planes.shape[0] * 8
    cfg = gemv_w4_i8.config_for(n, k) or {}
    return gemv_w4_i8.gemv_w4_i8_planes(xp, qweight, scales, mins, **cfg)
