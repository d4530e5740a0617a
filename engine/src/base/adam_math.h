// The single definition of one Adam / AdamW element update.
//
// Plain arithmetic with no dependencies, compiled for the host (CPU kernels) and by nvcc for the device
// (the CUDA kernel). Every fused multiply-add is spelled out with fmaf and every other operation is a
// separately rounded IEEE operation (the build disables contraction on both sides: -ffp-contract=off for
// C++, --fmad=false for CUDA; sqrtf and division are correctly rounded on both), so the CPU and the GPU
// produce bit-identical results.
//
// The per-step scalars (bias corrections, 1 - beta, the gradient multiplier) are
// computed once, on the host, by MakeAdamScalars; no kernel recomputes them.
#ifndef FERRY_BASE_ADAM_MATH_H_
#define FERRY_BASE_ADAM_MATH_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FERRY_ADAM_HD __host__ __device__ __forceinline__
#else
#define FERRY_ADAM_HD inline
#endif

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
};

// The per-step scalars for `step` (1-based: the first update is step 1). Computed in double and rounded
// once to float, so every caller on every device gets the same bits.
inline AdamScalars MakeAdamScalars(const AdamHyper& h, int64_t step, double grad_multiplier = 1.0) {
  AdamScalars s{};
  s.lr = h.lr;
  s.beta1 = h.beta1;
  s.beta2 = h.beta2;
  s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(h.beta1));
  s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(h.beta2));
  s.eps = h.eps;
  s.weight_decay = h.weight_decay;
  if (h.bias_correction) {
    double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(step));
    double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(step));
    s.inv_bias_correction1 = static_cast<float>(1.0 / bc1);
    s.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bc2));
  } else {
    s.inv_bias_correction1 = 1.0f;
    s.inv_sqrt_bias_correction2 = 1.0f;
  }
  s.grad_multiplier = static_cast<float>(grad_multiplier);
  s.mode = h.mode;
  return s;
}

// One element: updates the fp32 master `p` and moments `m`, `v` in place from gradient `g`.
FERRY_ADAM_HD void AdamUpdate(const AdamScalars& s, float& p, float& m, float& v, float g) {
  g = g * s.grad_multiplier;
  if (s.mode == AdamMode::kAdamL2) g = fmaf(s.weight_decay, p, g);
  m = fmaf(s.beta1, m, s.one_minus_beta1 * g);
  v = fmaf(s.beta2, v, (s.one_minus_beta2 * g) * g);
  const float m_hat = m * s.inv_bias_correction1;
  const float denom = fmaf(sqrtf(v), s.inv_sqrt_bias_correction2, s.eps);
  float update = m_hat / denom;
  // AdamW's decay joins the update rather than scaling p by a float (1 - lr * wd): that factor is a
  // multiple of 2^-24, so the decay it applies would be 1.3% off at lr * wd = 1e-6, 19% off at 1e-7
  // and zero below 3e-8, the same error every step. Here lr * wd * p carries the update's precision.
  if (s.mode == AdamMode::kAdamW) update = fmaf(s.weight_decay, p, update);
  p = fmaf(-s.lr, update, p);
}

}  // namespace ferry

#endif  // FERRY_BASE_ADAM_MATH_H_
