// CpuAdam's AVX2 + FMA + F16C element loops, 8 elements per vector; partial vectors at the ends go to
// the scalar loop (which computes the same bits).
//
// Only the code between the target pragmas is built for AVX2, and all of it has internal linkage, so no
// inline function shared with the rest of the program is ever compiled for an ISA the CPU may lack. The
// update itself is base/adam_update.inc's template compiled for F32x8.
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
#pragma GCC target("avx2,fma,f16c")

namespace {

// ---- the vector type of the generic update ----

// In a namespace of their own, so the update is called qualified (simd::AdamUpdateGeneric): ADL
// through AdamCoeffs would also find ferry::AdamUpdateGeneric, the float one's template.
namespace simd {

struct F32x8 {
  __m256 v;
};
inline F32x8 AdamMul(F32x8 a, F32x8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F32x8 AdamFma(F32x8 a, F32x8 b, F32x8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline F32x8 AdamSqrt(F32x8 a) { return {_mm256_sqrt_ps(a.v)}; }
inline F32x8 AdamDiv(F32x8 a, F32x8 b) { return {_mm256_div_ps(a.v, b.v)}; }

#include "base/adam_update.inc"

}  // namespace simd

using simd::F32x8;

AdamCoeffs<F32x8> Broadcast(const AdamScalars& s) {
  const AdamCoeffs<float> f = AdamCoeffsOf(s);
  AdamCoeffs<F32x8> c;
  c.grad_multiplier.v = _mm256_set1_ps(f.grad_multiplier);
  c.weight_decay.v = _mm256_set1_ps(f.weight_decay);
  c.beta1.v = _mm256_set1_ps(f.beta1);
  c.one_minus_beta1.v = _mm256_set1_ps(f.one_minus_beta1);
  c.beta2.v = _mm256_set1_ps(f.beta2);
  c.one_minus_beta2.v = _mm256_set1_ps(f.one_minus_beta2);
  c.inv_bias_correction1.v = _mm256_set1_ps(f.inv_bias_correction1);
  c.inv_sqrt_bias_correction2.v = _mm256_set1_ps(f.inv_sqrt_bias_correction2);
  c.eps.v = _mm256_set1_ps(f.eps);
  c.neg_lr.v = _mm256_set1_ps(f.neg_lr);
  return c;
}

// ---- dtype conversions, equal to ferry/dtype.h bit for bit ----

constexpr int kNoParam = -1;  // template argument: no param output
constexpr int kF32 = static_cast<int>(DType::kF32);
constexpr int kBF16 = static_cast<int>(DType::kBF16);

inline __m256 Bf16x8ToF32(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int G>
inline __m256 LoadGrad(const void* grad, int64_t i) {
  if constexpr (G == kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == kBF16) {
      return Bf16x8ToF32(h);
    } else {
      return _mm256_cvtph_ps(h);  // exact for every binary16 value
    }
  }
}

// F32ToBF16 in integer arithmetic: NaN -> quiet NaN with the sign and top payload; otherwise round to
// nearest even on the top 16 bits (overflow carries into the exponent: infinity).
inline __m128i Bf16Software(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  // Every value fits 16 bits, so the saturating pack only narrows.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <int P>
inline __m128i To16(__m256 p) {
  if constexpr (P == kBF16) {
    return Bf16Software(p);
  } else {
    // F16C rounding per the immediate (nearest even), independent of MXCSR's rounding mode; subnormal
    // inputs are honoured because the caller runs with DAZ off.
    return _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// kStream REQUIRES param + i aligned to 32 (f32) or 16 (16-bit) bytes.
template <int P, bool kStream>
inline void StoreParam(void* param, int64_t i, __m256 p) {
  if constexpr (P == kF32) {
    float* dst = static_cast<float*>(param) + i;
    if constexpr (kStream) {
      _mm256_stream_ps(dst, p);
    } else {
      _mm256_storeu_ps(dst, p);
    }
  } else {
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(param) + i);
    if constexpr (kStream) {
      _mm_stream_si128(dst, To16<P>(p));
    } else {
      _mm_storeu_si128(dst, To16<P>(p));
    }
  }
}

// ---- the update loop ----

template <AdamMode M, int G, int P, bool kStream>
inline void Block(const AdamCoeffs<F32x8>& c, const CpuAdamTensor& t, int64_t i) {
  float* const master = static_cast<float*>(t.master);
  float* const exp_avg = static_cast<float*>(t.exp_avg);
  float* const exp_avg_sq = static_cast<float*>(t.exp_avg_sq);
  F32x8 p{_mm256_loadu_ps(static_cast<const float*>(t.master_src) + i)};
  F32x8 m{_mm256_loadu_ps(static_cast<const float*>(t.exp_avg_src) + i)};
  F32x8 v{_mm256_loadu_ps(static_cast<const float*>(t.exp_avg_sq_src) + i)};
  const F32x8 g{LoadGrad<G>(t.grad, i)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  _mm256_storeu_ps(master + i, p.v);
  _mm256_storeu_ps(exp_avg + i, m.v);
  _mm256_storeu_ps(exp_avg_sq + i, v.v);
  if constexpr (P != kNoParam) StoreParam<P, kStream>(t.param, i, p.v);
}

// Out of place, 8 whole lanes: the new state is written once and not read here again, so streaming
// stores skip reading its lines first (12 B per element of traffic). REQUIRES: master + i, exp_avg + i
// and exp_avg_sq + i aligned to 32 bytes. The param takes ordinary stores.
template <AdamMode M, int G, int P>
inline void BlockOut(const AdamCoeffs<F32x8>& c, const CpuAdamTensor& t, int64_t i) {
  F32x8 p{_mm256_loadu_ps(static_cast<const float*>(t.master_src) + i)};
  F32x8 m{_mm256_loadu_ps(static_cast<const float*>(t.exp_avg_src) + i)};
  F32x8 v{_mm256_loadu_ps(static_cast<const float*>(t.exp_avg_sq_src) + i)};
  const F32x8 g{LoadGrad<G>(t.grad, i)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  _mm256_stream_ps(static_cast<float*>(t.master) + i, p.v);
  _mm256_stream_ps(static_cast<float*>(t.exp_avg) + i, m.v);
  _mm256_stream_ps(static_cast<float*>(t.exp_avg_sq) + i, v.v);
  if constexpr (P != kNoParam) StoreParam<P, false>(t.param, i, p.v);
}

template <AdamMode M, int G, int P>
void Range(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end) {
  const AdamCoeffs<F32x8> c = Broadcast(s);
  int64_t i = begin;
  const uintptr_t m0 = reinterpret_cast<uintptr_t>(t.master) + static_cast<uintptr_t>(i * 4);
  const uintptr_t m1 = reinterpret_cast<uintptr_t>(t.exp_avg) + static_cast<uintptr_t>(i * 4);
  const uintptr_t m2 = reinterpret_cast<uintptr_t>(t.exp_avg_sq) + static_cast<uintptr_t>(i * 4);
  if (t.master_src != nullptr && m0 % 64 == m1 % 64 && m0 % 64 == m2 % 64) {
    // Out of place with the three outputs in the same phase (the optimizer's spare buffers are): the
    // scalar loop up to their next 64-byte boundary, then streaming stores of the state.
    int64_t head = static_cast<int64_t>((64 - m0 % 64) % 64) / 4;
    if (head > end - i) head = end - i;
    AdamRangeScalar(t, s, i, i + head);
    i += head;
    const CpuAdamTensor b = WithSources(t);
    for (; i + 8 <= end; i += 8) BlockOut<M, G, P>(c, b, i);
    _mm_sfence();  // streaming stores are visible before the task ends
    AdamRangeScalar(t, s, i, end);
    return;
  }
  if constexpr (P != kNoParam) {
    // The param is only written: streaming stores skip reading its lines first (2-4 bytes per element
    // of memory traffic). They need aligned lines: the elements before the param's next 64-byte
    // boundary go through the scalar loop.
    int64_t head = ElementsBeforeLine(t.param, P == kF32 ? 4 : 2, i, end);
    AdamRangeScalar(t, s, i, i + head);
    i += head;
  }
  constexpr bool kStream = P != kNoParam;
  const CpuAdamTensor b = WithSources(t);
  for (; i + 8 <= end; i += 8) Block<M, G, P, kStream>(c, b, i);
  if constexpr (P != kNoParam) _mm_sfence();  // streaming stores are visible before the task ends
  AdamRangeScalar(t, s, i, end);
}

// ---- the param alone (CpuAdamTensor::param_only; fp32 state, in place) ----

// Elements i .. i+7 of `grad`, as stored, to `copy`. kStream REQUIRES copy + i aligned to the 8
// elements' bytes.
template <int G, bool kStream>
inline void CopyGrad(const void* grad, void* copy, int64_t i) {
  if constexpr (G == kF32) {
    const __m256 x = _mm256_loadu_ps(static_cast<const float*>(grad) + i);
    if constexpr (kStream) {
      _mm256_stream_ps(static_cast<float*>(copy) + i, x);
    } else {
      _mm256_storeu_ps(static_cast<float*>(copy) + i, x);
    }
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(copy) + i);
    if constexpr (kStream) {
      _mm_stream_si128(dst, h);
    } else {
      _mm_storeu_si128(dst, h);
    }
  }
}

template <AdamMode M, int G, int P, bool kStream>
inline void BlockParamOnly(const AdamCoeffs<F32x8>& c, const CpuAdamTensor& t, int64_t i) {
  F32x8 p{_mm256_loadu_ps(static_cast<const float*>(t.master) + i)};
  F32x8 m{_mm256_loadu_ps(static_cast<const float*>(t.exp_avg) + i)};
  F32x8 v{_mm256_loadu_ps(static_cast<const float*>(t.exp_avg_sq) + i)};
  const F32x8 g{LoadGrad<G>(t.grad, i)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  StoreParam<P, kStream>(t.param, i, p.v);
  if (t.grad_copy != nullptr) CopyGrad<G, kStream>(t.grad, t.grad_copy, i);
}

// The elements before the param's next 64-byte boundary, and the tail, through the scalar loop; then
// streaming stores when the copy's lines are aligned there too (else ordinary stores for both).
template <AdamMode M, int G, int P>
void RangeParamOnly(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end) {
  const AdamCoeffs<F32x8> c = Broadcast(s);
  constexpr int64_t kGradSize = G == kF32 ? 4 : 2;
  int64_t i = begin;
  int64_t head = ElementsBeforeLine(t.param, P == kF32 ? 4 : 2, i, end);
  AdamRangeScalar(t, s, i, i + head);
  i += head;
  const bool lined = t.grad_copy == nullptr ||
                     (reinterpret_cast<uintptr_t>(t.grad_copy) + static_cast<uintptr_t>(i * kGradSize)) %
                             static_cast<uintptr_t>(8 * kGradSize) == 0;
  if (lined) {
    for (; i + 8 <= end; i += 8) BlockParamOnly<M, G, P, true>(c, t, i);
    _mm_sfence();  // streaming stores are visible before the task ends
  } else {
    for (; i + 8 <= end; i += 8) BlockParamOnly<M, G, P, false>(c, t, i);
  }
  AdamRangeScalar(t, s, i, end);
}

// ---- typed state (bf16 master and/or moments; base/adam_state.h) ----

// The state format as a template argument: which tensors are bf16 and whether rounding is stochastic.
constexpr int kMasterBf16 = 1;
constexpr int kMomentsBf16 = 2;
constexpr int kStochastic = 4;

template <bool kBf16>
inline __m256 LoadState(const void* base, int64_t i) {
  if constexpr (kBf16) {
    return Bf16x8ToF32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  }
}

// RoundingMix32 per lane.
inline __m256i Mix32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x7feb352du)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// RoundingBits(key, lo) per lane.
inline __m256i RandomWords(__m256i lo, uint32_t key) {
  return Mix32(_mm256_xor_si256(lo, _mm256_set1_epi32(static_cast<int>(key))));
}

// F32ToBF16Stochastic per lane with the low 16 bits of `bits`.
inline __m128i Bf16Stochastic(__m256 x, __m256i bits) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_and_si256(bits, _mm256_set1_epi32(0xffff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// `bits`: the lanes' random words (used only by stochastic rounding).
template <bool kSr>
inline __m128i StateBf16(__m256 x, __m256i bits) {
  if constexpr (kSr) {
    return Bf16Stochastic(x, bits);
  } else {
    return Bf16Software(x);
  }
}

// m and v rounded to bf16 together: one pack for both, and the NaN handling only when a lane of
// either is NaN (checked once; rare). The same bits as Bf16Software / Bf16Stochastic lane by lane;
// stochastic rounding takes m's random bits from the low and v's from the high half of `bits`.
template <bool kSr>
__attribute__((always_inline)) inline void StoreMomentsBf16(void* m_base, void* v_base, int64_t i, __m256 m, __m256 v, __m256i bits) {
  const __m256i um = _mm256_castps_si256(m), uv = _mm256_castps_si256(v);
  __m256i add_m, add_v;  // added below the cut before truncating
  if constexpr (kSr) {
    add_m = _mm256_and_si256(bits, _mm256_set1_epi32(0xffff));
    add_v = _mm256_srli_epi32(bits, 16);
  } else {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    add_m = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(um, 16), one), half);
    add_v = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(uv, 16), one), half);
  }
  __m256i rm = _mm256_srli_epi32(_mm256_add_epi32(um, add_m), 16);
  __m256i rv = _mm256_srli_epi32(_mm256_add_epi32(uv, add_v), 16);
  const __m256 unordered = _mm256_or_ps(_mm256_cmp_ps(m, m, _CMP_UNORD_Q), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  if (_mm256_movemask_ps(unordered) != 0) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    rm = _mm256_blendv_epi8(rm, _mm256_or_si256(_mm256_srli_epi32(um, 16), quiet),
                            _mm256_cmpgt_epi32(_mm256_and_si256(um, abs_mask), inf));
    rv = _mm256_blendv_epi8(rv, _mm256_or_si256(_mm256_srli_epi32(uv, 16), quiet),
                            _mm256_cmpgt_epi32(_mm256_and_si256(uv, abs_mask), inf));
  }
  // packus works within 128-bit lanes: [m0..3 v0..3 | m4..7 v4..7] -> [m0..7 | v0..7].
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rm, rv), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(m_base) + i), _mm256_castsi256_si128(packed));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(v_base) + i), _mm256_extracti128_si256(packed, 1));
}

