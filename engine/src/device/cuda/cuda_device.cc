#include "device/cuda/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "base/logging.h"
#include "device/cuda/cuda_context.h"
#include "device/cuda/cuda_error.h"
#include "device/cuda/cuda_streams.h"
#include "device/cuda/kernels.h"
#include "ferry/status.h"

static_assert(sizeof(ferry::cuda_kernels::GradStatsPartial) == ferry::kGradStatsPartialBytes,
              "GradStatsPartial must match kGradStatsPartialBytes");

namespace ferry {
namespace {

using cuda_backend::AllocationStart;
using cuda_backend::AsCudaStream;
using cuda_backend::CheckNoPendingError;
using cuda_backend::CudaEvent;
using cuda_backend::CudaStream;
using cuda_backend::ScopedCudaDevice;

// This Abseil build's absl::string_view is not std::string_view, and StrCat takes only the former.
absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

cudaMemcpyKind ToCuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice: return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost: return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice: return cudaMemcpyDeviceToDevice;
    case CopyKind::kHostToHost: return cudaMemcpyHostToHost;
  }
  return cudaMemcpyDefault;
}

// Thread-safety: safe for concurrent use (immutable after creation; the counter is atomic).
class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::string name, int sm_count)
      : ordinal_(ordinal), name_(std::move(name)), sm_count_(sm_count), numa_node_(CudaDeviceNumaNode(ordinal)) {}

  Backend backend() const override { return Backend::kCuda; }
  std::string name() const override { return name_; }
  int numa_node() const override { return numa_node_; }

  absl::StatusOr<size_t> FreeMemory() override {
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    FERRY_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes), "FreeMemory");
    return free_bytes;
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer();
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    void* p = nullptr;
    FERRY_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes),
                               absl::StrCat("Allocate(", bytes, " bytes) on cuda:", ordinal_));
    return DeviceBuffer(this, p, bytes);
  }

  // cudaFree synchronizes the device (it waits for all work on it), so this blocks.
  void Free(void* data) override {
    if (data == nullptr) return;
    ScopedCudaDevice guard(ordinal_);
    if (!guard.status().ok()) {
      FERRY_LOG(ERROR) << "Device::Free(" << data << "): " << guard.status();
      return;
    }
    const cudaError_t err = cudaFree(data);
    if (err != cudaSuccess) {
      FERRY_LOG(ERROR) << CudaError(absl::StrFormat("cudaFree(%p) in Device::Free", data), err);
    }
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    cudaStream_t s = nullptr;
    FERRY_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "CreateStream");
    return std::unique_ptr<Stream>(std::make_unique<CudaStream>(ordinal_, s, /*owned=*/true));
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    cudaEvent_t e = nullptr;
    FERRY_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "CreateEvent");
    return std::unique_ptr<Event>(std::make_unique<CudaEvent>(ordinal_, e));
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateBlockingEvent() override {
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    cudaEvent_t e = nullptr;
    FERRY_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync),
                               "CreateBlockingEvent");
    return std::unique_ptr<Event>(std::make_unique<CudaEvent>(ordinal_, e));
  }

  absl::StatusOr<std::unique_ptr<Stream>> WrapStream(void* native) override {
    return std::unique_ptr<Stream>(
        std::make_unique<CudaStream>(ordinal_, static_cast<cudaStream_t>(native), /*owned=*/false));
  }

  absl::Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                         Stream& stream) override {
    FERRY_ASSIGN_OR_RETURN(CudaStream * s, AsCudaStream(stream, "CopyAsync"));
    if (bytes == 0) return absl::OkStatus();
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    FERRY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, ToCuda(kind), s->stream()),
                               absl::StrFormat("CopyAsync %s of %u bytes (dst %p, src %p)",
                                               ToAbsl(CopyKindName(kind)), bytes, dst, src));
    return absl::OkStatus();
  }

  absl::Status MemsetAsync(void* dst, uint8_t value, size_t bytes, Stream& stream) override {
    FERRY_ASSIGN_OR_RETURN(CudaStream * s, AsCudaStream(stream, "MemsetAsync"));
    if (bytes == 0) return absl::OkStatus();
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    FERRY_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, s->stream()),
                               absl::StrFormat("MemsetAsync of %u bytes at %p", bytes, dst));
    return absl::OkStatus();
  }

  absl::Status RegisterHost(void* data, size_t bytes) override {
    if (data == nullptr || bytes == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "RegisterHost(%p, %u bytes): need a non-null region of at least one byte", data, bytes));
    }
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    FERRY_CUDA_RETURN_IF_ERROR(cudaHostRegister(data, bytes, cudaHostRegisterDefault),
                               absl::StrFormat("RegisterHost(%p, %u bytes)", data, bytes));
    registrations_.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }

  absl::Status UnregisterHost(void* data) override {
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    FERRY_CUDA_RETURN_IF_ERROR(cudaHostUnregister(data), absl::StrFormat("UnregisterHost(%p)", data));
    return absl::OkStatus();
  }

  uint64_t host_registrations() const override { return registrations_.load(std::memory_order_relaxed); }

  bool SameAllocation(const void* a, const void* b) override {
    const uintptr_t start = AllocationStart(a);
    return start != 0 && start == AllocationStart(b);
  }

  absl::Status LaunchAdam(absl::Span<const AdamTensorArgs> tensors,
                          absl::Span<const AdamScalars> scalars, Stream& stream) override {
    return EnqueueAdam(tensors, scalars, AdamRuntimeArgs{}, stream);
  }
  absl::Status LaunchAdamWith(absl::Span<const AdamTensorArgs> tensors, absl::Span<const AdamScalars> scalars,
                              const AdamRuntimeArgs& runtime, Stream& stream) override {
    return EnqueueAdam(tensors, scalars, runtime, stream);
  }
  absl::Status LaunchGradStats(absl::Span<const GradTensorArgs> grads, void* workspace, size_t workspace_bytes,
                               Stream& stream) override;

  absl::Status LaunchConvert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t numel,
                             Stream& stream) override {
    FERRY_ASSIGN_OR_RETURN(CudaStream * s, AsCudaStream(stream, "LaunchConvert"));
    FERRY_RETURN_IF_ERROR(ValidateConvertArgs(dst, dst_dtype, src, src_dtype, numel));
    if (numel == 0) return absl::OkStatus();
    FERRY_CUDA_ENTER_DEVICE(ordinal_);
    const std::string what = absl::StrCat("LaunchConvert ", ToAbsl(DTypeName(src_dtype)), " -> ",
                                          ToAbsl(DTypeName(dst_dtype)), " of ", numel, " elements");
    if (dst_dtype == src_dtype) {
      FERRY_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst, src, static_cast<size_t>(numel) * DTypeSize(dst_dtype),
                          cudaMemcpyDeviceToDevice, s->stream()),
          what);
      return absl::OkStatus();
    }
    const int64_t blocks_needed =
        (numel + cuda_kernels::kConvertThreads - 1) / cuda_kernels::kConvertThreads;
    const int grid = static_cast<int>(std::min<int64_t>(blocks_needed, int64_t{sm_count_} * 8));
    FERRY_RETURN_IF_ERROR(CheckNoPendingError(what));
    FERRY_CUDA_RETURN_IF_ERROR(
        cuda_kernels::LaunchConvertKernel(dst, dst_dtype, src, src_dtype, numel, grid, s->stream()),
        what);
    return absl::OkStatus();
  }

 private:
  // LaunchAdam and LaunchAdamWith: the fused kernel in as few launches as the parameter space allows,
  // then (with runtime step counts) the step advance.
  absl::Status EnqueueAdam(absl::Span<const AdamTensorArgs> tensors, absl::Span<const AdamScalars> scalars,
                           const AdamRuntimeArgs& runtime, Stream& stream);

  const int ordinal_;
  const std::string name_;
  const int sm_count_;
  const int numa_node_;
  std::atomic<uint64_t> registrations_{0};
};

