// CpuAdam's AVX-512 element loops (F, BW, VL, DQ; the bf16 variant adds AVX512-BF16), 16 elements
// per vector, masked loads and stores for partial vectors.
//
// Only the code between the target pragmas is built for AVX-512, and all of it has internal linkage,
// so no inline function shared with the rest of the program is ever compiled for an ISA the CPU may
// lack. The update itself is base/adam_update.inc's template compiled for F32x16.
#include "optim/cpu_adam_kernels.h"

#if defined(__x86_64__)

// GCC 12's AVX-512 intrinsics make their "undefined" vectors by self-initialisation, which its own
// -Wuninitialized then reports where they are inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "base/adam_element.h"
#include "base/adam_math.h"
#include "base/adam_state.h"
#include "ferry/dtype.h"

namespace ferry::cpu_adam_internal {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

// ---- the vector type of the generic update ----

// In a namespace of their own, so the update is called qualified (simd::AdamUpdateGeneric): ADL
// through AdamCoeffs would also find ferry::AdamUpdateGeneric, the float one's template.
namespace simd {

struct F32x16 {
  __m512 v;
};
inline F32x16 AdamMul(F32x16 a, F32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F32x16 AdamFma(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F32x16 AdamSqrt(F32x16 a) { return {_mm512_sqrt_ps(a.v)}; }
inline F32x16 AdamDiv(F32x16 a, F32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }

#include "base/adam_update.inc"

}  // namespace simd

using simd::F32x16;

AdamCoeffs<F32x16> Broadcast(const AdamScalars& s) {
  const AdamCoeffs<float> f = AdamCoeffsOf(s);
  AdamCoeffs<F32x16> c;
  c.grad_multiplier.v = _mm512_set1_ps(f.grad_multiplier);
  c.weight_decay.v = _mm512_set1_ps(f.weight_decay);
  c.beta1.v = _mm512_set1_ps(f.beta1);
  c.one_minus_beta1.v = _mm512_set1_ps(f.one_minus_beta1);
  c.beta2.v = _mm512_set1_ps(f.beta2);
  c.one_minus_beta2.v = _mm512_set1_ps(f.one_minus_beta2);
  c.inv_bias_correction1.v = _mm512_set1_ps(f.inv_bias_correction1);
  c.inv_sqrt_bias_correction2.v = _mm512_set1_ps(f.inv_sqrt_bias_correction2);
  c.eps.v = _mm512_set1_ps(f.eps);
  c.neg_lr.v = _mm512_set1_ps(f.neg_lr);
  return c;
}

// ---- dtype conversions, equal to ferry/dtype.h bit for bit ----

constexpr int kNoParam = -1;  // template argument: no param output
constexpr int kF32 = static_cast<int>(DType::kF32);
constexpr int kBF16 = static_cast<int>(DType::kBF16);

inline __mmask16 FirstLanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// Elements i .. i+15 of `grad` (lanes outside `k` read nothing and are zero).
template <int G>
inline __m512 LoadGrad(const void* grad, int64_t i, __mmask16 k) {
  if constexpr (G == kF32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(grad) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(grad) + i);
    if constexpr (G == kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);  // exact for every binary16 value
    }
  }
}

// F32ToBF16 in integer arithmetic: NaN -> quiet NaN with the sign and top payload; otherwise round to
// nearest even on the top 16 bits (overflow carries into the exponent: infinity).
inline __m256i Bf16Software(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// VCVTNEPS2BF16 rounds to nearest even and quiets NaN exactly as F32ToBF16 does, but treats subnormal
// inputs as zero; lanes holding one (rare) take the integer conversion instead.
inline __m256i Bf16Hardware(__m512 x) {
  __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  const __m512i abs = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
  const __mmask16 subnormal =
      _mm512_mask_cmplt_epi32_mask(_mm512_test_epi32_mask(abs, abs), abs, _mm512_set1_epi32(0x00800000));
  if (subnormal != 0) r = _mm256_mask_blend_epi16(subnormal, r, Bf16Software(x));
  return r;
}

template <int P, bool kHwBf16>
inline __m256i To16(__m512 p) {
  if constexpr (P == kBF16) {
    if constexpr (kHwBf16) {
      return Bf16Hardware(p);
    } else {
      return Bf16Software(p);
    }
  } else {
    // F16C rounding per the immediate (nearest even), independent of MXCSR's rounding mode; subnormal
    // inputs are honoured because the caller runs with DAZ off.
    return _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

template <int P, bool kHwBf16>
inline void StoreParamMasked(void* param, int64_t i, __m512 p, __mmask16 k) {
  if constexpr (P == kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(param) + i, k, p);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(param) + i, k, To16<P, kHwBf16>(p));
  }
}

// REQUIRES: param + i aligned to the store's 64 (f32) or 32 (16-bit) bytes.
template <int P, bool kHwBf16>
inline void StoreParamStreaming(void* param, int64_t i, __m512 p) {
  if constexpr (P == kF32) {
    _mm512_stream_ps(static_cast<float*>(param) + i, p);
  } else {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(param) + i), To16<P, kHwBf16>(p));
  }
}