// `lo`: the low words of the 8 elements' global indices. With a bf16 master, P is kBF16 or kNoParam:
// the param takes the master's bits.
template <AdamMode M, int G, int P, int SF, bool kStream>
__attribute__((always_inline)) inline void BlockTyped(const AdamCoeffs<F32x8>& c, const CpuAdamTensor& t, int64_t i, __m256i lo,
                       const StateKindKeys& keys) {
  constexpr bool kM16 = (SF & kMasterBf16) != 0;
  constexpr bool kV16 = (SF & kMomentsBf16) != 0;
  constexpr bool kSr = (SF & kStochastic) != 0;
  F32x8 p{LoadState<kM16>(t.master_src, i)};
  F32x8 m{LoadState<kV16>(t.exp_avg_src, i)};
  F32x8 v{LoadState<kV16>(t.exp_avg_sq_src, i)};
  const F32x8 g{LoadGrad<G>(t.grad, i)};
  simd::AdamUpdateGeneric<M>(c, p, m, v, g);
  if constexpr (kM16) {
    const __m128i h = StateBf16<kSr>(p.v, kSr ? RandomWords(lo, keys.master) : lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(t.master) + i), h);
    if constexpr (P != kNoParam) {
      __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(t.param) + i);
      if constexpr (kStream) {
        _mm_stream_si128(dst, h);
      } else {
        _mm_storeu_si128(dst, h);
      }
    }
  } else {
    _mm256_storeu_ps(static_cast<float*>(t.master) + i, p.v);
    if constexpr (P != kNoParam) StoreParam<P, kStream>(t.param, i, p.v);
  }
  if constexpr (kV16) {
    StoreMomentsBf16<kSr>(t.exp_avg, t.exp_avg_sq, i, m.v, v.v, kSr ? RandomWords(lo, keys.moments) : lo);
  } else {
    _mm256_storeu_ps(static_cast<float*>(t.exp_avg) + i, m.v);
    _mm256_storeu_ps(static_cast<float*>(t.exp_avg_sq) + i, v.v);
  }
}

