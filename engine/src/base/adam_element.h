// Per-element pieces shared by every Adam path (the CPU kernels, the host backend, the CUDA kernels):
// one element of a mixed-precision Adam step (AdamStepElement). The gradient check's sum of squares is
// exact (base/exact_sum.h), so it needs no shared order.
#ifndef FERRY_BASE_ADAM_ELEMENT_H_
#define FERRY_BASE_ADAM_ELEMENT_H_

#include <cstddef>
#include <cstdint>

#include "base/adam_math.h"
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

}  // namespace ferry

#endif  // FERRY_BASE_ADAM_ELEMENT_H_
