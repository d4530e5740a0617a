// The fused multi-tensor Adam kernel and the gradient check. The element update is base/adam_math.h's
// AdamUpdate, the same function the host backend and the CPU kernels run (the CPU SIMD paths compile
// its generic template for vectors); the build compiles this file with --fmad=false, and sqrtf and
// division are IEEE-rounded by default, so the results equal the host's bit for bit. The gradient check
// sums exactly (base/exact_sum.h), so its result is the CPU's bit for bit too, for any grid.
#include <cstdint>

#include "base/adam_element.h"
#include "base/adam_math.h"
#include "base/adam_state.h"
#include "base/exact_sum.h"
#include "device/cuda/kernels.h"
#include "ferry/dtype.h"

namespace ferry::cuda_kernels {
namespace {

// Elements e .. e+3 as floats: one 16-byte load for f32, one 8-byte load for the 16-bit types.
// REQUIRES: the 4 elements aligned accordingly.
__device__ __forceinline__ void Load4(const void* base, DType t, int64_t e, float out[4]) {
  if (t == DType::kF32) {
    const float4 x = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + e);
    out[0] = x.x;
    out[1] = x.y;
    out[2] = x.z;
    out[3] = x.w;
    return;
  }
  const uint2 x = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + e);
  const uint16_t h[4] = {static_cast<uint16_t>(x.x & 0xffffu), static_cast<uint16_t>(x.x >> 16),
                         static_cast<uint16_t>(x.y & 0xffffu), static_cast<uint16_t>(x.y >> 16)};
  for (int j = 0; j < 4; ++j) out[j] = t == DType::kBF16 ? BF16ToF32(h[j]) : F16ToF32(h[j]);
}

// Elements e .. e+3 rounded to `t` (StoreFromF32's conversions), one 16- or 8-byte store.
__device__ __forceinline__ void Store4(void* base, DType t, int64_t e, const float v[4]) {
  if (t == DType::kF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + e) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  uint32_t h[4];
  for (int j = 0; j < 4; ++j) h[j] = t == DType::kBF16 ? F32ToBF16(v[j]) : F32ToF16(v[j]);
  *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + e) =
      make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

__device__ __forceinline__ void Element(const AdamScalars& s, const AdamTensorDesc& t, int64_t i) {
  AdamStepElement(s, static_cast<float*>(t.master), static_cast<float*>(t.exp_avg), static_cast<float*>(t.exp_avg_sq),
                  t.grad, t.grad_dtype, t.param, t.param_dtype, static_cast<size_t>(i));
}

// Elements e .. e+3: the fp32 state through 16-byte loads and stores, grad and param too when aligned.
// REQUIRES: e - vec_head is a multiple of 4.
__device__ __forceinline__ void Group4(const AdamScalars& s, const AdamTensorDesc& t, int64_t e) {
  float* const master = static_cast<float*>(t.master);
  float* const exp_avg = static_cast<float*>(t.exp_avg);
  float* const exp_avg_sq = static_cast<float*>(t.exp_avg_sq);
  float4 p = *reinterpret_cast<const float4*>(master + e);
  float4 m = *reinterpret_cast<const float4*>(exp_avg + e);
  float4 v = *reinterpret_cast<const float4*>(exp_avg_sq + e);
  float g[4];
  if (t.grad_vec != 0) {
    Load4(t.grad, t.grad_dtype, e, g);
  } else {
    for (int j = 0; j < 4; ++j) g[j] = LoadAsF32(t.grad, t.grad_dtype, static_cast<size_t>(e + j));
  }
  AdamUpdate(s, p.x, m.x, v.x, g[0]);
  AdamUpdate(s, p.y, m.y, v.y, g[1]);
  AdamUpdate(s, p.z, m.z, v.z, g[2]);
  AdamUpdate(s, p.w, m.w, v.w, g[3]);
  *reinterpret_cast<float4*>(master + e) = p;
  *reinterpret_cast<float4*>(exp_avg + e) = m;
  *reinterpret_cast<float4*>(exp_avg_sq + e) = v;
  if (t.param != nullptr) {
    const float out[4] = {p.x, p.y, p.z, p.w};
    if (t.param_vec != 0) {
      Store4(t.param, t.param_dtype, e, out);
    } else {
      for (int j = 0; j < 4; ++j) StoreFromF32(t.param, t.param_dtype, static_cast<size_t>(e + j), out[j]);
    }
  }
}

