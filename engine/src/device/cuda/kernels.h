// The CUDA kernels' launch interface, shared by cuda_device.cc (host C++) and the .cu files (nvcc,
// C++17). Plain structs and functions only: the launchers return the launch's cudaError_t (from
// cudaGetLastError right after the launch) and the caller turns it into a Status.
#ifndef FERRY_DEVICE_CUDA_KERNELS_H_
#define FERRY_DEVICE_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/adam_math.h"
#include "ferry/dtype.h"

namespace ferry::cuda_kernels {

// Fused multi-tensor Adam. Every tensor is cut into chunks of kAdamChunkElems elements (its last chunk
// may be shorter); the chunks of all tensors of a launch are numbered consecutively, tensor by tensor.
// A block of kAdamThreads threads takes chunks blockIdx.x, blockIdx.x + gridDim.x, ..., finds each
// chunk's tensor by binary search over first_chunk, and updates its elements with coalesced accesses.
// So a thousand one-element tensors take a chunk (a block iteration) each, and one 2^30-element tensor
// spreads over every block of the grid; the grid is sized to fill the GPU once (see cuda_device.cc).
inline constexpr int kAdamThreads = 256;
inline constexpr int64_t kAdamChunkElems = 4096;  // 16 elements per thread per chunk
// Descriptors travel as kernel parameters (captured at launch, nothing to keep alive or free), which
// bounds one launch to this many tensors and scalar sets; LaunchAdam splits longer lists.
inline constexpr int kAdamMaxTensors = 320;
inline constexpr int kAdamMaxScalars = 16;

struct AdamTensorDesc {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  void* param;          // may be null
  int64_t numel;        // > 0
  int64_t first_chunk;  // index of this tensor's first chunk in the launch
  DType grad_dtype;
  DType param_dtype;
  uint16_t scalars_index;  // into AdamLaunchParams::scalars
};

struct AdamLaunchParams {
  AdamTensorDesc tensors[kAdamMaxTensors];
  AdamScalars scalars[kAdamMaxScalars];
  int64_t total_chunks;  // chunks of all tensors
  int32_t num_tensors;   // >= 1
};
// Kernel parameters may take 32,764 bytes on sm_70 and newer (CUDA 12.1+).
static_assert(sizeof(AdamLaunchParams) <= 32000, "AdamLaunchParams exceeds the kernel parameter space");

// Launches one fused Adam kernel over `params` with `grid` blocks on `stream`.
cudaError_t LaunchAdamKernel(const AdamLaunchParams& params, int grid, cudaStream_t stream);

// dst[i] = src[i] converted (LoadAsF32 / StoreFromF32), grid-stride with 64-bit indices.
inline constexpr int kConvertThreads = 256;
cudaError_t LaunchConvertKernel(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                                int64_t numel, int grid, cudaStream_t stream);

}  // namespace ferry::cuda_kernels

#endif  // FERRY_DEVICE_CUDA_KERNELS_H_