// The element index, modulo 4, from which an array's groups of 4 elements start vector-aligned (16
// bytes of fp32, 8 bytes of a 16-bit type); -1 when the array is not even element-aligned.
int VectorPhase(const void* p, size_t element_bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a % element_bytes != 0) return -1;
  return static_cast<int>((4 - (a % (4 * element_bytes)) / element_bytes) % 4);
}

// How the kernel accesses `t`: groups of 4 through vector loads from element `vec_head` of each chunk
// when master, exp_avg and exp_avg_sq agree on where groups start (kAdamNoVector otherwise); grad and
// param in vectors too when they agree with them.
void SetVectorAccess(const AdamTensorArgs& t, cuda_kernels::AdamTensorDesc& d) {
  const int head = VectorPhase(t.master, DTypeSize(t.state.master));
  d.vec_head = cuda_kernels::kAdamNoVector;
  d.grad_vec = 0;
  d.param_vec = 0;
  const size_t vs = DTypeSize(t.state.moments);
  if (head < 0 || VectorPhase(t.exp_avg, vs) != head || VectorPhase(t.exp_avg_sq, vs) != head) return;
  d.vec_head = static_cast<uint8_t>(head);
  d.grad_vec = VectorPhase(t.grad, DTypeSize(t.grad_dtype)) == head ? 1 : 0;
  d.param_vec = t.param != nullptr && VectorPhase(t.param, DTypeSize(t.param_dtype)) == head ? 1 : 0;
}