template <AdamMode M, int G, int P, int SF>
void RangeTyped(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end) {
  const AdamCoeffs<F32x8> c = Broadcast(s);
  const CpuAdamTensor b = WithSources(t);
  constexpr bool kStream = P != kNoParam;
  int64_t i = begin;
  while (i < end) {
    // A stretch of global indices sharing their high word (all of the range but for > 2^32 elements).
    const uint64_t gi = static_cast<uint64_t>(t.rounding.index0 + i);
    const uint64_t room = (uint64_t{1} << 32) - (gi & 0xffffffffull);
    const int64_t stop = static_cast<uint64_t>(end - i) < room ? end : i + static_cast<int64_t>(room);
    if constexpr (P != kNoParam) {
      // Streaming stores need aligned lines: the elements before the param's next 64-byte boundary
      // go through the scalar loop.
      int64_t head = ElementsBeforeLine(t.param, P == kF32 ? 4 : 2, i, stop);
      AdamRangeScalar(t, s, i, i + head);
      i += head;
    }
    const uint64_t g0 = static_cast<uint64_t>(t.rounding.index0 + i);
    const StateKindKeys keys = (SF & kStochastic) != 0 ? KindKeysFor(t.rounding.tensor_key, static_cast<uint32_t>(g0 >> 32))
                                                       : StateKindKeys{0, 0};
    __m256i lo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(g0))),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (; i + 8 <= stop; i += 8) {
      BlockTyped<M, G, P, SF, kStream>(c, b, i, lo, keys);
      lo = _mm256_add_epi32(lo, _mm256_set1_epi32(8));
    }
    if constexpr (P != kNoParam) _mm_sfence();  // streaming stores are visible before the task ends
    AdamRangeScalar(t, s, i, stop);
    i = stop;
  }
}

