// Per-element pieces shared by every Adam path (the CPU kernels, the host backend, the CUDA kernels):
//   - one element of a mixed-precision Adam step (AdamStepElement);
//   - the canonical order of the gradient check's sum of squares, which every path follows so that
//     GradStats is the same bits on the CPU (any ISA, any thread count), the host backend and the GPU.
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

// ---- the gradient check's canonical order ------------------------------------------------------------
//
// The sum of squares of a list of gradient tensors is defined as follows, and every implementation
// computes exactly this (squares are exact in double, so only the order of the additions matters):
//   1. Each non-empty tensor is cut into chunks of kGradStatsChunk elements (its last chunk may be
//      shorter); the chunks of all tensors are numbered 0 .. C-1 consecutively, tensor by tensor.
//   2. Slot s (0 <= s < kGradStatsSlots) owns chunks [GradStatsSlotBegin(s, C), GradStatsSlotBegin(s+1, C)).
//   3. Each slot keeps kGradStatsLanes lanes, all starting at +0.0. For each of its chunks in order,
//      lane t adds the squares of the chunk's elements 1024 k + 4 t + j for k = 0..3, then j = 0..3
//      (k outer), skipping elements past the chunk's end (GradStatsAddChunk).
//   4. A slot's value is the pairwise tree of its lanes (GradStatsTree); the result is the pairwise
//      tree of the slot values.
// The lanes and slots fit the GPU (a block of 256 threads, 16-byte loads) and vectorise on the CPU; the
// slots split the data into contiguous pieces that threads or blocks process independently.
inline constexpr int64_t kGradStatsChunk = 4096;
inline constexpr int kGradStatsLanes = 256;
inline constexpr int kGradStatsSlots = 1024;

// x * x in double: exact for every float.
FERRY_ADAM_HD double GradSquare(float x) {
  const double d = static_cast<double>(x);
  return d * d;
}

// Adds one chunk to `lanes` (kGradStatsLanes values) in the canonical order. `grad` is the tensor;
// the chunk is its elements [begin, begin + len). REQUIRES: 0 < len <= kGradStatsChunk.
FERRY_ADAM_HD void GradStatsAddChunk(const void* grad, DType dtype, int64_t begin, int64_t len,
                                     double* lanes) {
  for (int t = 0; t < kGradStatsLanes; ++t) {
    for (int k = 0; k < 4; ++k) {
      for (int j = 0; j < 4; ++j) {
        const int64_t e = 1024 * k + 4 * t + j;
        if (e < len) lanes[t] += GradSquare(LoadAsF32(grad, dtype, static_cast<size_t>(begin + e)));
      }
    }
  }
}

// The pairwise tree sum of values[0 .. n): for stride = n/2, n/4, .., 1: values[i] += values[i + stride]
// for i < stride; returns values[0]. Overwrites `values`. REQUIRES: n is a power of two.
FERRY_ADAM_HD double GradStatsTree(double* values, int n) {
  for (int stride = n / 2; stride >= 1; stride /= 2) {
    for (int i = 0; i < stride; ++i) values[i] += values[i + stride];
  }
  return values[0];
}

// The first chunk of `slot` when there are `total_chunks` chunks.
FERRY_ADAM_HD int64_t GradStatsSlotBegin(int64_t slot, int64_t total_chunks) {
  return slot * total_chunks / kGradStatsSlots;
}

// The chunks of one tensor: ceil(numel / kGradStatsChunk).
FERRY_ADAM_HD int64_t GradStatsChunks(int64_t numel) {
  return (numel + kGradStatsChunk - 1) / kGradStatsChunk;
}

// GradStats of a finished sum.
FERRY_ADAM_HD GradStats GradStatsOfSum(double sum_sq) {
  GradStats g;
  g.sum_sq = sum_sq;
  // Squares are >= 0 and their sum cannot overflow (at most 2^63 terms below 1.2e77), so the sum is
  // finite exactly when every element is.
  g.found_inf = sum_sq <= 1.7976931348623157e308 ? 0u : 1u;
  g.reserved = 0;
  return g;
}

// The value of one slot, walking its chunks in order. `first_chunk[i]` is tensor i's first chunk
// number and `numel[i]` its length (every tensor non-empty, chunks numbered as above);
// add_chunk(tensor, begin, len, lanes) adds one chunk (GradStatsAddChunk or a vectorised equal).
// Host code; every path that runs on the host uses it.
template <typename AddChunk>
double GradStatsSlotValue(const int64_t* first_chunk, const int64_t* numel, size_t num_tensors,
                          int64_t total_chunks, int slot, AddChunk&& add_chunk) {
  double lanes[kGradStatsLanes] = {};
  const int64_t begin = GradStatsSlotBegin(slot, total_chunks);
  const int64_t end = GradStatsSlotBegin(slot + 1, total_chunks);
  if (begin < end) {
    size_t lo = 0, hi = num_tensors - 1;  // the tensor owning chunk `begin`: last first_chunk <= begin
    while (lo < hi) {
      const size_t mid = (lo + hi + 1) / 2;
      if (first_chunk[mid] <= begin) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    size_t tensor = lo;
    for (int64_t c = begin; c < end; ++c) {
      while (c >= first_chunk[tensor] + GradStatsChunks(numel[tensor])) ++tensor;
      const int64_t e0 = (c - first_chunk[tensor]) * kGradStatsChunk;
      const int64_t len = numel[tensor] - e0 < kGradStatsChunk ? numel[tensor] - e0 : kGradStatsChunk;
      add_chunk(tensor, e0, len, lanes);
    }
  }
  return GradStatsTree(lanes, kGradStatsLanes);
}

}  // namespace ferry

#endif  // FERRY_BASE_ADAM_ELEMENT_H_