absl::Status CudaDevice::EnqueueAdam(absl::Span<const AdamTensorArgs> tensors,
                                     absl::Span<const AdamScalars> scalars, const AdamRuntimeArgs& runtime,
                                     Stream& stream) {
  FERRY_ASSIGN_OR_RETURN(CudaStream * s, AsCudaStream(stream, "LaunchAdam"));
  FERRY_RETURN_IF_ERROR(ValidateAdamArgs(tensors, scalars));
  FERRY_RETURN_IF_ERROR(ValidateAdamRuntimeArgs(runtime));
  if (runtime.step != nullptr && scalars.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchAdam: ", scalars.size(), " scalar sets"));
  }
  FERRY_CUDA_ENTER_DEVICE(ordinal_);
  // One launch per batch of up to kAdamMaxTensors tensors using up to kAdamMaxScalars scalar sets
  // (almost always a single launch). The batch's scalar sets are renumbered locally; the runtime
  // inputs stay indexed by the caller's numbering (scalars_global).
  auto params = std::make_unique<cuda_kernels::AdamLaunchParams>();
  params->grad_stats = runtime.grad_stats;
  params->grad_scale = runtime.grad_scale;
  params->lr = runtime.lr;
  params->step = runtime.step;
  params->max_grad_norm = runtime.max_grad_norm;
  size_t next = 0;
  int batch = 0;
  while (next < tensors.size()) {
    const size_t batch_begin = next;
    int num_tensors = 0;
    int num_scalars = 0;
    int64_t chunks = 0;
    for (; next < tensors.size() && num_tensors < cuda_kernels::kAdamMaxTensors; ++next) {
      const AdamTensorArgs& t = tensors[next];
      if (t.numel == 0) continue;
      int local = 0;
      while (local < num_scalars && params->scalars_global[local] != t.scalars_index) ++local;
      if (local == num_scalars) {
        if (num_scalars == cuda_kernels::kAdamMaxScalars) break;  // next batch
        params->scalars_global[num_scalars] = t.scalars_index;
        params->scalars[num_scalars] = scalars[t.scalars_index];
        ++num_scalars;
      }
      cuda_kernels::AdamTensorDesc& d = params->tensors[num_tensors++];
      d.master = t.master;
      d.exp_avg = t.exp_avg;
      d.exp_avg_sq = t.exp_avg_sq;
      d.grad = t.grad;
      d.param = t.param;
      d.numel = t.numel;
      d.first_chunk = chunks;
      d.grad_dtype = t.grad_dtype;
      d.param_dtype = t.param_dtype;
      d.scalars_index = static_cast<uint16_t>(local);
      d.state = static_cast<uint8_t>((t.state.master == DType::kBF16 ? cuda_kernels::kAdamMasterBf16 : 0) |
                                     (t.state.moments == DType::kBF16 ? cuda_kernels::kAdamMomentsBf16 : 0));
      if (d.state != 0 && t.state.rounding == StateRounding::kStochastic) d.state |= cuda_kernels::kAdamStochastic;
      d.round_key = t.rounding.tensor_key;
      d.index0 = t.rounding.index0;
      SetVectorAccess(t, d);
      chunks += (t.numel + cuda_kernels::kAdamChunkElems - 1) / cuda_kernels::kAdamChunkElems;
    }
    if (num_tensors == 0) continue;  // only empty tensors in this stretch
    params->num_tensors = num_tensors;
    params->num_scalars = num_scalars;
    params->total_chunks = chunks;
    const int max_grid =
        std::max(1, sm_count_ * cuda_kernels::AdamKernelBlocksPerSm(cuda_kernels::AdamLaunchIsTyped(*params)));
    const int grid = static_cast<int>(std::min<int64_t>(chunks, max_grid));
    FERRY_RETURN_IF_ERROR(CheckNoPendingError("LaunchAdam"));
    FERRY_CUDA_RETURN_IF_ERROR(cuda_kernels::LaunchAdamKernel(*params, grid, s->stream()),
                               absl::StrCat("LaunchAdam batch ", batch, " (tensors ", batch_begin, "..",
                                            next - 1, ", ", chunks, " chunks, grid ", grid, ")"));
    ++batch;
  }
  if (runtime.step != nullptr && !scalars.empty()) {
    FERRY_RETURN_IF_ERROR(CheckNoPendingError("LaunchAdam step advance"));
    FERRY_CUDA_RETURN_IF_ERROR(
        cuda_kernels::LaunchAdamAdvanceSteps(runtime.step, static_cast<int>(scalars.size()),
                                             runtime.grad_stats, s->stream()),
        "LaunchAdam step advance");
  }
  return absl::OkStatus();
}