// ---- the update loop ----

template <AdamMode M, int G, int P, bool kHwBf16, bool kStream>
inline void Block(const AdamCoeffs<F32x16>& c, const CpuAdamTensor& t, int64_t i, __mmask16 k) {
  float* const master = static_cast<float*>(t.master);
  float* const exp_avg = static_cast<float*>(t.exp_avg);
  float* const exp_avg_sq = static_cast<float*>(t.exp_avg_sq);
  F32x16 p{_mm512_maskz_loadu_ps(k, static_cast<const float*>(t.master_src) + i)};
  F32x16 m{_mm512_maskz_loadu_ps(k, static_cast<const float*>(t.exp_avg_src) + i)};
  F32x16 v{_mm512_maskz_loadu_ps(k, static_cast<const float*>(t.exp_avg_sq_src) + i)};
  const F32x16 g{LoadGrad<G>(t.grad, i, k)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  _mm512_mask_storeu_ps(master + i, k, p.v);
  _mm512_mask_storeu_ps(exp_avg + i, k, m.v);
  _mm512_mask_storeu_ps(exp_avg_sq + i, k, v.v);
  if constexpr (P != kNoParam) {
    if constexpr (kStream) {
      StoreParamStreaming<P, kHwBf16>(t.param, i, p.v);
    } else {
      StoreParamMasked<P, kHwBf16>(t.param, i, p.v, k);
    }
  }
}

// Out of place, 16 whole lanes: the new state is written once and not read here again, so streaming
// stores skip reading its lines first (12 B per element of traffic). REQUIRES: master + i, exp_avg + i
// and exp_avg_sq + i aligned to 64 bytes. The param takes ordinary stores.
template <AdamMode M, int G, int P, bool kHwBf16>
inline void BlockOut(const AdamCoeffs<F32x16>& c, const CpuAdamTensor& t, int64_t i) {
  const __mmask16 all = static_cast<__mmask16>(0xFFFF);
  F32x16 p{_mm512_loadu_ps(static_cast<const float*>(t.master_src) + i)};
  F32x16 m{_mm512_loadu_ps(static_cast<const float*>(t.exp_avg_src) + i)};
  F32x16 v{_mm512_loadu_ps(static_cast<const float*>(t.exp_avg_sq_src) + i)};
  const F32x16 g{LoadGrad<G>(t.grad, i, all)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  _mm512_stream_ps(static_cast<float*>(t.master) + i, p.v);
  _mm512_stream_ps(static_cast<float*>(t.exp_avg) + i, m.v);
  _mm512_stream_ps(static_cast<float*>(t.exp_avg_sq) + i, v.v);
  if constexpr (P != kNoParam) StoreParamMasked<P, kHwBf16>(t.param, i, p.v, all);
}

template <AdamMode M, int G, int P, bool kHwBf16>
void Range(const CpuAdamTensor& t_in, const AdamScalars& s, int64_t begin, int64_t end) {
  const AdamCoeffs<F32x16> c = Broadcast(s);
  const CpuAdamTensor t = WithSources(t_in);
  int64_t i = begin;
  const uintptr_t m0 = reinterpret_cast<uintptr_t>(t.master) + static_cast<uintptr_t>(i * 4);
  const uintptr_t m1 = reinterpret_cast<uintptr_t>(t.exp_avg) + static_cast<uintptr_t>(i * 4);
  const uintptr_t m2 = reinterpret_cast<uintptr_t>(t.exp_avg_sq) + static_cast<uintptr_t>(i * 4);
  if (t_in.master_src != nullptr && m0 % 64 == m1 % 64 && m0 % 64 == m2 % 64) {
    // Out of place with the three outputs in the same phase (the optimizer's spare buffers are):
    // masked blocks up to their next 64-byte boundary, then streaming stores of the state.
    int64_t head = static_cast<int64_t>((64 - m0 % 64) % 64) / 4;
    if (head > end - i) head = end - i;
    if (head > 0) {
      Block<M, G, P, kHwBf16, false>(c, t, i, FirstLanes(head));
      i += head;
    }
    for (; i + 16 <= end; i += 16) BlockOut<M, G, P, kHwBf16>(c, t, i);
    if (i < end) Block<M, G, P, kHwBf16, false>(c, t, i, FirstLanes(end - i));
    _mm_sfence();  // streaming stores are visible before the task ends
    return;
  }
  if constexpr (P != kNoParam) {
    // The param is only written: streaming stores skip reading its lines first (2-4 bytes per element
    // of memory traffic). They need aligned lines, so the elements up to the param's next 64-byte
    // boundary take ordinary masked stores.
    int64_t head = ElementsBeforeLine(t.param, P == kF32 ? 4 : 2, i, end);
    while (head > 0) {
      const int64_t n = head < 16 ? head : 16;
      Block<M, G, P, kHwBf16, false>(c, t, i, FirstLanes(n));
      i += n;
      head -= n;
    }
  }
  for (; i + 16 <= end; i += 16) Block<M, G, P, kHwBf16, true>(c, t, i, static_cast<__mmask16>(0xFFFF));
  if (i < end) Block<M, G, P, kHwBf16, false>(c, t, i, FirstLanes(end - i));
  if constexpr (P != kNoParam) _mm_sfence();  // streaming stores are visible before the task ends
}

// ---- the param alone (CpuAdamTensor::param_only; fp32 state, in place) ----

// Elements i .. i+15 of `grad`, as stored, to `copy` (lanes outside `k` untouched). kStream REQUIRES
// copy + i aligned to the 16 elements' bytes.
template <int G, bool kStream>
inline void CopyGrad(const void* grad, void* copy, int64_t i, __mmask16 k) {
  if constexpr (G == kF32) {
    const __m512 x = _mm512_maskz_loadu_ps(k, static_cast<const float*>(grad) + i);
    if constexpr (kStream) {
      _mm512_stream_ps(static_cast<float*>(copy) + i, x);
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(copy) + i, k, x);
    }
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(grad) + i);
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(copy) + i), h);
    } else {
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(copy) + i, k, h);
    }
  }
}

