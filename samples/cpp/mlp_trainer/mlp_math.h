// The MLP's math, one output element per function, shared by the host loops (mlp_host.cc) and the
// CUDA kernels (mlp_cuda.cu) so that the two backends compute the same thing the same way. Each
// function sums in a fixed order, so the results are deterministic on both.
//
// Layout (row-major): x [B, I], W1 [H, I], b1 [H], h [B, H], W2 [O, H], b2 [O], out and y [B, O].
// Params are bf16 bits; activations and grads are fp32. Loss = (1 / 2B) sum_b sum_o (out - y)^2.
#ifndef FERRY_SAMPLES_MLP_TRAINER_MLP_MATH_H_
#define FERRY_SAMPLES_MLP_TRAINER_MLP_MATH_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MLP_HD __host__ __device__ inline
#else
#define MLP_HD inline
#endif

namespace mlp {

MLP_HD float Bf16ToF32(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even (finite inputs; the sample's values are small).
MLP_HD uint16_t F32ToBf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// h[b, j] = tanh(b1[j] + sum_i W1[j, i] x[b, i])
MLP_HD float Hidden(const uint16_t* w1, const uint16_t* b1, const float* x, int64_t in, int64_t b, int64_t j) {
  float z = Bf16ToF32(b1[j]);
  for (int64_t i = 0; i < in; ++i) z += Bf16ToF32(w1[j * in + i]) * x[b * in + i];
  return tanhf(z);
}

// out[b, o] = b2[o] + sum_j W2[o, j] h[b, j]
MLP_HD float Output(const uint16_t* w2, const uint16_t* b2, const float* h, int64_t hidden, int64_t b, int64_t o) {
  float z = Bf16ToF32(b2[o]);
  for (int64_t j = 0; j < hidden; ++j) z += Bf16ToF32(w2[o * hidden + j]) * h[b * hidden + j];
  return z;
}

// d loss / d out[b, o] = (out - y) / B; also this sample's squared error, for the loss.
MLP_HD float OutputGrad(float out, float y, int64_t batch, float* squared_error) {
  const float d = out - y;
  *squared_error = d * d;
  return d / static_cast<float>(batch);
}

// Weight grad of a layer: gW[r, c] = sum_b dy[b, r] a[b, c] (dy [B, R], a [B, C]).
MLP_HD float WeightGrad(const float* dy, const float* a, int64_t batch, int64_t rows, int64_t cols, int64_t r,
                        int64_t c) {
  float g = 0.0f;
  for (int64_t b = 0; b < batch; ++b) g += dy[b * rows + r] * a[b * cols + c];
  return g;
}

// Bias grad of a layer: gb[r] = sum_b dy[b, r].
MLP_HD float BiasGrad(const float* dy, int64_t batch, int64_t rows, int64_t r) {
  float g = 0.0f;
  for (int64_t b = 0; b < batch; ++b) g += dy[b * rows + r];
  return g;
}

// d loss / d (W1 x + b1)[b, j] = (1 - h^2) sum_o dout[b, o] W2[o, j]
MLP_HD float HiddenGrad(const float* dout, const uint16_t* w2, const float* h, int64_t hidden, int64_t out,
                        int64_t b, int64_t j) {
  float g = 0.0f;
  for (int64_t o = 0; o < out; ++o) g += dout[b * out + o] * Bf16ToF32(w2[o * hidden + j]);
  const float hv = h[b * hidden + j];
  return g * (1.0f - hv * hv);
}

}  // namespace mlp

#endif  // FERRY_SAMPLES_MLP_TRAINER_MLP_MATH_H_
