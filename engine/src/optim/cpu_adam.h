// Adam / AdamW on the CPU, over base/adam_math.h's element update.
#ifndef FERRY_OPTIM_CPU_ADAM_H_
#define FERRY_OPTIM_CPU_ADAM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/adam_math.h"
#include "base/thread_pool.h"
#include "ferry/dtype.h"

namespace ferry {

// One contiguous range of a tensor to update. All pointers are host memory.
struct CpuAdamTensor {
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const void* grad = nullptr;  // `grad_dtype`
  void* param = nullptr;       // written as master rounded to `param_dtype`; may be null
  int64_t numel = 0;
  DType grad_dtype = DType::kF32;
  DType param_dtype = DType::kF32;
  const AdamScalars* scalars = nullptr;  // this tensor's per-step scalars
};

// CpuAdam updates many tensors on a thread pool. Work is split into fixed blocks of elements, so the
// result does not depend on the number of threads (each element's update is independent anyway).
// One thread at a time per object; the pool may be shared.
class CpuAdam final {
 public:
  // REQUIRES: `pool` outlives this object.
  explicit CpuAdam(ThreadPool* pool, int64_t block_elements = 1 << 16);

  // Updates every tensor in place. Errors (nothing changed): a null pointer or a negative length.
  absl::Status Step(absl::Span<const CpuAdamTensor> tensors);

  // The same update on the calling thread only (for tests and tiny tensors).
  static void StepSerial(const CpuAdamTensor& t, int64_t begin, int64_t end);

 private:
  ThreadPool* pool_;
  int64_t block_elements_;
};

}  // namespace ferry

#endif  // FERRY_OPTIM_CPU_ADAM_H_
