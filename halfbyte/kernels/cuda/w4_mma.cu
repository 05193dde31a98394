// 4-bit weight-streaming matmul for 1-16 fp16 rows on tensor cores: y = x @ dequant(W)^T.
//
// Why CUDA here (the Triton kernels gemv_w4 / gemm_w4 stay as the fallback): Triton's gemv_w4
// spends ~25 SASS instructions per 32-bit weight word and keeps at most one tile per program in
// flight; gemm_w4 stages every dequantized weight through shared memory for its dot. Here:
// - W is mma.sync's A operand straight from the registers of the thread that unpacked it: one
//   word's four fp16x2 registers are a thread's A-fragment halves for two m16n8k16 products, and
//   x's pairs are the B fragment (~13 instructions per word instead of ~25);
// - each thread keeps DEPTH steps of its weights in flight in registers (a ring of 16-byte loads;
//   a ring in shared memory filled by cp.async measured 1.3-2x slower on the H200).
//
// Format (docs/format.md, bits = 4): qweight int32 [K/8, N], value j of a word in bits 4j..4j+3
// (k = 8r + j); scales, mins fp16 [ceil(K/G), N]; W[n, k] = q s + m. Per group:
//     y[m, n] += s[n] * sum_k (q - 8) x[m, k]  +  (m[n] + 8 s[n]) * sum_k x[m, k]
// The reference is quant_matmul.quant_matmul_ref.
//
// Codes: one lop3 turns two nibbles into fp16 1024 + q (values 0, 2, 4, 6 of a word's pairs
// (0,4), (2,6)) or 1024 + 16 q ((1,5), (3,7)), exactly. Those go into the product as they are,
// with the x of the 16 q pairs scaled by 1/16; the product then carries 1032 x and 72 x per value
// beyond (q - 8) x, which a third product per step (A = the constants 1032 and 72 * 16) measures
// and the fold per group removes, in fp32.
//
// Mapping (lane = 4 g + t): a warp owns 64 columns n0.. and a K range in steps of 32 k (four word
// rows). In a step, thread (g, t) holds word row r = k/8 + t at columns n0+4g..+3 and
// n0+32+4g..+3. For tile j (0..3), mma row g <-> column n0+4g+j, row g+8 <-> n0+32+4g+j; the mma
// k slots (2t, 2t+1, 2t+8, 2t+9) <-> k = 8r + (0, 4, 1, 5) for the first product and 8r + (2, 6,
// 3, 7) for the second: the pairs one lop3 unpacks, and the pairs x's B fragment takes from x row g
// (x row = mma column). Warps of a block split its K range; blocks split K further (grid.y) and
// the last block of a column range to finish adds the partials (a counter per column range).
#include <cuda_fp16.h>
#include <cstdint>

