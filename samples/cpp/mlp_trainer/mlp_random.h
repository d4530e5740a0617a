// Deterministic numbers for the sample: initial params and the synthetic data set, the same on every
// run and backend (a resumed run must see the batches the uninterrupted one saw).
#ifndef FERRY_SAMPLES_MLP_TRAINER_MLP_RANDOM_H_
#define FERRY_SAMPLES_MLP_TRAINER_MLP_RANDOM_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "mlp.h"
#include "mlp_math.h"

namespace mlp {

// SplitMix64: a tiny, well-mixed generator; Uniform() is in [-1, 1).
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float Uniform() { return static_cast<float>(static_cast<double>(Next() >> 11) * 0x1.0p-52 - 1.0); }

 private:
  uint64_t state_;
};

// w1, b1, w2, b2 as bf16 bits: weights uniform in +-1/sqrt(fan_in), biases zero.
inline std::vector<uint16_t> InitialParams(const Shape& s, uint64_t seed) {
  Random r(seed);
  std::vector<uint16_t> bits;
  const float a1 = 1.0f / std::sqrt(static_cast<float>(s.in)), a2 = 1.0f / std::sqrt(static_cast<float>(s.hidden));
  for (int64_t i = 0; i < s.hidden * s.in; ++i) bits.push_back(F32ToBf16(a1 * r.Uniform()));
  for (int64_t i = 0; i < s.hidden; ++i) bits.push_back(F32ToBf16(0.0f));
  for (int64_t i = 0; i < s.out * s.hidden; ++i) bits.push_back(F32ToBf16(a2 * r.Uniform()));
  for (int64_t i = 0; i < s.out; ++i) bits.push_back(F32ToBf16(0.0f));
  return bits;
}

// The synthetic task: y = sin(A x) + 0.5 * (B x) with fixed random A [out, in] and B [out, in],
// x uniform in [-1, 1)^in. Batch `step` is a pure function of the step number.
class Teacher {
 public:
  explicit Teacher(const Shape& s) : s_(s) {
    Random r(20261124);
    for (int64_t i = 0; i < s.out * s.in; ++i) a_.push_back(1.5f * r.Uniform());
    for (int64_t i = 0; i < s.out * s.in; ++i) b_.push_back(0.5f * r.Uniform());
  }
  void Batch(int64_t step, std::vector<float>* x, std::vector<float>* y) const {
    Random r(0x5eed0000ull + static_cast<uint64_t>(step));
    x->resize(s_.batch * s_.in);
    y->resize(s_.batch * s_.out);
    for (float& v : *x) v = r.Uniform();
    for (int64_t b = 0; b < s_.batch; ++b) {
      for (int64_t o = 0; o < s_.out; ++o) {
        double za = 0.0, zb = 0.0;
        for (int64_t i = 0; i < s_.in; ++i) {
          za += a_[o * s_.in + i] * (*x)[b * s_.in + i];
          zb += b_[o * s_.in + i] * (*x)[b * s_.in + i];
        }
        (*y)[b * s_.out + o] = static_cast<float>(std::sin(za / std::sqrt(static_cast<double>(s_.in))) + 0.5 * zb);
      }
    }
  }

 private:
  Shape s_;
  std::vector<float> a_, b_;
};

}  // namespace mlp

#endif  // FERRY_SAMPLES_MLP_TRAINER_MLP_RANDOM_H_