template <AdamMode M, int G, int SF>
AdamRangeFn SelectParamTyped(const CpuAdamTensor& t) {
  if ((SF & kMasterBf16) != 0) {
    // A bf16 master serves bf16 params (the policy allows nothing else); others take the scalar loop.
    if (t.param == nullptr) return &RangeTyped<M, G, kNoParam, SF>;
    if (t.param_dtype == DType::kBF16) return &RangeTyped<M, G, kBF16, SF>;
    return &AdamRangeScalar;
  }
  if (t.param == nullptr) return &RangeTyped<M, G, kNoParam, SF>;
  switch (t.param_dtype) {
    case DType::kF32: return &RangeTyped<M, G, kF32, SF>;
    case DType::kBF16: return &RangeTyped<M, G, kBF16, SF>;
    case DType::kF16: break;
  }
  return &RangeTyped<M, G, static_cast<int>(DType::kF16), SF>;
}

template <AdamMode M, int G>
AdamRangeFn SelectParam(const CpuAdamTensor& t);

template <AdamMode M, int G>
AdamRangeFn SelectState(const CpuAdamTensor& t) {
  if (t.param_only) {  // fp32 state and a param (CpuAdam::Start checked)
    switch (t.param_dtype) {
      case DType::kF32: return &RangeParamOnly<M, G, kF32>;
      case DType::kBF16: return &RangeParamOnly<M, G, kBF16>;
      case DType::kF16: break;
    }
    return &RangeParamOnly<M, G, static_cast<int>(DType::kF16)>;
  }
  int sf = (t.state.master == DType::kBF16 ? kMasterBf16 : 0) | (t.state.moments == DType::kBF16 ? kMomentsBf16 : 0);
  if (sf != 0 && t.state.rounding == StateRounding::kStochastic) sf |= kStochastic;
  switch (sf) {
    case kMasterBf16: return SelectParamTyped<M, G, kMasterBf16>(t);
    case kMasterBf16 | kStochastic: return SelectParamTyped<M, G, kMasterBf16 | kStochastic>(t);
    case kMomentsBf16: return SelectParamTyped<M, G, kMomentsBf16>(t);
    case kMomentsBf16 | kStochastic: return SelectParamTyped<M, G, kMomentsBf16 | kStochastic>(t);
    case kMasterBf16 | kMomentsBf16: return SelectParamTyped<M, G, kMasterBf16 | kMomentsBf16>(t);
    case kMasterBf16 | kMomentsBf16 | kStochastic:
      return SelectParamTyped<M, G, kMasterBf16 | kMomentsBf16 | kStochastic>(t);
    default: return SelectParam<M, G>(t);
  }
}

