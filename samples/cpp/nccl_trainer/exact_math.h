// The NCCL trainer's math, one output element per function, shared by its CUDA kernels
// (nccl_model.cu) and the host test (tests/samples/nccl_trainer_test.cc). Each function sums in a
// fixed order, so its result depends only on its inputs, never on the launch or the world size.
//
// Layout (row-major): x [B, I], W1 [H, I], b1 [H], h [B, H], W2 [O, H], b2 [O], out and y [B, O],
// with B the examples of one rank. Params are bf16 bits; activations are fp32.
// Loss = (1 / 2B) sum_b sum_o (out - y)^2 over the global batch B.
//
// Exact gradients across ranks. A weight's gradient is a sum over the global batch of one term per
// example. In floating point that sum depends on its order, and NCCL's reduce-scatter adds the
// ranks' partial sums in an order that changes with the number of ranks (ring or tree, and which
// rank starts each chunk). So each per-example term (computed from the full params and that example
// alone: the same bits on whichever rank holds the example) is rounded once to a fixed-point int64
// with kFracBits fraction bits, and everything after that is integer addition: a rank's sum over its
// examples, then NCCL's ncclInt64 sum over the ranks. Integer addition is associative, so the total
// is the same integer whatever the split and the order, and its conversion back to fp32 (Dequantize)
// gives the same bits on 1, 2 or 4 ranks. No overflow: a term is clamped to +-kMaxTerm = 2^52
// (|term| <= 4096, far beyond this model's) and the global batch is at most kMaxBatch = 2^10, so
// every partial sum stays within 2^62.
#ifndef FERRY_SAMPLES_NCCL_TRAINER_EXACT_MATH_H_
#define FERRY_SAMPLES_NCCL_TRAINER_EXACT_MATH_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define NT_HD __host__ __device__ inline
#else
#define NT_HD inline
#endif

namespace nccl_trainer {

constexpr int kFracBits = 40;
constexpr int64_t kMaxTerm = int64_t{1} << 52;
constexpr int64_t kMaxBatch = int64_t{1} << 10;

NT_HD float Bf16ToF32(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even (finite inputs).
NT_HD uint16_t F32ToBf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// A uniform value in [-1, 1) from a 64-bit key (SplitMix64's finaliser; 24 random bits, so exact).
NT_HD float Uniform(uint64_t key) {
  uint64_t x = key + 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

// Input i of global example `example`: a function of the global index only, so a rank's slice of
// the batch holds the same values as the same rows of the whole batch on one rank. The training set is
// this one global batch, seen at every step (full-batch training: the loss falls visibly in a few
// steps); a trainer with fresh batches per step needs nothing else for exactness.
NT_HD float Input(int64_t example, int64_t i) {
  return Uniform((static_cast<uint64_t>(example) << 32) ^ static_cast<uint64_t>(i));
}

// The target: a smooth function of a few inputs of the same example (x holds its `in` inputs).
NT_HD float Target(const float* x, int64_t in, int64_t o) {
  return 0.5f * sinf(2.0f * x[o % in]) + 0.5f * x[(o + 1) % in] * x[(o + 2) % in];
}

// h[b, j] = tanh(b1[j] + sum_i W1[j, i] x[b, i])
NT_HD float Hidden(const uint16_t* w1, const uint16_t* b1, const float* x, int64_t in, int64_t b, int64_t j) {
  float z = Bf16ToF32(b1[j]);
  for (int64_t i = 0; i < in; ++i) z += Bf16ToF32(w1[j * in + i]) * x[b * in + i];
  return tanhf(z);
}

// out[b, o] = b2[o] + sum_j W2[o, j] h[b, j]
NT_HD float Output(const uint16_t* w2, const uint16_t* b2, const float* h, int64_t hidden, int64_t b, int64_t o) {
  float z = Bf16ToF32(b2[o]);
  for (int64_t j = 0; j < hidden; ++j) z += Bf16ToF32(w2[o * hidden + j]) * h[b * hidden + j];
  return z;
}

// (1 - h^2) sum_o dout[b, o] W2[o, j]: example b's delta at fc1's output, dout [B, O] its output error.
NT_HD float HiddenDelta(const float* dout, const uint16_t* w2, const float* h, int64_t hidden, int64_t out, int64_t b,
                        int64_t j) {
  float g = 0.0f;
  for (int64_t o = 0; o < out; ++o) g += dout[b * out + o] * Bf16ToF32(w2[o * hidden + j]);
  const float hv = h[b * hidden + j];
  return g * (1.0f - hv * hv);
}

// One per-example term in fixed point: round(v * 2^kFracBits), clamped to +-kMaxTerm (a NaN to 0:
// this sample's terms are finite; a trainer that relies on Ferry's found-inf check would send a
// flag beside the grads).
NT_HD int64_t Quantize(float v) {
  const float s = v * 1099511627776.0f;  // 2^40: exact
  if (!(s == s)) return 0;
  if (s >= 4503599627370496.0f) return kMaxTerm;  // 2^52
  if (s <= -4503599627370496.0f) return -kMaxTerm;
#if defined(__CUDA_ARCH__)
  return __float2ll_rn(s);
#else
  return static_cast<int64_t>(llrintf(s));  // the default rounding mode: to nearest even
#endif
}

// The gradient element from the global sum of its terms: sum * 2^-kFracBits / batch, in fp32 (the
// grad dtype Ferry reads). The sum's conversion to double is exact below 2^53, and rounded the same
// way everywhere above.
NT_HD float Dequantize(int64_t sum, int64_t batch) {
  return static_cast<float>(static_cast<double>(sum) * (1.0 / 1099511627776.0) / static_cast<double>(batch));
}

// A layer's weight grad over this rank's `count` examples, in fixed point:
// sum_b Quantize(dy[b, r] a[b, c]) (dy [count, R] the unnormalized output error, a [count, C]).
NT_HD int64_t WeightGradTerms(const float* dy, const float* a, int64_t count, int64_t rows, int64_t cols, int64_t r,
                              int64_t c) {
  int64_t g = 0;
  for (int64_t b = 0; b < count; ++b) g += Quantize(dy[b * rows + r] * a[b * cols + c]);
  return g;
}

// A layer's bias grad over this rank's `count` examples: sum_b Quantize(dy[b, r]).
NT_HD int64_t BiasGradTerms(const float* dy, int64_t count, int64_t rows, int64_t r) {
  int64_t g = 0;
  for (int64_t b = 0; b < count; ++b) g += Quantize(dy[b * rows + r]);
  return g;
}

// The initial value of element k of a weight with `fan_in` inputs: uniform in +-1/sqrt(fan_in), as
// bf16 bits (biases start at 0). The same on every rank, so no broadcast is needed.
inline uint16_t InitialWeight(uint64_t seed, int64_t k, int64_t fan_in) {
  return F32ToBf16(Uniform((seed << 40) ^ static_cast<uint64_t>(k)) / sqrtf(static_cast<float>(fan_in)));
}

}  // namespace nccl_trainer

#endif  // FERRY_SAMPLES_NCCL_TRAINER_EXACT_MATH_H_