absl::Status CudaDevice::LaunchGradStats(absl::Span<const GradTensorArgs> grads, void* workspace,
                                         size_t workspace_bytes, Stream& stream) {
  FERRY_ASSIGN_OR_RETURN(CudaStream * s, AsCudaStream(stream, "LaunchGradStats"));
  FERRY_RETURN_IF_ERROR(ValidateGradStatsArgs(grads, workspace, workspace_bytes));
  if (grads.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("LaunchGradStats: ", grads.size(), " tensors"));
  }
  FERRY_CUDA_ENTER_DEVICE(ordinal_);
  char* ws = static_cast<char*>(workspace);
  auto* result = reinterpret_cast<GradStats*>(ws);
  auto* partials = reinterpret_cast<cuda_kernels::GradStatsPartial*>(ws + kGradStatsResultBytes);
  auto* table =
      reinterpret_cast<cuda_kernels::GradStatsDesc*>(ws + kGradStatsResultBytes + kGradStatsScratchBytes);
  // The table of non-empty tensors goes to the workspace through kernel parameters, a batch at a time.
  auto upload = std::make_unique<cuda_kernels::GradStatsUpload>();
  upload->count = 0;
  upload->first = 0;
  int32_t entries = 0;
  int64_t chunks = 0;
  auto flush = [&]() -> absl::Status {
    if (upload->count == 0) return absl::OkStatus();
    FERRY_RETURN_IF_ERROR(CheckNoPendingError("LaunchGradStats"));
    FERRY_CUDA_RETURN_IF_ERROR(cuda_kernels::LaunchGradStatsUpload(*upload, table, s->stream()),
                               absl::StrCat("LaunchGradStats table upload of entries ", upload->first, ".. ",
                                            upload->first + upload->count - 1));
    upload->first += upload->count;
    upload->count = 0;
    return absl::OkStatus();
  };
  for (const GradTensorArgs& g : grads) {
    if (g.numel == 0) continue;
    cuda_kernels::GradStatsDesc& d = upload->tensors[upload->count++];
    d.grad = g.grad;
    d.numel = g.numel;
    d.first_chunk = chunks;
    d.dtype = static_cast<int32_t>(g.dtype);
    d.vector = reinterpret_cast<uintptr_t>(g.grad) % (4 * DTypeSize(g.dtype)) == 0 ? 1 : 0;
    chunks += (g.numel + cuda_kernels::kGradStatsChunkElems - 1) / cuda_kernels::kGradStatsChunkElems;
    ++entries;
    if (upload->count == cuda_kernels::kGradStatsUploadTensors) FERRY_RETURN_IF_ERROR(flush());
  }
  FERRY_RETURN_IF_ERROR(flush());
  // One wave of resident blocks (the kernel strides over the chunks), at most one per chunk; the result
  // does not depend on the grid.
  const int64_t resident = static_cast<int64_t>(sm_count_) * cuda_kernels::GradStatsBlocksPerSm();
  const int grid = static_cast<int>(
      std::max<int64_t>(1, std::min({static_cast<int64_t>(kGradStatsPartials), resident, chunks})));
  FERRY_RETURN_IF_ERROR(CheckNoPendingError("LaunchGradStats"));
  FERRY_CUDA_RETURN_IF_ERROR(
      cuda_kernels::LaunchGradStatsKernels(table, entries, chunks, partials, result, grid, s->stream()),
      absl::StrCat("LaunchGradStats (", entries, " tensors, ", chunks, " chunks, grid ", grid, ")"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return CudaError("cudaGetDeviceCount", err);
  return count;
}

int CudaDeviceNumaNode(int ordinal) {
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), ordinal) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  std::string id = absl::AsciiStrToLower(bus_id);  // sysfs names it "0000:3b:00.0"
  std::ifstream in(absl::StrCat("/sys/bus/pci/devices/", id, "/numa_node"));
  int node = -1;
  if (!(in >> node) || node < 0) return -1;
  return node;
}

std::vector<int> CudaDeviceNumaNodes() {
  absl::StatusOr<int> count = CudaDeviceCount();
  std::vector<int> nodes;
  for (int i = 0; count.ok() && i < *count; ++i) nodes.push_back(CudaDeviceNumaNode(i));
  return nodes;
}

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal) {
  FERRY_CUDA_ENTER_DEVICE(ordinal);
  cudaDeviceProp prop{};
  FERRY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal),
                             absl::StrCat("CreateDevice(cuda:", ordinal, ")"));
  const double gib = static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0);
  std::string name = absl::StrFormat("%s (cuda:%d, sm_%d%d, %.1f GiB)", prop.name, ordinal, prop.major,
                                     prop.minor, gib);
  return std::unique_ptr<Device>(
      std::make_unique<CudaDevice>(ordinal, std::move(name), prop.multiProcessorCount));
}

}  // namespace ferry
