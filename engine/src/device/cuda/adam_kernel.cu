// The fused multi-tensor Adam kernel. The element update is base/adam_math.h's AdamUpdate, the same
// function the host backend and the CPU kernels call; the build compiles this file with --fmad=false,
// and sqrtf and division are IEEE-rounded by default, so the results equal the host's bit for bit.
#include "base/adam_element.h"
#include "device/cuda/kernels.h"

namespace ferry::cuda_kernels {
namespace {

__global__ void __launch_bounds__(kAdamThreads) AdamKernel(const AdamLaunchParams p) {
  for (int64_t chunk = blockIdx.x; chunk < p.total_chunks; chunk += gridDim.x) {
    // The tensor owning `chunk`: the last one whose first_chunk <= chunk.
    int lo = 0;
    int hi = p.num_tensors - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.tensors[mid].first_chunk <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const AdamTensorDesc& t = p.tensors[lo];
    const AdamScalars& s = p.scalars[t.scalars_index];
    const int64_t begin = (chunk - t.first_chunk) * kAdamChunkElems;
    const int64_t end = begin + kAdamChunkElems < t.numel ? begin + kAdamChunkElems : t.numel;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const size_t k = static_cast<size_t>(i);
      AdamStepElement(s, t.master, t.exp_avg, t.exp_avg_sq, t.grad, t.grad_dtype, t.param, t.param_dtype, k);
    }
  }
}

}  // namespace

cudaError_t LaunchAdamKernel(const AdamLaunchParams& params, int grid, cudaStream_t stream) {
  AdamKernel<<<grid, kAdamThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace ferry::cuda_kernels