// The state read, the update computed, the param (and the grad's copy) written. kStream REQUIRES the
// param's and the copy's lines aligned as StoreParamStreaming and CopyGrad say.
template <AdamMode M, int G, int P, bool kHwBf16, bool kStream>
inline void BlockParamOnly(const AdamCoeffs<F32x16>& c, const CpuAdamTensor& t, int64_t i, __mmask16 k) {
  F32x16 p{_mm512_maskz_loadu_ps(k, static_cast<const float*>(t.master) + i)};
  F32x16 m{_mm512_maskz_loadu_ps(k, static_cast<const float*>(t.exp_avg) + i)};
  F32x16 v{_mm512_maskz_loadu_ps(k, static_cast<const float*>(t.exp_avg_sq) + i)};
  const F32x16 g{LoadGrad<G>(t.grad, i, k)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  if constexpr (kStream) {
    StoreParamStreaming<P, kHwBf16>(t.param, i, p.v);
  } else {
    StoreParamMasked<P, kHwBf16>(t.param, i, p.v, k);
  }
  if (t.grad_copy != nullptr) CopyGrad<G, kStream>(t.grad, t.grad_copy, i, k);
}

// Both outputs are only written: streaming stores once the param's lines are aligned, when the copy's
// are then too (else ordinary stores for both).
template <AdamMode M, int G, int P, bool kHwBf16>
void RangeParamOnly(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end) {
  const AdamCoeffs<F32x16> c = Broadcast(s);
  constexpr int64_t kGradSize = G == kF32 ? 4 : 2;
  int64_t i = begin;
  int64_t head = ElementsBeforeLine(t.param, P == kF32 ? 4 : 2, i, end);
  while (head > 0) {
    const int64_t n = head < 16 ? head : 16;
    BlockParamOnly<M, G, P, kHwBf16, false>(c, t, i, FirstLanes(n));
    i += n;
    head -= n;
  }
  const bool lined = t.grad_copy == nullptr ||
                     (reinterpret_cast<uintptr_t>(t.grad_copy) + static_cast<uintptr_t>(i * kGradSize)) %
                             static_cast<uintptr_t>(16 * kGradSize) == 0;
  const __mmask16 all = static_cast<__mmask16>(0xFFFF);
  if (lined) {
    for (; i + 16 <= end; i += 16) BlockParamOnly<M, G, P, kHwBf16, true>(c, t, i, all);
  } else {
    for (; i + 16 <= end; i += 16) BlockParamOnly<M, G, P, kHwBf16, false>(c, t, i, all);
  }
  if (i < end) BlockParamOnly<M, G, P, kHwBf16, false>(c, t, i, FirstLanes(end - i));
  _mm_sfence();  // streaming stores are visible before the task ends
}

// ---- typed state (bf16 master and/or moments; base/adam_state.h) ----

// The state format as a template argument: which tensors are bf16 and whether rounding is stochastic.
constexpr int kMasterBf16 = 1;
constexpr int kMomentsBf16 = 2;
constexpr int kStochastic = 4;

template <bool kBf16>
inline __m512 LoadState(const void* base, int64_t i, __mmask16 k) {
  if constexpr (kBf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(base) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(base) + i);
  }
}

