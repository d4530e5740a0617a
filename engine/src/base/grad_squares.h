// The gradient check's accumulation on the host, shared by CpuAdam::ComputeGradStats (one accumulator
// per task on the thread pool) and the host backend's LaunchGradStats (one, serially): the exact sum of
// squares of base/exact_sum.h over gradient elements of any dtype, through ExactSquareBuckets.
#ifndef FERRY_BASE_GRAD_SQUARES_H_
#define FERRY_BASE_GRAD_SQUARES_H_

#include <cstddef>
#include <cstdint>

#include "base/adam_math.h"
#include "base/exact_sum.h"
#include "ferry/dtype.h"

namespace ferry {

// Adds the squares of gradient ranges exactly. Four bucket sets take the elements in turn, so that
// consecutive elements with the same exponent (the common case) update different words and do not wait
// on each other's read-modify-write. About 8 KB; one thread at a time.
class GradSquareAccumulator {
 public:
  GradSquareAccumulator() {
    for (ExactSquareBuckets& s : sets_) s.Clear();
    sum_.Clear();
  }

  // Adds the squares of elements [begin, end) of `grad`, a `dtype` array; NaN and +-Inf elements add
  // nothing and set found_inf. REQUIRES: the elements are readable; 0 <= begin <= end.
  void Add(const void* grad, DType dtype, int64_t begin, int64_t end) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    switch (dtype) {
      case DType::kF32: {
        const float* p = static_cast<const float*>(grad) + begin;
        Run(n, [p](int64_t i) { return F32Bits(p[i]); });
        return;
      }
      case DType::kBF16: {
        const uint16_t* p = static_cast<const uint16_t*>(grad) + begin;
        Run(n, [p](int64_t i) { return static_cast<uint32_t>(p[i]) << 16; });
        return;
      }
      case DType::kF16: {
        const uint16_t* p = static_cast<const uint16_t*>(grad) + begin;
        Run(n, [p](int64_t i) { return F32Bits(F16ToF32(p[i])); });  // exact
        return;
      }
    }
  }

  // The exact sum of the finite squares added so far, and whether a NaN or Inf was seen.
  ExactSumSq Sum() {
    Fold();
    return sum_;
  }
  bool found_inf() {
    Fold();
    return found_inf_;
  }
  GradStats Stats() {
    Fold();
    return GradStatsFromExact(sum_, found_inf_);
  }

 private:
  static constexpr int kSets = 4;
  // Elements between folds: each set then holds at most ExactSquareBuckets::kCapacity squares.
  static constexpr int64_t kWindow = kSets * ExactSquareBuckets::kCapacity;

  void Fold() {
    if (unfolded_ == 0) return;
    for (ExactSquareBuckets& s : sets_) found_inf_ = s.FoldInto(sum_) || found_inf_;
    unfolded_ = 0;
  }

  // bits(i): the float bits of element i, for i in [0, n). Element k of the window goes to set k % 4.
  template <typename Bits>
  void Run(int64_t n, const Bits& bits) {
    int64_t i = 0;
    while (i < n) {
      if (unfolded_ == kWindow) Fold();
      const int64_t stop = i + (n - i < kWindow - unfolded_ ? n - i : kWindow - unfolded_);
      for (; i < stop && (unfolded_ & 3) != 0; ++i, ++unfolded_) sets_[unfolded_ & 3].AddBits(bits(i));
      const int64_t quads = (stop - i) / 4;
      for (int64_t q = 0; q < quads; ++q, i += 4) {
        sets_[0].AddBits(bits(i));
        sets_[1].AddBits(bits(i + 1));
        sets_[2].AddBits(bits(i + 2));
        sets_[3].AddBits(bits(i + 3));
      }
      unfolded_ += 4 * quads;
      for (; i < stop; ++i, ++unfolded_) sets_[unfolded_ & 3].AddBits(bits(i));
    }
  }

  ExactSquareBuckets sets_[kSets];
  int64_t unfolded_ = 0;  // elements added since the last fold, <= kWindow
  ExactSumSq sum_;
  bool found_inf_ = false;
};

}  // namespace ferry

#endif  // FERRY_BASE_GRAD_SQUARES_H_