// ---- typed state (bf16 master and/or moments, base/adam_state.h) ----

__device__ __forceinline__ StateFormat FormatOf(const AdamTensorDesc& t) {
  StateFormat f;
  f.master = (t.state & kAdamMasterBf16) != 0 ? DType::kBF16 : DType::kF32;
  f.moments = (t.state & kAdamMomentsBf16) != 0 ? DType::kBF16 : DType::kF32;
  f.rounding = (t.state & kAdamStochastic) != 0 ? StateRounding::kStochastic : StateRounding::kNearest;
  return f;
}

// The kind keys of element i: the chunk's, unless i's global index has another high word (a chunk
// straddling a multiple of 2^32 elements).
__device__ __forceinline__ StateKindKeys KeysAt(const AdamTensorDesc& t, int64_t i, const StateKindKeys& chunk_keys,
                                                uint32_t chunk_hi) {
  const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(t.index0 + i) >> 32);
  if (hi == chunk_hi || (t.state & kAdamStochastic) == 0) return chunk_keys;
  return KindKeysFor(t.round_key, hi);
}

__device__ __forceinline__ void ElementTyped(const AdamScalars& s, const AdamTensorDesc& t, int64_t i,
                                             const StateKindKeys& chunk_keys, uint32_t chunk_hi) {
  AdamStepElementTyped(s, FormatOf(t), t.master, t.exp_avg, t.exp_avg_sq, t.grad, t.grad_dtype, t.param,
                       t.param_dtype, static_cast<size_t>(i), KeysAt(t, i, chunk_keys, chunk_hi),
                       static_cast<uint32_t>(static_cast<uint64_t>(t.index0 + i)));
}

// Elements e .. e+3 of state `base` (fp32 or bf16) rounded as `f` says; `bits` are the 4 elements'
// random bits. One 16-byte (fp32) or 8-byte (bf16) store.
__device__ __forceinline__ void Store4State(void* base, DType t, StateRounding r, int64_t e, const float v[4],
                                            const uint32_t bits[4]) {
  if (t == DType::kF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(base) + e) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  uint32_t h[4];
  for (int j = 0; j < 4; ++j) {
    h[j] = r == StateRounding::kStochastic ? F32ToBF16Stochastic(v[j], bits[j]) : F32ToBF16(v[j]);
  }
  *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + e) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

// Group4 with typed state: bf16 state through 8-byte loads and stores (4 elements), fp32 through 16.
// REQUIRES: e - vec_head is a multiple of 4; the 4 elements share their global index's high word
// (keys).
__device__ __forceinline__ void Group4Typed(const AdamScalars& s, const AdamTensorDesc& t, int64_t e,
                                            const StateKindKeys& keys) {
  const StateFormat f = FormatOf(t);
  float p[4], m[4], v[4], g[4];
  Load4(t.master, f.master, e, p);
  Load4(t.exp_avg, f.moments, e, m);
  Load4(t.exp_avg_sq, f.moments, e, v);
  if (t.grad_vec != 0) {
    Load4(t.grad, t.grad_dtype, e, g);
  } else {
    for (int j = 0; j < 4; ++j) g[j] = LoadAsF32(t.grad, t.grad_dtype, static_cast<size_t>(e + j));
  }
  for (int j = 0; j < 4; ++j) AdamUpdate(s, p[j], m[j], v[j], g[j]);
  uint32_t bm[4] = {0, 0, 0, 0}, bv[4] = {0, 0, 0, 0}, bp[4] = {0, 0, 0, 0};
  if (f.rounding == StateRounding::kStochastic) {
    const uint32_t lo = static_cast<uint32_t>(static_cast<uint64_t>(t.index0 + e));
    for (int j = 0; j < 4; ++j) {
      if (f.master != DType::kF32) bp[j] = RoundingBits(keys.master, lo + static_cast<uint32_t>(j));
      if (f.moments != DType::kF32) {
        bm[j] = RoundingBits(keys.moments, lo + static_cast<uint32_t>(j));  // m: low 16 bits, v: high 16
        bv[j] = bm[j] >> 16;
      }
    }
  }
  Store4State(t.master, f.master, f.rounding, e, p, bp);
  Store4State(t.exp_avg, f.moments, f.rounding, e, m, bm);
  Store4State(t.exp_avg_sq, f.moments, f.rounding, e, v, bv);
  if (t.param != nullptr) {
    float out[4];
    if (f.master != DType::kF32) {
      Load4(t.master, f.master, e, out);  // the rounded master (its own bits for a bf16 param)
    } else {
      for (int j = 0; j < 4; ++j) out[j] = p[j];
    }
    if (t.param_vec != 0) {
      Store4(t.param, t.param_dtype, e, out);
    } else {
      for (int j = 0; j < 4; ++j) StoreFromF32(t.param, t.param_dtype, static_cast<size_t>(e + j), out[j]);
    }
  }
}

