// The single definition of the Adam / AdamW update, of its per-step scalars and of the gradient
// multiplier (loss-scale unscaling and global-norm clipping).
//
// Plain arithmetic with no dependencies, compiled for the host and by nvcc for the device. The element
// update is base/adam_update.inc's AdamUpdateGeneric: the scalar CPU path, the host backend and the
// CUDA kernel run it on floats, the CPU SIMD paths on vectors. Every fused multiply-add is spelled out
// and every other operation is a separately rounded IEEE operation (the build disables contraction on
// both sides: -ffp-contract=off for C++, --fmad=false for CUDA; sqrt and division are correctly rounded
// everywhere), so every path produces bit-identical results.
//
// The per-step scalars (bias corrections, 1 - beta, the gradient multiplier) are computed once per step
// and scalar set, in double from a fixed sequence of IEEE operations, then rounded once to float: by
// MakeAdamScalars on the host at enqueue time, or by the kernel itself from values it reads from device
// memory (AdamApplyRuntime), with the same bits either way.
#ifndef FERRY_BASE_ADAM_MATH_H_
#define FERRY_BASE_ADAM_MATH_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FERRY_ADAM_HD __host__ __device__ __forceinline__
#else
#define FERRY_ADAM_HD inline
#endif

#include "base/exact_sum.h"

namespace ferry {

enum class AdamMode : uint8_t {
  kAdamW = 0,  // decoupled weight decay: p -= lr * (wd * p + the Adam update); wd * p uses the old p
  kAdamL2 = 1, // classic Adam with L2: g += wd * p before the moments
};

// Hyper-parameters of one group's optimizer.
struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  AdamMode mode = AdamMode::kAdamW;
  bool bias_correction = true;
};

// Everything one element update needs, precomputed for one group at one step. Trivially copyable, so
// it can be passed by value into a CUDA kernel.
struct AdamScalars {
  float lr;
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float weight_decay;            // kAdamL2: added to the gradient as wd * p; kAdamW: decoupled
  float inv_bias_correction1;    // 1 / (1 - beta1^step), or 1 without bias correction
  float inv_sqrt_bias_correction2;  // 1 / sqrt(1 - beta2^step), or 1
  float grad_multiplier;         // clip_coefficient / loss_scale: applied to every gradient first
  AdamMode mode;
  uint8_t bias_correction;       // 1: the two inv_ fields follow the step (see AdamSetStep)
};

// beta^step by binary exponentiation: a fixed sequence of IEEE double multiplications, so the host and
// the device compute the same bits (std::pow and CUDA's pow may differ in the last place).
// REQUIRES: step >= 0.
FERRY_ADAM_HD double AdamPow(double beta, int64_t step) {
  double result = 1.0;
  double base = beta;
  for (int64_t e = step; e > 0; e >>= 1) {
    if (e & 1) result *= base;
    base *= base;
  }
  return result;
}

// Sets the bias-correction fields of `s` for `step` (1-based: the first update is step 1), computed in
// double and rounded once. Without bias correction both are 1. REQUIRES: step >= 1.
FERRY_ADAM_HD void AdamSetStep(AdamScalars& s, int64_t step) {
  if (s.bias_correction == 0) {
    s.inv_bias_correction1 = 1.0f;
    s.inv_sqrt_bias_correction2 = 1.0f;
    return;
  }
  const double bc1 = 1.0 - AdamPow(static_cast<double>(s.beta1), step);
  const double bc2 = 1.0 - AdamPow(static_cast<double>(s.beta2), step);
  s.inv_bias_correction1 = static_cast<float>(1.0 / bc1);
  s.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / sqrt(bc2));
}

// The per-step scalars for `step` (1-based). `grad_multiplier` multiplies every gradient (see
// AdamGradMultiplier); it is rounded once to float. REQUIRES: step >= 1.
FERRY_ADAM_HD AdamScalars MakeAdamScalars(const AdamHyper& h, int64_t step, double grad_multiplier = 1.0) {
  AdamScalars s{};
  s.lr = h.lr;
  s.beta1 = h.beta1;
  s.beta2 = h.beta2;
  s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(h.beta1));
  s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(h.beta2));
  s.eps = h.eps;
  s.weight_decay = h.weight_decay;
  s.grad_multiplier = static_cast<float>(grad_multiplier);
  s.mode = h.mode;
  s.bias_correction = h.bias_correction ? 1 : 0;
  AdamSetStep(s, step);
  return s;
}

// ---- the gradient check, unscaling and clipping ----------------------------------------------------

// What a gradient check found over a set of gradients (CpuAdam::ComputeGradStats,
// Device::LaunchGradStats): the exact sum of their squares (base/exact_sum.h), so the value is the same
// bits on every path, thread count and split of the gradients, and its rounding to double.
// Several ranks: all-reduce `exact` in its exchange form (ExactSumSq::ToExchange, a sum of doubles) and
// found_inf (a max), then GradStatsFromExact gives every rank the same global GradStats.
struct GradStats {
  double sum_sq;       // exact.ToDouble() (correctly rounded); +Inf when found_inf
  uint32_t found_inf;  // 1 when some element is NaN or +-Inf, else 0
  uint32_t reserved;   // 0
  ExactSumSq exact;    // the sum of g * g over every finite element, as stored (before any unscaling);
                       // normalised, so equal sums have equal bytes
};