// RoundingMix32 per lane.
inline __m512i Mix32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x7feb352du)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// RoundingBits(key, lo) per lane.
inline __m512i RandomWords(__m512i lo, uint32_t key) {
  return Mix32(_mm512_xor_si512(lo, _mm512_set1_epi32(static_cast<int>(key))));
}

// F32ToBF16Stochastic per lane with the low 16 bits of `bits`.
inline __m256i Bf16Stochastic(__m512 x, __m512i bits) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_and_si512(bits, _mm512_set1_epi32(0xffff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// `bits`: the lanes' random words (used only by stochastic rounding).
template <bool kSr, bool kHwBf16>
inline __m256i StateBf16(__m512 x, __m512i bits) {
  if constexpr (kSr) {
    return Bf16Stochastic(x, bits);
  } else {
    return To16<kBF16, kHwBf16>(x);
  }
}

template <bool kBf16, bool kSr, bool kHwBf16>
inline void StoreState(void* base, int64_t i, __m512 x, __mmask16 k, __m512i bits) {
  if constexpr (kBf16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(base) + i, k, StateBf16<kSr, kHwBf16>(x, bits));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(base) + i, k, x);
  }
}

// StoreState with a streaming store of 16 whole lanes. REQUIRES: base + i aligned to 16 elements' bytes.
template <bool kBf16, bool kSr, bool kHwBf16>
inline void StreamState(void* base, int64_t i, __m512 x, __m512i bits) {
  if constexpr (kBf16) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), StateBf16<kSr, kHwBf16>(x, bits));
  } else {
    _mm512_stream_ps(static_cast<float*>(base) + i, x);
  }
}

