// The element loops behind CpuAdam, one set per implementation (internal to the optim layer).
// cpu_adam.cc holds the scalar ones and the dispatch; cpu_adam_avx2.cc and cpu_adam_avx512.cc compile
// theirs for their ISA (function target regions, so nothing else in those files, and nothing they
// include, is built for an ISA the CPU may lack). Callers check the CPU's features first.
#ifndef FERRY_OPTIM_CPU_ADAM_KERNELS_H_
#define FERRY_OPTIM_CPU_ADAM_KERNELS_H_

#include <cstdint>

#include "base/adam_math.h"
#include "ferry/dtype.h"
#include "optim/cpu_adam.h"

namespace ferry::cpu_adam_internal {

// Updates elements [begin, end) of `t` with scalars `s` (t.scalars is not read).
using AdamRangeFn = void (*)(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end);

void AdamRangeScalar(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end);

// `t` with its *_src pointing at its own state when it is not out of place: the SIMD blocks always
// load the state from *_src and store it to master/exp_avg/exp_avg_sq.
inline CpuAdamTensor WithSources(const CpuAdamTensor& t) {
  CpuAdamTensor r = t;
  if (r.master_src == nullptr) {
    r.master_src = r.master;
    r.exp_avg_src = r.exp_avg;
    r.exp_avg_sq_src = r.exp_avg_sq;
  }
  return r;
}

// Of elements [i, end) of an array of `size`-byte elements at `base`, those before its next 64-byte
// line: streaming stores need whole lines, so these take ordinary stores.
inline int64_t ElementsBeforeLine(const void* base, int64_t size, int64_t i, int64_t end) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(i * size);
  const int64_t head = static_cast<int64_t>((64 - addr % 64) % 64) / size;
  return head < end - i ? head : end - i;
}

// Defined only on x86-64 builds; REQUIRE the CPU features their names say.
void AdamRangeAvx2(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end);
void AdamRangeAvx512(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end);
void AdamRangeAvx512Bf16(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end);

}  // namespace ferry::cpu_adam_internal

#endif  // FERRY_OPTIM_CPU_ADAM_KERNELS_H_
