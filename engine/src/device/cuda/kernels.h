// The CUDA kernels' launch interface, shared by cuda_device.cc (host C++) and the .cu files (nvcc,
// C++17). Plain structs and functions only: the launchers return the launch's cudaError_t (from
// cudaGetLastError right after the launch) and the caller turns it into a Status.
#ifndef FERRY_DEVICE_CUDA_KERNELS_H_
#define FERRY_DEVICE_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "base/adam_element.h"
#include "base/adam_math.h"
#include "base/exact_sum.h"
#include "ferry/dtype.h"

namespace ferry::cuda_kernels {

// Fused multi-tensor Adam. Every tensor is cut into chunks of kAdamChunkElems elements (its last chunk
// may be shorter); the chunks of all tensors of a launch are numbered consecutively, tensor by tensor.
// A block of kAdamThreads threads takes chunks blockIdx.x, blockIdx.x + gridDim.x, ..., finds each
// chunk's tensor by binary search over first_chunk, and updates its elements with coalesced accesses:
// groups of 4 elements through 16-byte loads and stores of the fp32 arrays (8 bytes for 16-bit grads
// and params) when the tensor's pointers allow, one element at a time otherwise. So a thousand
// one-element tensors take a chunk (a block iteration) each, and one 2^30-element tensor spreads over
// every block of the grid; the grid is sized to fill the GPU once (see cuda_device.cc). Indices are
// 64-bit throughout.
inline constexpr int kAdamThreads = 256;
inline constexpr int64_t kAdamChunkElems = 4096;  // 4 groups of 4 elements per thread per chunk
// Descriptors travel as kernel parameters (captured at launch, nothing to keep alive or free), which
// bounds one launch to this many tensors and scalar sets; LaunchAdam splits longer lists.
inline constexpr int kAdamMaxTensors = 320;
inline constexpr int kAdamMaxScalars = 16;
// AdamTensorDesc::vec_head when the tensor's pointers do not share one alignment phase: elementwise only.
inline constexpr uint8_t kAdamNoVector = 0xFF;

// AdamTensorDesc::state bits: which state tensors are bf16 and whether rounding is stochastic
// (0: the fp32 state of the original kernel).
inline constexpr uint8_t kAdamMasterBf16 = 1;
inline constexpr uint8_t kAdamMomentsBf16 = 2;
inline constexpr uint8_t kAdamStochastic = 4;

struct AdamTensorDesc {
  void* master;      // fp32, or bf16 with kAdamMasterBf16
  void* exp_avg;     // fp32, or bf16 with kAdamMomentsBf16
  void* exp_avg_sq;
  const void* grad;
  void* param;          // may be null
  int64_t numel;        // > 0
  int64_t first_chunk;  // index of this tensor's first chunk in the launch
  DType grad_dtype;
  DType param_dtype;
  uint16_t scalars_index;  // into AdamLaunchParams::scalars
  // Elements 0 .. vec_head-1 of each chunk go one by one; from vec_head on, every group of 4 elements
  // starts aligned (16 bytes for fp32, 8 for bf16) in master, exp_avg and exp_avg_sq (0..3), or
  // kAdamNoVector when those three disagree.
  uint8_t vec_head;
  // Whether grad / param groups start aligned too (16 bytes for f32, 8 for 16-bit), so they take one
  // vector access per group; otherwise their 4 elements are accessed one by one.
  uint8_t grad_vec;
  uint8_t param_vec;
  uint8_t state;        // kAdamMasterBf16 | kAdamMomentsBf16 | kAdamStochastic
  uint64_t round_key;   // stochastic rounding: this step's key of the param (StateRoundingKey)
  int64_t index0;       // global index of element 0
};
static_assert(sizeof(AdamTensorDesc) <= 88, "AdamTensorDesc grew");

struct AdamLaunchParams {
  AdamTensorDesc tensors[kAdamMaxTensors];
  AdamScalars scalars[kAdamMaxScalars];
  uint32_t scalars_global[kAdamMaxScalars];  // each local set's index in the caller's list
  // AdamRuntimeArgs (device memory; null when absent).
  const GradStats* grad_stats;
  const float* grad_scale;
  const float* lr;      // indexed by scalars_global
  const int64_t* step;  // indexed by scalars_global
  float max_grad_norm;
  int32_t num_scalars;   // >= 1
  int64_t total_chunks;  // chunks of all tensors
  int32_t num_tensors;   // >= 1
};
// Kernel parameters may take 32,764 bytes on sm_70 and newer (CUDA 12.1+).
static_assert(sizeof(AdamLaunchParams) <= 32000, "AdamLaunchParams exceeds the kernel parameter space");

// Whether any tensor of the launch has bf16 state (then the kernel's typed instantiation runs).
inline bool AdamLaunchIsTyped(const AdamLaunchParams& params) {
  for (int i = 0; i < params.num_tensors; ++i) {
    if (params.tensors[i].state != 0) return true;
  }
  return false;
}

// Launches one fused Adam kernel over `params` with `grid` blocks on `stream`.
cudaError_t LaunchAdamKernel(const AdamLaunchParams& params, int grid, cudaStream_t stream);
// After the Adam kernels of a launch: steps[i] += 1 for i < n, unless grad_stats (may be null) reports
// NaN or Inf.
cudaError_t LaunchAdamAdvanceSteps(int64_t* steps, int n, const GradStats* grad_stats, cudaStream_t stream);
// Resident blocks of the Adam kernel per multiprocessor (occupancy, asked once per process), for sizing
// its grid; >= 1. `typed`: of the instantiation for launches with bf16 state.
int AdamKernelBlocksPerSm(bool typed = false);

// The gradient check: the exact sum of squares of base/exact_sum.h. The tensor table lives in the
// caller's workspace (any number of tensors); it gets there through kernel parameters,
// kGradStatsUploadTensors at a time, so nothing on the host must outlive the launch. The tensors are cut
// into chunks of kGradStatsChunkElems elements, numbered consecutively tensor by tensor; `grid` blocks
// take chunks blockIdx.x, blockIdx.x + grid, ..., every thread summing its elements exactly
// (ExactSquareExpansion, spilling into a thread-local ExactSumSq); each block adds its threads' digits
// into one GradStatsPartial, and one block adds the partials into the result. Every addition is of
// integers, so the result does not depend on the grid, the chunking or the scheduling.
inline constexpr int64_t kGradStatsChunkElems = 4096;  // 4 groups of 4 elements per thread per chunk
inline constexpr int kGradStatsThreads = 256;
struct GradStatsDesc {
  const void* grad;
  int64_t numel;        // > 0
  int64_t first_chunk;  // in the launch's chunk numbering
  int32_t dtype;        // DType
  int32_t vector;       // 1: 4-element groups may use 16-byte (f32) / 8-byte (16-bit) loads
};
static_assert(sizeof(GradStatsDesc) == 32, "GradStatsDesc must match kGradStatsTensorBytes");
// One block's exact sum: unnormalised digits (each below 2^41) and whether it met NaN or Inf.
struct GradStatsPartial {
  int64_t digit[ExactSumSq::kDigits];
  uint32_t found_inf;
  uint32_t reserved;
};
inline constexpr int kGradStatsUploadTensors = 900;
struct GradStatsUpload {
  GradStatsDesc tensors[kGradStatsUploadTensors];
  int32_t count;
  int32_t first;  // index of tensors[0] in the table
};
static_assert(sizeof(GradStatsUpload) <= 32000, "GradStatsUpload exceeds the kernel parameter space");
cudaError_t LaunchGradStatsUpload(const GradStatsUpload& upload, GradStatsDesc* table, cudaStream_t stream);
// The partial sums of `grid` blocks (1 <= grid <= kGradStatsPartials) over `table` (num_tensors >= 0
// entries, total_chunks chunks) into partials[0 .. grid), then the result.
cudaError_t LaunchGradStatsKernels(const GradStatsDesc* table, int32_t num_tensors, int64_t total_chunks,
                                   GradStatsPartial* partials, GradStats* result, int grid,
                                   cudaStream_t stream);
// Resident blocks of the gradient check's partial kernel per multiprocessor (asked once); >= 1.
int GradStatsBlocksPerSm();

// dst[i] = src[i] converted (LoadAsF32 / StoreFromF32), grid-stride with 64-bit indices.
inline constexpr int kConvertThreads = 256;
cudaError_t LaunchConvertKernel(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                                int64_t numel, int grid, cudaStream_t stream);

}  // namespace ferry::cuda_kernels

#endif  // FERRY_DEVICE_CUDA_KERNELS_H_