// `lo`: the low words of the 16 elements' global indices. With a bf16 master, P is kBF16 or
// kNoParam: the param takes the master's bits.
template <AdamMode M, int G, int P, int SF, bool kHwBf16, bool kStream>
inline void BlockTyped(const AdamCoeffs<F32x16>& c, const CpuAdamTensor& t, int64_t i, __mmask16 k, __m512i lo,
                       const StateKindKeys& keys) {
  constexpr bool kM16 = (SF & kMasterBf16) != 0;
  constexpr bool kV16 = (SF & kMomentsBf16) != 0;
  constexpr bool kSr = (SF & kStochastic) != 0;
  F32x16 p{LoadState<kM16>(t.master_src, i, k)};
  F32x16 m{LoadState<kV16>(t.exp_avg_src, i, k)};
  F32x16 v{LoadState<kV16>(t.exp_avg_sq_src, i, k)};
  const F32x16 g{LoadGrad<G>(t.grad, i, k)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  if constexpr (kM16) {
    const __m256i h = StateBf16<kSr, kHwBf16>(p.v, kSr ? RandomWords(lo, keys.master) : lo);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(t.master) + i, k, h);
    if constexpr (P != kNoParam) {
      if constexpr (kStream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(t.param) + i), h);
      } else {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(t.param) + i, k, h);
      }
    }
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(t.master) + i, k, p.v);
    if constexpr (P != kNoParam) {
      if constexpr (kStream) {
        StoreParamStreaming<P, kHwBf16>(t.param, i, p.v);
      } else {
        StoreParamMasked<P, kHwBf16>(t.param, i, p.v, k);
      }
    }
  }
  const __m512i moment_bits = kSr && kV16 ? RandomWords(lo, keys.moments) : lo;  // m: low 16, v: high 16
  StoreState<kV16, kSr, kHwBf16>(t.exp_avg, i, m.v, k, moment_bits);
  StoreState<kV16, kSr, kHwBf16>(t.exp_avg_sq, i, v.v, k, _mm512_srli_epi32(moment_bits, 16));
}

// Out of place, 16 whole lanes: the new state is written once and not read here again, so streaming
// stores skip reading its lines first (as BlockOut for fp32 state). REQUIRES: master + i, exp_avg + i
// and exp_avg_sq + i aligned to 16 of their elements. The param takes ordinary stores.
template <AdamMode M, int G, int P, int SF, bool kHwBf16>
inline void BlockTypedOut(const AdamCoeffs<F32x16>& c, const CpuAdamTensor& t, int64_t i, __m512i lo,
                          const StateKindKeys& keys) {
  constexpr bool kM16 = (SF & kMasterBf16) != 0;
  constexpr bool kV16 = (SF & kMomentsBf16) != 0;
  constexpr bool kSr = (SF & kStochastic) != 0;
  const __mmask16 all = static_cast<__mmask16>(0xFFFF);
  F32x16 p{LoadState<kM16>(t.master_src, i, all)};
  F32x16 m{LoadState<kV16>(t.exp_avg_src, i, all)};
  F32x16 v{LoadState<kV16>(t.exp_avg_sq_src, i, all)};
  const F32x16 g{LoadGrad<G>(t.grad, i, all)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  if constexpr (kM16) {
    const __m256i h = StateBf16<kSr, kHwBf16>(p.v, kSr ? RandomWords(lo, keys.master) : lo);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(t.master) + i), h);
    if constexpr (P != kNoParam) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(t.param) + i, all, h);
  } else {
    _mm512_stream_ps(static_cast<float*>(t.master) + i, p.v);
    if constexpr (P != kNoParam) StoreParamMasked<P, kHwBf16>(t.param, i, p.v, all);
  }
  const __m512i moment_bits = kSr && kV16 ? RandomWords(lo, keys.moments) : lo;  // m: low 16, v: high 16
  StreamState<kV16, kSr, kHwBf16>(t.exp_avg, i, m.v, moment_bits);
  StreamState<kV16, kSr, kHwBf16>(t.exp_avg_sq, i, v.v, _mm512_srli_epi32(moment_bits, 16));
}