namespace {

constexpr int WARPS = 4;  // warps per block, each a slice of the block's K range
constexpr int COLS = 64;  // columns per block

__device__ __forceinline__ uint4 load_weights(const uint32_t* p) {  // read once: not kept in L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// the four fp16x2 codes of a word: (0,4) and (2,6) as 1024 + q, (1,5) and (3,7) as 1024 + 16 q
__device__ __forceinline__ void unpack(uint32_t w, uint32_t (&h)[4]) {
  const uint32_t top = w >> 8;
  asm("lop3.b32 %0, %4, 0x000f000f, 0x64006400, 0xea;\n"
      "lop3.b32 %1, %4, 0x00f000f0, 0x64006400, 0xea;\n"
      "lop3.b32 %2, %5, 0x000f000f, 0x64006400, 0xea;\n"
      "lop3.b32 %3, %5, 0x00f000f0, 0x64006400, 0xea;\n"
      : "=r"(h[0]), "=r"(h[1]), "=r"(h[2]), "=r"(h[3])
      : "r"(w), "r"(top));
}

__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float2 half2_floats(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}

// x rows mt*8 + g of one step as B fragments: (x0,x4) (x1,x5)/16 (x2,x6) (x3,x7)/16
template <int MT>
__device__ __forceinline__ void load_x(const __half* xp, int g, int M, int K, uint32_t (&bx)[MT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    uint4 v = {0, 0, 0, 0};
    if (mt * 8 + g < M) v = __ldg(reinterpret_cast<const uint4*>(xp + (size_t)mt * 8 * K));
    const uint32_t sixteenth = 0x2c002c00u;
    bx[mt][0] = __byte_perm(v.x, v.z, 0x5410);
    bx[mt][1] = hmul2(__byte_perm(v.x, v.z, 0x7632), sixteenth);
    bx[mt][2] = __byte_perm(v.y, v.w, 0x5410);
    bx[mt][3] = hmul2(__byte_perm(v.y, v.w, 0x7632), sixteenth);
  }
}

// MT: tiles of 8 x rows (1 for M <= 8, 2 for M <= 16). ONE_ROW: M == 1 (odd mma columns unused).
// DEPTH: steps of weights in flight per thread.
template <int MT, bool ONE_ROW, int DEPTH>
__global__ void __launch_bounds__(WARPS * 32) w4_mma_kernel(
    const __half* __restrict__ x, const uint32_t* __restrict__ qw, const __half* __restrict__ scales,
    const __half* __restrict__ mins, __half* __restrict__ out, float* __restrict__ partial,
    int* __restrict__ counters, int M, int N, int K, int group, int k_per_warp, int pdl) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * COLS;
  const int k_first = (blockIdx.y * WARPS + warp) * k_per_warp;
  const int steps = max(0, min(k_per_warp, K - k_first)) / 32;  // K % 32 == 0

  // pdl 2: let the next kernel launch at once (it still waits for this one to finish before it
  // touches memory, and this one for its predecessor: the chain stays ordered), so its weight
  // requests can overlap this kernel's; pdl 1: only after this kernel's wait.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pdl == 2) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  // The weights never change: the first DEPTH steps are requested before waiting for the
  // previous kernel (programmatic dependent launch), so their DRAM trip overlaps its tail.
  const uint32_t* wp = qw + (size_t)(k_first / 8 + t) * N + n0 + 4 * g;
  const size_t step_words = (size_t)4 * N;
  uint4 wa[DEPTH], wb[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
    if (d < steps) {
      wa[d] = load_weights(wp + d * step_words);
      wb[d] = load_weights(wp + d * step_words + 32);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pdl) asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (pdl == 1) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif

  float acc[MT][4][4], part[MT][4][4], sums[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sums[mt][i] = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][j][i] = part[mt][j][i] = 0.f;
    }
  // the sums product's A operand: mma rows g take the bias weights (1032 per bottom pair, 72 * 16
  // per top pair, whose x is scaled by 1/16), rows g + 8 the plain sums (1 and 16)
  const uint32_t A0 = 0x64086408u, A1 = 0x3c003c00u, A2 = 0x64806480u, A3 = 0x4c004c00u;
  const int group_mask = group - 1, group_shift = __ffs(group) - 1;  // group is a power of two
  uint2 sa = {0, 0}, sb = {0, 0}, ma = {0, 0}, mb = {0, 0};
  const __half* xp = x + (size_t)g * K + k_first + 8 * t;  // x row g, this thread's word row
  uint32_t bx[MT][4];
  if (steps > 0) load_x<MT>(xp, g, M, K, bx);
  int k = k_first;

  const uint32_t* wnext = wp + DEPTH * step_words;
  for (int base = 0; base < steps; base += DEPTH) {
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    const int s = base + d;
    if (s >= steps) break;  // warp-uniform
    if ((k & group_mask) == 0 || s == 0) {  // this group's scales and mins, used at its end
      const size_t off = (size_t)(k >> group_shift) * N + n0 + 4 * g;
      sa = __ldg(reinterpret_cast<const uint2*>(scales + off));
      sb = __ldg(reinterpret_cast<const uint2*>(scales + off + 32));
      ma = __ldg(reinterpret_cast<const uint2*>(mins + off));
      mb = __ldg(reinterpret_cast<const uint2*>(mins + off + 32));
    }
    uint32_t bx_next[MT][4];
    if (s + 1 < steps) load_x<MT>(xp + 32, g, M, K, bx_next);  // one step ahead
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t ha[4], hb[4];
      unpack(j == 0 ? wa[d].x : j == 1 ? wa[d].y : j == 2 ? wa[d].z : wa[d].w, ha);
      unpack(j == 0 ? wb[d].x : j == 1 ? wb[d].y : j == 2 ? wb[d].z : wb[d].w, hb);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma(part[mt][j], ha[0], hb[0], ha[1], hb[1], bx[mt][0], bx[mt][1]);
        mma(part[mt][j], ha[2], hb[2], ha[3], hb[3], bx[mt][2], bx[mt][3]);
      }
    }
    // this slot's words are consumed: request the step DEPTH ahead into the same registers
    if (s + DEPTH < steps) {
      wa[d] = load_weights(wnext);
      wb[d] = load_weights(wnext + 32);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma(sums[mt], A0, A1, A2, A3, bx[mt][0], bx[mt][1]);
      mma(sums[mt], A0, A1, A2, A3, bx[mt][2], bx[mt][3]);
    }
    if (((k + 32) & group_mask) == 0 || s == steps - 1) {  // the group ends: fold it in with its scales
      const float2 s01a = half2_floats(sa.x), s23a = half2_floats(sa.y);
      const float2 s01b = half2_floats(sb.x), s23b = half2_floats(sb.y);
      const float2 m01a = half2_floats(ma.x), m23a = half2_floats(ma.y);
      const float2 m01b = half2_floats(mb.x), m23b = half2_floats(mb.y);
      const float s_a[4] = {s01a.x, s01a.y, s23a.x, s23a.y}, s_b[4] = {s01b.x, s01b.y, s23b.x, s23b.y};
      const float m_a[4] = {m01a.x, m01a.y, m23a.x, m23a.y}, m_b[4] = {m01b.x, m01b.y, m23b.x, m23b.y};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float m8a = fmaf(8.f, s_a[j], m_a[j]), m8b = fmaf(8.f, s_b[j], m_b[j]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          // part c0, c1: column n0+4g+j, x rows 2t, 2t+1; c2, c3: column n0+32+4g+j. sums c0, c1:
          // the bias of x rows 2t, 2t+1; c2, c3: their plain sums
          acc[mt][j][0] = fmaf(part[mt][j][0] - sums[mt][0], s_a[j], fmaf(sums[mt][2], m8a, acc[mt][j][0]));
          acc[mt][j][2] = fmaf(part[mt][j][2] - sums[mt][0], s_b[j], fmaf(sums[mt][2], m8b, acc[mt][j][2]));
          if (!ONE_ROW) {
            acc[mt][j][1] = fmaf(part[mt][j][1] - sums[mt][1], s_a[j], fmaf(sums[mt][3], m8a, acc[mt][j][1]));
            acc[mt][j][3] = fmaf(part[mt][j][3] - sums[mt][1], s_b[j], fmaf(sums[mt][3], m8b, acc[mt][j][3]));
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) part[mt][j][i] = 0.f;
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) sums[mt][i] = 0.f;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) bx[mt][i] = bx_next[mt][i];
    k += 32;
    xp += 32;
    wnext += step_words;
  }
  }

  // the block's warps add their K slices in shared memory
  constexpr int ROWS = MT * 8;
  __shared__ float red[WARPS][ROWS][COLS];
  __shared__ int last;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (!(ONE_ROW && (i & 1))) red[warp][mt * 8 + 2 * t + (i & 1)][(i >> 1) * 32 + 4 * g + j] = acc[mt][j][i];
  __syncthreads();
  const int split = gridDim.y;
  for (int idx = threadIdx.x; idx < M * COLS; idx += WARPS * 32) {
    const int row = idx / COLS, col = idx % COLS;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += red[w][row][col];
    if (split == 1)
      out[(size_t)row * N + n0 + col] = __float2half_rn(v);
    else
      partial[((size_t)blockIdx.y * M + row) * N + n0 + col] = v;
  }
  if (split == 1) return;
  // the last block of this column range to finish adds the partials
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == split - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < M * COLS; idx += WARPS * 32) {
    const int row = idx / COLS, col = idx % COLS;
    float v = 0.f;
    for (int sp = 0; sp < split; ++sp) v += __ldcg(partial + ((size_t)sp * M + row) * N + n0 + col);
    out[(size_t)row * N + n0 + col] = __float2half_rn(v);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

using Kernel = void (*)(const __half*, const uint32_t*, const __half*, const __half*, __half*, float*, int*, int, int,
                        int, int, int, int);

template <int DEPTH>
Kernel instance(int M) {
  return M == 1 ? w4_mma_kernel<1, true, DEPTH> : M <= 8 ? w4_mma_kernel<1, false, DEPTH> : w4_mma_kernel<2, false, DEPTH>;
}

Kernel pick(int M, int depth) { return depth == 8 ? instance<8>(M) : instance<4>(M); }

}  // namespace