template <AdamMode M, int G>
AdamRangeFn SelectParam(const CpuAdamTensor& t) {
  if (t.param == nullptr) return &Range<M, G, kNoParam>;
  switch (t.param_dtype) {
    case DType::kF32: return &Range<M, G, kF32>;
    case DType::kBF16: return &Range<M, G, kBF16>;
    case DType::kF16: break;
  }
  return &Range<M, G, static_cast<int>(DType::kF16)>;
}

template <AdamMode M>
AdamRangeFn SelectGrad(const CpuAdamTensor& t) {
  switch (t.grad_dtype) {
    case DType::kF32: return SelectState<M, kF32>(t);
    case DType::kBF16: return SelectState<M, kBF16>(t);
    case DType::kF16: break;
  }
  return SelectState<M, static_cast<int>(DType::kF16)>(t);
}

AdamRangeFn Select(const CpuAdamTensor& t, const AdamScalars& s) {
  return s.mode == AdamMode::kAdamL2 ? SelectGrad<AdamMode::kAdamL2>(t) : SelectGrad<AdamMode::kAdamW>(t);
}

}  // namespace

#pragma GCC pop_options

void AdamRangeAvx2(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end) {
  Select(t, s)(t, s, begin, end);
}

}  // namespace ferry::cpu_adam_internal

#pragma GCC diagnostic pop

#endif  // defined(__x86_64__)