template <AdamMode M, int G, int P, int SF, bool kHwBf16>
void RangeTyped(const CpuAdamTensor& t_in, const AdamScalars& s, int64_t begin, int64_t end) {
  const AdamCoeffs<F32x16> c = Broadcast(s);
  const CpuAdamTensor t = WithSources(t_in);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t i = begin;
  while (i < end) {
    // A stretch of global indices sharing their high word (all of the range but for > 2^32 elements).
    const uint64_t g0 = static_cast<uint64_t>(t.rounding.index0 + i);
    const uint64_t room = (uint64_t{1} << 32) - (g0 & 0xffffffffull);
    const int64_t stop = static_cast<uint64_t>(end - i) < room ? end : i + static_cast<int64_t>(room);
    const StateKindKeys keys = (SF & kStochastic) != 0 ? KindKeysFor(t.rounding.tensor_key, static_cast<uint32_t>(g0 >> 32))
                                                       : StateKindKeys{0, 0};
    const uint32_t lo0 = static_cast<uint32_t>(g0);
    const int64_t seg = i;
    auto lo_at = [&](int64_t at) {
      return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo0 + static_cast<uint32_t>(at - seg))), lanes);
    };
    int64_t at = i;
    if (t_in.master_src != nullptr) {
      // Out of place (a speculative step writing the spare buffers): when the three outputs reach
      // their 16-element alignment at the same element, masked blocks up to it, then streaming stores
      // of the state, so the update moves the bytes of an in-place one. The same bits either way.
      constexpr int64_t kMs = (SF & kMasterBf16) != 0 ? 2 : 4;
      constexpr int64_t kVs = (SF & kMomentsBf16) != 0 ? 2 : 4;
      const uintptr_t master = reinterpret_cast<uintptr_t>(t.master) + static_cast<uintptr_t>(at * kMs);
      const int64_t head = master % kMs != 0 ? -1
                           : static_cast<int64_t>((16 * kMs - master % (16 * kMs)) % (16 * kMs)) / kMs;
      auto lined = [&](void* base, int64_t e) {
        return (reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(e * kVs)) % (16 * kVs) == 0;
      };
      if (head >= 0 && head < stop - at && lined(t.exp_avg, at + head) && lined(t.exp_avg_sq, at + head)) {
        for (int64_t left = head; left > 0;) {
          const int64_t n = left < 16 ? left : 16;
          BlockTyped<M, G, P, SF, kHwBf16, false>(c, t, at, FirstLanes(n), lo_at(at), keys);
          at += n;
          left -= n;
        }
        for (; at + 16 <= stop; at += 16) BlockTypedOut<M, G, P, SF, kHwBf16>(c, t, at, lo_at(at), keys);
        if (at < stop) BlockTyped<M, G, P, SF, kHwBf16, false>(c, t, at, FirstLanes(stop - at), lo_at(at), keys);
        _mm_sfence();  // streaming stores are visible before the task ends
        i = stop;
        continue;
      }
    }
    if constexpr (P != kNoParam) {
      // Streaming stores need aligned lines: the elements up to the param's next 64-byte boundary take
      // ordinary masked stores.
      int64_t head = ElementsBeforeLine(t.param, P == kF32 ? 4 : 2, at, stop);
      while (head > 0) {
        const int64_t n = head < 16 ? head : 16;
        BlockTyped<M, G, P, SF, kHwBf16, false>(c, t, at, FirstLanes(n), lo_at(at), keys);
        at += n;
        head -= n;
      }
    }
    for (; at + 16 <= stop; at += 16) {
      BlockTyped<M, G, P, SF, kHwBf16, P != kNoParam>(c, t, at, static_cast<__mmask16>(0xFFFF), lo_at(at), keys);
    }
    if (at < stop) BlockTyped<M, G, P, SF, kHwBf16, false>(c, t, at, FirstLanes(stop - at), lo_at(at), keys);
    if constexpr (P != kNoParam) _mm_sfence();  // streaming stores are visible before the task ends
    i = stop;
  }
}

template <AdamMode M, int G, int SF, bool kHwBf16>
AdamRangeFn SelectParamTyped(const CpuAdamTensor& t) {
  if ((SF & kMasterBf16) != 0) {
    // A bf16 master serves bf16 params (the policy allows nothing else); others take the scalar loop.
    if (t.param == nullptr) return &RangeTyped<M, G, kNoParam, SF, kHwBf16>;
    if (t.param_dtype == DType::kBF16) return &RangeTyped<M, G, kBF16, SF, kHwBf16>;
    return &AdamRangeScalar;
  }
  if (t.param == nullptr) return &RangeTyped<M, G, kNoParam, SF, kHwBf16>;
  switch (t.param_dtype) {
    case DType::kF32: return &RangeTyped<M, G, kF32, SF, kHwBf16>;
    case DType::kBF16: return &RangeTyped<M, G, kBF16, SF, kHwBf16>;
    case DType::kF16: break;
  }
  return &RangeTyped<M, G, static_cast<int>(DType::kF16), SF, kHwBf16>;
}

