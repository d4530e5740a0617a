// Per-element pieces shared by every Adam path (the CPU kernels, the host backend, the CUDA kernels):
// one element of a mixed-precision Adam step (AdamStepElement). The gradient check's sum of squares is
// exact (base/exact_sum.h), so it needs no shared order.
#ifndef FERRY_BASE_ADAM_ELEMENT_H_
#define FERRY_BASE_ADAM_ELEMENT_H_

#include <cstddef>
#include <cstdint>

#include "base/adam_math.h"
#include "base/adam_state.h"
#include "ferry/dtype.h"

namespace ferry {

// Reads the fp32 master and moments and the gradient (in its dtype), applies adam_math.h's update,
// writes the state back and the param rounded to its dtype.
// REQUIRES: master, exp_avg, exp_avg_sq and grad hold element k; param is null or holds element k.
FERRY_ADAM_HD void AdamStepElement(const AdamScalars& s, float* master, float* exp_avg, float* exp_avg_sq,
                                   const void* grad, DType grad_dtype, void* param, DType param_dtype,
                                   size_t k) {
  float p = master[k];
  float m = exp_avg[k];
  float v = exp_avg_sq[k];
  AdamUpdate(s, p, m, v, LoadAsF32(grad, grad_dtype, k));
  master[k] = p;
  exp_avg[k] = m;
  exp_avg_sq[k] = v;
  if (param != nullptr) StoreFromF32(param, param_dtype, k, p);
}

// The same with state stored as `f` says (fp32 or bf16 master and moments): the state is widened
// exactly, updated in fp32, and rounded back (f.rounding; stochastic rounding takes the element's
// random bits from `keys`, the kind keys of its global index's high word, and `lo`, its low word). The
// param is the stored master rounded to its dtype (a bf16 master's bits for a bf16 param), so it
// always equals what VerifyMasters expects.
FERRY_ADAM_HD void AdamStepElementTyped(const AdamScalars& s, const StateFormat& f, void* master, void* exp_avg,
                                        void* exp_avg_sq, const void* grad, DType grad_dtype, void* param,
                                        DType param_dtype, size_t k, const StateKindKeys& keys, uint32_t lo) {
  float p = LoadAsF32(master, f.master, k);
  float m = LoadAsF32(exp_avg, f.moments, k);
  float v = LoadAsF32(exp_avg_sq, f.moments, k);
  AdamUpdate(s, p, m, v, LoadAsF32(grad, grad_dtype, k));
  const bool sr = f.rounding == StateRounding::kStochastic;
  const bool moments16 = f.moments != DType::kF32;
  const bool master16 = f.master != DType::kF32;
  const uint32_t moment_bits = sr && moments16 ? RoundingBits(keys.moments, lo) : 0u;
  StoreState(master, f.master, k, p, f.rounding, sr && master16 ? RoundingBits(keys.master, lo) : 0u);
  StoreState(exp_avg, f.moments, k, m, f.rounding, moment_bits);
  StoreState(exp_avg_sq, f.moments, k, v, f.rounding, moment_bits >> 16);
  if (param != nullptr) StoreFromF32(param, param_dtype, k, master16 ? LoadAsF32(master, f.master, k) : p);
}

// Elements [begin, end) of one tensor range with typed state, one by one: element i is global element
// key.index0 + i of its param (the rounding hash's counter). The reference every other path equals.
FERRY_ADAM_HD void AdamStepRangeTyped(const AdamScalars& s, const StateFormat& f, const StateRoundingKey& key,
                                      void* master, void* exp_avg, void* exp_avg_sq, const void* grad,
                                      DType grad_dtype, void* param, DType param_dtype, int64_t begin,
                                      int64_t end) {
  int64_t i = begin;
  while (i < end) {
    const uint64_t g = static_cast<uint64_t>(key.index0 + i);
    const uint32_t hi = static_cast<uint32_t>(g >> 32);
    // The stretch of elements sharing `hi`: up to the next multiple of 2^32 of the global index.
    const uint64_t room = (uint64_t{1} << 32) - (g & 0xffffffffull);
    const int64_t stop = static_cast<uint64_t>(end - i) < room ? end : i + static_cast<int64_t>(room);
    const StateKindKeys keys = f.stochastic() ? KindKeysFor(key.tensor_key, hi) : StateKindKeys{0, 0};
    for (; i < stop; ++i) {
      AdamStepElementTyped(s, f, master, exp_avg, exp_avg_sq, grad, grad_dtype, param, param_dtype,
                           static_cast<size_t>(i), keys, static_cast<uint32_t>(key.index0 + i));
    }
  }
}

}  // namespace ferry

#endif  // FERRY_BASE_ADAM_ELEMENT_H_