// The GradStats of an exact sum of the finite elements' squares and whether some element was not finite.
FERRY_ADAM_HD GradStats GradStatsFromExact(const ExactSumSq& exact, bool found_inf) {
  GradStats g;
  g.exact = exact;
  g.exact.Normalize();
  g.found_inf = found_inf ? 1u : 0u;
  g.reserved = 0;
  g.sum_sq = found_inf ? exact_sum_internal::DoubleFromBits(0x7FF0000000000000ull) : g.exact.ToDouble();
  return g;
}

// The gradient multiplier of one step: 1 / grad_scale (the gradients carry a loss scale) times, when
// max_norm > 0, the global-norm clip coefficient min(1, max_norm / (norm + 1e-6)) of the unscaled
// gradients, norm = sqrt(sum_sq) / grad_scale with sum_sq from the gradient check of the scaled ones
// (the clip rule of torch.nn.utils.clip_grad_norm_). Computed in double from correctly rounded
// operations, rounded once. REQUIRES: grad_scale > 0 and finite; sum_sq finite when max_norm > 0.
FERRY_ADAM_HD float AdamGradMultiplier(float grad_scale, double sum_sq, float max_norm) {
  const double scale = static_cast<double>(grad_scale);
  double multiplier = 1.0 / scale;
  if (max_norm > 0.0f) {
    const double norm = sqrt(sum_sq) / scale;
    const double clip = static_cast<double>(max_norm) / (norm + 1e-6);
    if (clip < 1.0) multiplier = clip / scale;
  }
  return static_cast<float>(multiplier);
}

// Applies values read when the update runs to scalars made earlier, as a kernel does with the values
// in device memory (a null pointer keeps the scalars' value): the learning rate, the number of steps
// already completed (the update is step *completed_steps + 1) and the gradient multiplier.
FERRY_ADAM_HD void AdamApplyRuntime(AdamScalars& s, const float* lr, const int64_t* completed_steps,
                                    const float* grad_multiplier) {
  if (lr != nullptr) s.lr = *lr;
  if (completed_steps != nullptr) AdamSetStep(s, *completed_steps + 1);
  if (grad_multiplier != nullptr) s.grad_multiplier = *grad_multiplier;
}

// ---- the element update -----------------------------------------------------------------------------

// The scalars of one update in the number type of a path: floats for the scalar path, broadcast
// vectors for a SIMD path (each path builds these from AdamScalars).
template <typename V>
struct AdamCoeffs {
  V grad_multiplier;
  V weight_decay;
  V beta1;
  V one_minus_beta1;
  V beta2;
  V one_minus_beta2;
  V inv_bias_correction1;
  V inv_sqrt_bias_correction2;
  V eps;
  V neg_lr;  // -lr (exact)
};

FERRY_ADAM_HD AdamCoeffs<float> AdamCoeffsOf(const AdamScalars& s) {
  AdamCoeffs<float> c;
  c.grad_multiplier = s.grad_multiplier;
  c.weight_decay = s.weight_decay;
  c.beta1 = s.beta1;
  c.one_minus_beta1 = s.one_minus_beta1;
  c.beta2 = s.beta2;
  c.one_minus_beta2 = s.one_minus_beta2;
  c.inv_bias_correction1 = s.inv_bias_correction1;
  c.inv_sqrt_bias_correction2 = s.inv_sqrt_bias_correction2;
  c.eps = s.eps;
  c.neg_lr = -s.lr;
  return c;
}

// The operations of AdamUpdateGeneric on float.
FERRY_ADAM_HD float AdamMul(float a, float b) { return a * b; }
FERRY_ADAM_HD float AdamFma(float a, float b, float c) { return fmaf(a, b, c); }
FERRY_ADAM_HD float AdamSqrt(float a) { return sqrtf(a); }
FERRY_ADAM_HD float AdamDiv(float a, float b) { return a / b; }

#include "base/adam_update.inc"

// One element: updates the fp32 master `p` and moments `m`, `v` in place from gradient `g`.
FERRY_ADAM_HD void AdamUpdate(const AdamScalars& s, float& p, float& m, float& v, float g) {
  const AdamCoeffs<float> c = AdamCoeffsOf(s);
  if (s.mode == AdamMode::kAdamL2) {
    AdamUpdateGeneric<AdamMode::kAdamL2>(c, p, m, v, g);
  } else {
    AdamUpdateGeneric<AdamMode::kAdamW>(c, p, m, v, g);
  }
}

}  // namespace ferry

#endif  // FERRY_BASE_ADAM_MATH_H_