// One chunk [begin, end) of a tensor with typed state.
__device__ __forceinline__ void ChunkTyped(const AdamScalars& s, const AdamTensorDesc& t, int64_t begin, int64_t end) {
  const int64_t tid = threadIdx.x;
  const uint32_t chunk_hi = static_cast<uint32_t>(static_cast<uint64_t>(t.index0 + begin) >> 32);
  const StateKindKeys keys =
      (t.state & kAdamStochastic) != 0 ? KindKeysFor(t.round_key, chunk_hi) : StateKindKeys{0, 0};
  const bool one_hi = static_cast<uint32_t>(static_cast<uint64_t>(t.index0 + end - 1) >> 32) == chunk_hi;
  if (t.vec_head != kAdamNoVector && one_hi) {
    const int64_t first_group = begin + t.vec_head < end ? begin + t.vec_head : end;
    if (begin + tid < first_group) ElementTyped(s, t, begin + tid, keys, chunk_hi);
    const int64_t groups = (end - first_group) / 4;
    for (int64_t q = tid; q < groups; q += blockDim.x) Group4Typed(s, t, first_group + 4 * q, keys);
    const int64_t tail = first_group + 4 * groups;
    if (tail + tid < end) ElementTyped(s, t, tail + tid, keys, chunk_hi);
  } else {
    for (int64_t i = begin + tid; i < end; i += blockDim.x) ElementTyped(s, t, i, keys, chunk_hi);
  }
}

// The fused kernel's body. kTyped: the launch has tensors with bf16 state (AdamLaunchIsTyped).
template <bool kTyped>
__device__ __forceinline__ void AdamKernelBody(const AdamLaunchParams& p) {
  // A gradient check that found NaN or Inf skips the whole step: nothing is written.
  if (p.grad_stats != nullptr && p.grad_stats->found_inf != 0) return;
  // The scalar sets with the values read now (learning rates, step counts, the gradient multiplier),
  // once per block.
  __shared__ AdamScalars scalars[kAdamMaxScalars];
  if (static_cast<int>(threadIdx.x) < p.num_scalars) {
    AdamScalars s = p.scalars[threadIdx.x];
    const bool set_multiplier = p.grad_scale != nullptr || p.max_grad_norm > 0.0f;
    float multiplier = 1.0f;
    if (set_multiplier) {
      multiplier = AdamGradMultiplier(p.grad_scale != nullptr ? *p.grad_scale : 1.0f,
                                      p.grad_stats != nullptr ? p.grad_stats->sum_sq : 0.0, p.max_grad_norm);
    }
    const uint32_t global = p.scalars_global[threadIdx.x];
    AdamApplyRuntime(s, p.lr != nullptr ? p.lr + global : nullptr,
                     p.step != nullptr ? p.step + global : nullptr, set_multiplier ? &multiplier : nullptr);
    scalars[threadIdx.x] = s;
  }
  __syncthreads();

  const int64_t tid = threadIdx.x;
  for (int64_t chunk = blockIdx.x; chunk < p.total_chunks; chunk += gridDim.x) {
    // The tensor owning `chunk`: the last one whose first_chunk <= chunk.
    int lo = 0;
    int hi = p.num_tensors - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.tensors[mid].first_chunk <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const AdamTensorDesc& t = p.tensors[lo];
    const AdamScalars& s = scalars[t.scalars_index];
    const int64_t begin = (chunk - t.first_chunk) * kAdamChunkElems;
    const int64_t end = begin + kAdamChunkElems < t.numel ? begin + kAdamChunkElems : t.numel;
    if constexpr (kTyped) {
      if (t.state != 0) {
        ChunkTyped(s, t, begin, end);
        continue;
      }
    }
    if (t.vec_head != kAdamNoVector) {
      // Chunks start at multiples of 4 elements, so each has the same head.
      const int64_t first_group = begin + t.vec_head < end ? begin + t.vec_head : end;
      if (begin + tid < first_group) Element(s, t, begin + tid);
      const int64_t groups = (end - first_group) / 4;
      for (int64_t q = tid; q < groups; q += blockDim.x) Group4(s, t, first_group + 4 * q);
      const int64_t tail = first_group + 4 * groups;
      if (tail + tid < end) Element(s, t, tail + tid);
    } else {
      for (int64_t i = begin + tid; i < end; i += blockDim.x) Element(s, t, i);
    }
  }
}

