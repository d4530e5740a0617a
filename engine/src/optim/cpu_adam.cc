#include "optim/cpu_adam.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/adam_element.h"

namespace ferry {

CpuAdam::CpuAdam(ThreadPool* pool, int64_t block_elements)
    : pool_(pool), block_elements_(block_elements > 0 ? block_elements : (1 << 16)) {}

void CpuAdam::StepSerial(const CpuAdamTensor& t, int64_t begin, int64_t end) {
  const AdamScalars s = *t.scalars;
  for (int64_t i = begin; i < end; ++i) {
    const size_t k = static_cast<size_t>(i);
    AdamStepElement(s, t.master, t.exp_avg, t.exp_avg_sq, t.grad, t.grad_dtype, t.param, t.param_dtype, k);
  }
}

absl::Status CpuAdam::Step(absl::Span<const CpuAdamTensor> tensors) {
  struct Block {
    size_t tensor;
    int64_t begin;
    int64_t end;
  };
  std::vector<Block> blocks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const CpuAdamTensor& t = tensors[i];
    if (t.numel < 0) return absl::InvalidArgumentError(absl::StrCat("CpuAdam: tensor ", i, " has negative length"));
    if (t.numel == 0) continue;
    if (t.master == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr || t.grad == nullptr ||
        t.scalars == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("CpuAdam: tensor ", i, " has a null pointer"));
    }
    for (int64_t b = 0; b < t.numel; b += block_elements_) {
      blocks.push_back(Block{i, b, std::min(t.numel, b + block_elements_)});
    }
  }
  pool_->ParallelFor(blocks.size(), [&](size_t k) {
    const Block& b = blocks[k];
    StepSerial(tensors[b.tensor], b.begin, b.end);
  });
  return absl::OkStatus();
}

}  // namespace ferry
