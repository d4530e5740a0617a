// Element-type conversion on the device: ferry/dtype.h's LoadAsF32 / StoreFromF32, the same functions
// as the host, so NaN payloads, infinities, signed zeros and subnormals come out bit-identical.
#include "device/cuda/kernels.h"

namespace ferry::cuda_kernels {
namespace {

__global__ void __launch_bounds__(kConvertThreads)
    ConvertKernel(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t numel) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    const size_t k = static_cast<size_t>(i);
    StoreFromF32(dst, dst_dtype, k, LoadAsF32(src, src_dtype, k));
  }
}

}  // namespace

cudaError_t LaunchConvertKernel(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                                int64_t numel, int grid, cudaStream_t stream) {
  ConvertKernel<<<grid, kConvertThreads, 0, stream>>>(dst, dst_dtype, src, src_dtype, numel);
  return cudaGetLastError();
}

}  // namespace ferry::cuda_kernels