// Launches without bf16 state: the kernel as it was before typed state (its registers, and so its
// occupancy, unchanged).
__global__ void __launch_bounds__(kAdamThreads) AdamKernel(const AdamLaunchParams p) { AdamKernelBody<false>(p); }

// Launches with bf16 state: held to 64 registers (4 blocks of 256 threads per SM, no spills on sm_80
// and sm_90), for the occupancy a memory-bound kernel needs.
__global__ void __launch_bounds__(kAdamThreads, 4) AdamKernelTyped(const AdamLaunchParams p) {
  AdamKernelBody<true>(p);
}

__global__ void AdamAdvanceStepsKernel(int64_t* steps, int n, const GradStats* grad_stats) {
  if (grad_stats != nullptr && grad_stats->found_inf != 0) return;
  for (int i = threadIdx.x; i < n; i += blockDim.x) steps[i] += 1;
}

// ---- the gradient check ----

__global__ void GradStatsUploadKernel(const GradStatsUpload u, GradStatsDesc* table) {
  for (int i = threadIdx.x; i < u.count; i += blockDim.x) table[u.first + i] = u.tensors[i];
}

// One element of the gradient check: NaN and Inf set `bad` and add nothing.
__device__ __forceinline__ void SquareInto(float x, ExactSquareExpansion& acc, ExactSumSq& spill, bool& bad) {
  if (exact_sum_internal::NonFiniteBits(F32Bits(x))) {
    bad = true;
    return;
  }
  acc.AddSquare(x, spill);
}

constexpr int kWarps = kGradStatsThreads / 32;
constexpr int kDigits = ExactSumSq::kDigits;

// Sums v[] and `bad` over the block: thread d < kDigits writes digit d of the total to `total[d]`
// (shared memory); returns whether any thread's `bad` was set. Every thread of the block calls it.
__device__ __forceinline__ bool BlockSumDigits(const int64_t (&v)[kDigits], bool bad, int64_t* total) {
  __shared__ int64_t warp_digits[kWarps][kDigits];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < kDigits; ++i) {
    int64_t x = v[i];
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
    if (lane == 0) warp_digits[warp][i] = x;
  }
  const bool any_bad = __syncthreads_or(bad ? 1 : 0) != 0;  // also the barrier for warp_digits
  if (threadIdx.x < kDigits) {
    int64_t x = 0;
    for (int w = 0; w < kWarps; ++w) x += warp_digits[w][threadIdx.x];
    total[threadIdx.x] = x;
  }
  return any_bad;
}

// Each thread sums its elements exactly: 4 groups of 4 elements per chunk, through an expansion that
// spills into a thread-local ExactSumSq; the block's digits go to partials[blockIdx.x].
__global__ void __launch_bounds__(kGradStatsThreads)
    GradStatsPartialKernel(const GradStatsDesc* table, int32_t num_tensors, int64_t total_chunks,
                           GradStatsPartial* partials) {
  ExactSquareExpansion acc;
  acc.Clear();
  ExactSumSq spill;
  spill.Clear();
  bool bad = false;
  const int t = threadIdx.x;
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    int lo = 0;  // the tensor owning chunk c: the last whose first_chunk <= c
    int hi = num_tensors - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table[mid].first_chunk <= c) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const GradStatsDesc d = table[lo];
    const DType dtype = static_cast<DType>(d.dtype);
    const int64_t e0 = (c - d.first_chunk) * kGradStatsChunkElems;
    const int64_t len = d.numel - e0 < kGradStatsChunkElems ? d.numel - e0 : kGradStatsChunkElems;
    if (d.vector != 0 && len == kGradStatsChunkElems) {
      float x[4][4];  // every load in flight before the arithmetic
#pragma unroll
      for (int k = 0; k < 4; ++k) Load4(d.grad, dtype, e0 + 1024 * k + 4 * t, x[k]);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int j = 0; j < 4; ++j) SquareInto(x[k][j], acc, spill, bad);
      }
    } else {
      for (int k = 0; k < 4; ++k) {
        const int64_t e = 1024 * k + 4 * t;
        if (d.vector != 0 && e + 4 <= len) {
          float x[4];
          Load4(d.grad, dtype, e0 + e, x);
          for (int j = 0; j < 4; ++j) SquareInto(x[j], acc, spill, bad);
        } else {
          for (int j = 0; j < 4; ++j) {
            if (e + j < len) {
              SquareInto(LoadAsF32(d.grad, dtype, static_cast<size_t>(e0 + e + j)), acc, spill, bad);
            }
          }
        }
      }
    }
  }
  acc.FlushInto(spill);
  spill.Normalize();  // digits in [0, 2^32): the block's sums stay below 2^40
  __shared__ int64_t total[kDigits];
  const bool any_bad = BlockSumDigits(spill.digit, bad, total);
  if (t < kDigits) partials[blockIdx.x].digit[t] = total[t];
  if (t == 0) {
    partials[blockIdx.x].found_inf = any_bad ? 1u : 0u;
    partials[blockIdx.x].reserved = 0;
  }
}