extern "C" {

// Loads every kernel instance on the device now (lazy module loading would otherwise do it at the
// first launch, which may happen inside a CUDA graph capture). Returns a cudaError_t.
int hb_w4_mma_init(int device) {
  cudaError_t e = cudaSetDevice(device);
  cudaFuncAttributes a;
  for (int depth : {4, 8})
    for (int m : {1, 2, 16})
      if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, pick(m, depth));
  return static_cast<int>(e);
}

// Registers per thread of the instance for M rows (for benchmarks). -1 on error.
int hb_w4_mma_registers(int M, int depth) {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, pick(M, depth)) == cudaSuccess ? a.numRegs : -1;
}

// y [M, N] fp16 = x [M, K] fp16 @ dequant(W)^T. Preconditions (checked by the caller): 1 <= M <= 16,
// N % 64 == 0, K % 32 == 0, group a power of two >= 32, k_per_warp a multiple of group and of 32,
// split * 4 * k_per_warp >= K, x and qweight 16-byte aligned, scales and mins 8-byte aligned;
// partial holds split * M * N floats when split > 1; counters hold N / 64 zeroed ints (left
// zeroed). depth: 4 or 8. pdl: 0 off, 1 the next kernel may launch once this one's wait is
// over, 2 at once. The launch goes to `stream` on CUDA device `device`. Returns a
// cudaError_t.
int hb_w4_mma(const void* x, const void* qw, const void* scales, const void* mins, void* out, void* partial,
              void* counters, int M, int N, int K, int group, int split, int k_per_warp, int pdl, int depth,
              int device, void* stream) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device) {
    const cudaError_t e = cudaSetDevice(device);  // the stream's device (torch may run elsewhere)
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(N / COLS, split);
  cfg.blockDim = dim3(WARPS * 32);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, pick(M, depth), static_cast<const __half*>(x),
                                             static_cast<const uint32_t*>(qw), static_cast<const __half*>(scales),
                                             static_cast<const __half*>(mins), static_cast<__half*>(out),
                                             static_cast<float*>(partial), static_cast<int*>(counters), M, N, K,
                                             group, k_per_warp, pdl));
}

}  // extern "C"
