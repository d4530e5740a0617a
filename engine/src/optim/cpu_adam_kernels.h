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

// Defined only on x86-64 builds; REQUIRE the CPU features their names say.
void AdamRangeAvx2(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end);
void AdamRangeAvx512(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end);
void AdamRangeAvx512Bf16(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end);

}  // namespace ferry::cpu_adam_internal

#endif  // FERRY_OPTIM_CPU_ADAM_KERNELS_H_