// One block: the sum of partials[0 .. n) (below 2^50 per digit) into the result.
__global__ void __launch_bounds__(kGradStatsThreads)
    GradStatsFinishKernel(const GradStatsPartial* partials, int n, GradStats* result) {
  int64_t v[kDigits];
#pragma unroll
  for (int i = 0; i < kDigits; ++i) v[i] = 0;
  bool bad = false;
  for (int b = threadIdx.x; b < n; b += blockDim.x) {
#pragma unroll
    for (int i = 0; i < kDigits; ++i) v[i] += partials[b].digit[i];
    bad = bad || partials[b].found_inf != 0;
  }
  __shared__ int64_t total[kDigits];
  const bool any_bad = BlockSumDigits(v, bad, total);
  __syncthreads();
  if (threadIdx.x == 0) {
    ExactSumSq sum;
    for (int i = 0; i < kDigits; ++i) sum.digit[i] = total[i];
    sum.pending = 0;
    sum.Normalize();
    *result = GradStatsFromExact(sum, any_bad);
  }
}

}  // namespace

cudaError_t LaunchAdamKernel(const AdamLaunchParams& params, int grid, cudaStream_t stream) {
  if (AdamLaunchIsTyped(params)) {
    AdamKernelTyped<<<grid, kAdamThreads, 0, stream>>>(params);
  } else {
    AdamKernel<<<grid, kAdamThreads, 0, stream>>>(params);
  }
  return cudaGetLastError();
}

cudaError_t LaunchAdamAdvanceSteps(int64_t* steps, int n, const GradStats* grad_stats, cudaStream_t stream) {
  AdamAdvanceStepsKernel<<<1, 256, 0, stream>>>(steps, n, grad_stats);
  return cudaGetLastError();
}

namespace {

template <typename Kernel>
int BlocksPerSm(Kernel kernel) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kAdamThreads, 0) != cudaSuccess) {
    (void)cudaGetLastError();  // an estimate only: fall back to what 2048 threads per SM allow
    return 2048 / kAdamThreads;
  }
  return blocks > 0 ? blocks : 1;
}

}  // namespace

int AdamKernelBlocksPerSm(bool typed) {
  static const int fp32 = BlocksPerSm(AdamKernel);
  static const int with_typed = BlocksPerSm(AdamKernelTyped);
  return typed ? with_typed : fp32;
}

cudaError_t LaunchGradStatsUpload(const GradStatsUpload& upload, GradStatsDesc* table, cudaStream_t stream) {
  GradStatsUploadKernel<<<1, 256, 0, stream>>>(upload, table);
  return cudaGetLastError();
}

int GradStatsBlocksPerSm() {
  static const int blocks_per_sm = [] {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, GradStatsPartialKernel, kGradStatsThreads, 0) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // an estimate only
      return 2048 / kGradStatsThreads;
    }
    return blocks > 0 ? blocks : 1;
  }();
  return blocks_per_sm;
}

cudaError_t LaunchGradStatsKernels(const GradStatsDesc* table, int32_t num_tensors, int64_t total_chunks,
                                   GradStatsPartial* partials, GradStats* result, int grid,
                                   cudaStream_t stream) {
  GradStatsPartialKernel<<<grid, kGradStatsThreads, 0, stream>>>(table, num_tensors, total_chunks, partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  GradStatsFinishKernel<<<1, kGradStatsThreads, 0, stream>>>(partials, grid, result);
  return cudaGetLastError();
}

}  // namespace ferry::cuda_kernels