template <AdamMode M, int G, bool kHwBf16>
AdamRangeFn SelectParam(const CpuAdamTensor& t);

template <AdamMode M, int G, bool kHwBf16>
AdamRangeFn SelectState(const CpuAdamTensor& t) {
  if (t.param_only) {  // fp32 state and a param (CpuAdam::Start checked)
    switch (t.param_dtype) {
      case DType::kF32: return &RangeParamOnly<M, G, kF32, kHwBf16>;
      case DType::kBF16: return &RangeParamOnly<M, G, kBF16, kHwBf16>;
      case DType::kF16: break;
    }
    return &RangeParamOnly<M, G, static_cast<int>(DType::kF16), kHwBf16>;
  }
  int sf = (t.state.master == DType::kBF16 ? kMasterBf16 : 0) | (t.state.moments == DType::kBF16 ? kMomentsBf16 : 0);
  if (sf != 0 && t.state.rounding == StateRounding::kStochastic) sf |= kStochastic;
  switch (sf) {
    case kMasterBf16: return SelectParamTyped<M, G, kMasterBf16, kHwBf16>(t);
    case kMasterBf16 | kStochastic: return SelectParamTyped<M, G, kMasterBf16 | kStochastic, kHwBf16>(t);
    case kMomentsBf16: return SelectParamTyped<M, G, kMomentsBf16, kHwBf16>(t);
    case kMomentsBf16 | kStochastic: return SelectParamTyped<M, G, kMomentsBf16 | kStochastic, kHwBf16>(t);
    case kMasterBf16 | kMomentsBf16: return SelectParamTyped<M, G, kMasterBf16 | kMomentsBf16, kHwBf16>(t);
    case kMasterBf16 | kMomentsBf16 | kStochastic:
      return SelectParamTyped<M, G, kMasterBf16 | kMomentsBf16 | kStochastic, kHwBf16>(t);
    default: return SelectParam<M, G, kHwBf16>(t);
  }
}

template <AdamMode M, int G, bool kHwBf16>
AdamRangeFn SelectParam(const CpuAdamTensor& t) {
  if (t.param == nullptr) return &Range<M, G, kNoParam, kHwBf16>;
  switch (t.param_dtype) {
    case DType::kF32: return &Range<M, G, kF32, kHwBf16>;
    case DType::kBF16: return &Range<M, G, kBF16, kHwBf16>;
    case DType::kF16: break;
  }
  return &Range<M, G, static_cast<int>(DType::kF16), kHwBf16>;
}

template <AdamMode M, bool kHwBf16>
AdamRangeFn SelectGrad(const CpuAdamTensor& t) {
  switch (t.grad_dtype) {
    case DType::kF32: return SelectState<M, kF32, kHwBf16>(t);
    case DType::kBF16: return SelectState<M, kBF16, kHwBf16>(t);
    case DType::kF16: break;
  }
  return SelectState<M, static_cast<int>(DType::kF16), kHwBf16>(t);
}

template <bool kHwBf16>
AdamRangeFn Select(const CpuAdamTensor& t, const AdamScalars& s) {
  return s.mode == AdamMode::kAdamL2 ? SelectGrad<AdamMode::kAdamL2, kHwBf16>(t)
                                     : SelectGrad<AdamMode::kAdamW, kHwBf16>(t);
}

}  // namespace

#pragma GCC pop_options

void AdamRangeAvx512(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end) {
  Select<false>(t, s)(t, s, begin, end);
}

void AdamRangeAvx512Bf16(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end) {
  Select<true>(t, s)(t, s, begin, end);
}

}  // namespace ferry::cpu_adam_internal

#pragma GCC diagnostic pop

#endif  // defined(__x86_64__)
