// The device layer: the only code in Ferry that talks to CUDA.
//
// A Device owns memory, streams, events, asynchronous copies and the kernels. Two backends implement it:
//   - cuda: a real GPU (built only when nvcc was found at build time);
//   - host: "device memory" is ordinary host memory and every Stream is a worker thread that executes
//     its queue in order, so asynchrony, stream ordering and events are real and testable without a GPU.
// CreateDevice() picks the backend at run time: CUDA if a device is present, else host;
// the environment variable FERRY_DEVICE=host|cuda overrides.
// The host backend also checks what a GPU would only corrupt: new allocations are filled with 0xFF bytes
// (NaN in every float type), copies and memsets that run past the end of an allocation are refused,
// and a kernel that would is a stream error (details in host/host_device.h).
#ifndef FERRY_DEVICE_DEVICE_H_
#define FERRY_DEVICE_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/adam_math.h"
#include "base/adam_state.h"
#include "ferry/dtype.h"

namespace ferry {

enum class Backend : uint8_t { kHost, kCuda };
std::string_view BackendName(Backend b);  // "host" or "cuda"

enum class CopyKind : uint8_t { kHostToDevice, kDeviceToHost, kDeviceToDevice, kHostToHost };
std::string_view CopyKindName(CopyKind k);  // "host-to-device", ...

class Device;
class Stream;

// An Event marks a point in a stream's work. Like a CUDA event: Record() captures all work enqueued on
// the stream so far; Synchronize() and Stream::WaitFor() refer to the most recent Record() at the time
// they are called; an event never recorded counts as complete.
// Thread-safety: Record/WaitFor/Synchronize/Query may be called from any thread, but one thread at a
// time per event for Record.
class Event {
 public:
  virtual ~Event() = default;
  // Blocks the calling thread until the recorded work has finished.
  virtual absl::Status Synchronize() = 0;
  // True when the recorded work has finished (or the event was never recorded).
  virtual absl::StatusOr<bool> Query() = 0;
};

// A Stream executes its work (copies, kernels, host functions, event records and waits) in the order
// it was enqueued, asynchronously to the thread that enqueues it. Safe for concurrent use: enqueueing
// from several threads is allowed, the order between them is the order of the calls.
class Stream {
 public:
  virtual ~Stream() = default;
  // Records `event` at the current end of this stream.
  virtual absl::Status Record(Event& event) = 0;
  // Work enqueued on this stream after this call starts only after `event`'s recorded work finished.
  virtual absl::Status WaitFor(Event& event) = 0;
  // Blocks until all work enqueued so far has finished. Returns the first asynchronous error, if any.
  virtual absl::Status Synchronize() = 0;
  // Enqueues `fn` to run on a host thread in stream order. `fn` must not call device functions.
  virtual absl::Status EnqueueHost(std::function<void()> fn) = 0;
  // The backend's handle: a cudaStream_t on CUDA; nullptr for the host backend.
  virtual void* native() const = 0;
};

// Device memory, move-only. Freed (after a device-wide synchronize-free, see Device::Free) on destruction.
// Thread-safety: one thread at a time. REQUIRES: the Device outlives the buffer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, size_t bytes) : device_(device), data_(data), bytes_(bytes) {}
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  // Frees the memory now (no-op when empty).
  void Reset();

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// One tensor of a fused multi-tensor Adam launch. All pointers are device memory.
struct AdamTensorArgs {
  void* master = nullptr;      // master weights (`state.master`: fp32, or bf16), updated in place
  void* exp_avg = nullptr;     // m (`state.moments`)
  void* exp_avg_sq = nullptr;  // v (`state.moments`)
  const void* grad = nullptr;  // gradient, `grad_dtype`
  void* param = nullptr;       // model param, written as master rounded to `param_dtype`; may be null
  int64_t numel = 0;
  DType grad_dtype = DType::kF32;
  DType param_dtype = DType::kF32;
  uint32_t scalars_index = 0;  // index into the launch's `scalars`
  // How the state is stored (base/adam_state.h); with stochastic rounding, this step's key of the
  // param and the global index of element 0 (bit-identical to CpuAdam on the same key and indices).
  // The key is taken as given: a launch replayed with AdamRuntimeArgs::step (a captured graph)
  // rounds every replay with it, so such callers give a new key per step themselves.
  StateFormat state;
  StateRoundingKey rounding;
};

// Per-step inputs of Device::LaunchAdamWith that the kernel reads from device memory when it runs,
// rather than values fixed at enqueue time, so one captured CUDA graph serves every step. Every pointer
// is device memory and may be null (then the launch's AdamScalars are used as they are). When
// grad_scale is set or max_grad_norm > 0, every tensor's gradient multiplier becomes
// AdamGradMultiplier(*grad_scale or 1, grad_stats->sum_sq, max_grad_norm) (base/adam_math.h),
// replacing AdamScalars::grad_multiplier: the rule CpuAdam::Step follows too.
struct AdamRuntimeArgs {
  // This step's gradient check (GradStatsResult of a LaunchGradStats workspace, enqueued before on the
  // same stream, over the gradients of every group of the step). When found_inf is set the launch
  // changes nothing (no master, moment, param or step count): the step is skipped, and found_inf, read
  // back by the caller, is the report.
  const GradStats* grad_stats = nullptr;
  // With grad_stats: clip the unscaled gradients to this global L2 norm. 0: no clipping.
  float max_grad_norm = 0.0f;
  // The loss scale the gradients carry (they are divided by it). REQUIRES: *grad_scale > 0, finite.
  const float* grad_scale = nullptr;
  // [scalars.size()] learning rate of each scalar set, replacing AdamScalars::lr.
  const float* lr = nullptr;
  // [scalars.size()] steps completed by each scalar set: the update is step *step + 1 (its bias
  // corrections replace the AdamScalars'), and after the update the launch increments every entry,
  // unless the step was skipped.
  int64_t* step = nullptr;

  bool empty() const {
    return grad_stats == nullptr && max_grad_norm == 0.0f && grad_scale == nullptr && lr == nullptr &&
           step == nullptr;
  }
};

// One gradient tensor of LaunchGradStats. Device memory, aligned to its element size.
struct GradTensorArgs {
  const void* grad = nullptr;
  int64_t numel = 0;
  DType dtype = DType::kF32;
};

// LaunchGradStats' device workspace: the GradStats result first (read it there, or pass
// GradStatsResult(workspace) to LaunchAdamWith), then scratch: the exact partial sums of up to
// kGradStatsPartials blocks (an ExactSumSq's digits and a found-inf flag each), then one table entry per
// tensor. Its size for `num_tensors` tensors.
inline constexpr size_t kGradStatsResultBytes = 256;
static_assert(sizeof(GradStats) <= kGradStatsResultBytes, "GradStats outgrew its workspace slot");
inline constexpr size_t kGradStatsPartials = 1024;
inline constexpr size_t kGradStatsPartialBytes = 8 * ExactSumSq::kDigits + 8;
inline constexpr size_t kGradStatsScratchBytes = kGradStatsPartials * kGradStatsPartialBytes;
inline constexpr size_t kGradStatsTensorBytes = 32;
inline constexpr size_t GradStatsWorkspaceBytes(size_t num_tensors) {
  return kGradStatsResultBytes + kGradStatsScratchBytes + kGradStatsTensorBytes * num_tensors;
}
inline const GradStats* GradStatsResult(const void* workspace) {
  return static_cast<const GradStats*>(workspace);
}

// The checks both backends make before enqueueing LaunchAdamWith's runtime inputs: pointers aligned,
// max_grad_norm finite and >= 0 and only with grad_stats. Errors name the field.
absl::Status ValidateAdamRuntimeArgs(const AdamRuntimeArgs& runtime);
// The checks both backends make before enqueueing LaunchGradStats: numel >= 0, valid dtypes, non-empty
// grads non-null and aligned, the workspace non-null, 8-byte aligned and at least
// GradStatsWorkspaceBytes(grads.size()) bytes. Errors name the tensor's index.
absl::Status ValidateGradStatsArgs(absl::Span<const GradTensorArgs> grads, const void* workspace,
                                   size_t workspace_bytes);

// The checks both backends make before enqueueing LaunchAdam: every scalars_index in range, numel >= 0,
// master/exp_avg/exp_avg_sq/grad non-null and aligned to their element size when numel > 0 (param may
// be null), valid dtypes and modes. Errors name the tensor's index in `tensors`.
absl::Status ValidateAdamArgs(absl::Span<const AdamTensorArgs> tensors,
                              absl::Span<const AdamScalars> scalars);
// The same for LaunchConvert.
absl::Status ValidateConvertArgs(const void* dst, DType dst_dtype, const void* src, DType src_dtype,
                                 int64_t numel);

struct DeviceOptions {
  // "", "host" or "cuda". Empty means: FERRY_DEVICE if set, else cuda when a device is present, else host.
  std::string backend;
  int ordinal = 0;  // CUDA device ordinal
};

// Device: safe for concurrent use.
class Device {
 public:
  virtual ~Device() = default;

  virtual Backend backend() const = 0;
  // Human-readable: "NVIDIA H200 (cuda:0, sm_90, 139.8 GiB)" or "host (emulated device memory)".
  virtual std::string name() const = 0;
  virtual absl::StatusOr<size_t> FreeMemory() = 0;
  // The NUMA node of the host the device is attached to (its PCI device's numa_node in sysfs); -1
  // when unknown or not meaningful (the host backend).
  virtual int numa_node() const { return -1; }

  // Memory. Allocate(0) returns an empty buffer. Contents are uninitialised.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  // Frees memory from Allocate. Used by DeviceBuffer; callers need not call it. Waits for the work
  // enqueued so far on the whole device first (cudaFree synchronizes the device; the host backend
  // waits for every stream), so never call it on a hot path. A pointer that is not a live allocation
  // is logged and otherwise ignored (nullptr is a no-op).
  virtual void Free(void* data) = 0;

  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  // An event whose Synchronize() sleeps until the work completes, where CreateEvent's may spin a core
  // (CUDA's default schedule busy-waits; cudaEventBlockingSync here). For waits that can last as long
  // as the trainer's backward, so that they leave the core to CPU Adam; a wake-up costs tens of
  // microseconds more than a spinning wait, so short waits keep CreateEvent's. The host backend's
  // events always sleep.
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateBlockingEvent() { return CreateEvent(); }
  // A non-owning Stream over a trainer's native stream (a cudaStream_t; nullptr is the legacy default
  // stream). On the host backend `native` must be nullptr and the returned stream is the calling
  // thread: work enqueued on it runs before the call returns, and WaitFor blocks the caller.
  virtual absl::StatusOr<std::unique_ptr<Stream>> WrapStream(void* native) = 0;

  // Asynchronous copy of `bytes` in stream order. Host memory should be registered (PinnedArena) for
  // the copy to be truly asynchronous on CUDA: with pageable memory CUDA may block the caller until
  // the stream reaches the copy. REQUIRES: the memory stays valid until the copy ran.
  virtual absl::Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                                 Stream& stream) = 0;
  virtual absl::Status MemsetAsync(void* dst, uint8_t value, size_t bytes, Stream& stream) = 0;

  // Page-locks and registers host memory with the device (cudaHostRegister), once per region.
  // The host backend records the region (so stats and pairing checks behave the same).
  virtual absl::Status RegisterHost(void* data, size_t bytes) = 0;
  virtual absl::Status UnregisterHost(void* data) = 0;
  // Number of RegisterHost calls so far (a hot-path pinning counter for tests and stats).
  virtual uint64_t host_registrations() const = 0;

  // Whether device memory at `a` and at `b` lies in one allocation, so that one copy may span both
  // (CUDA refuses a copy that crosses from one cudaMalloc'd allocation into the next, even when they
  // happen to be adjacent). False when either is not memory of a live allocation this backend can
  // see (the host backend knows only its own Allocate's). Safe for concurrent use. Default: false.
  virtual bool SameAllocation(const void* a, const void* b) { return false; }

  // Kernels. Arguments are captured at enqueue time: `tensors` and `scalars` may be freed on return.
  // One fused launch updates every tensor: master, m, v in place and param = master rounded.
  virtual absl::Status LaunchAdam(absl::Span<const AdamTensorArgs> tensors,
                                  absl::Span<const AdamScalars> scalars, Stream& stream) = 0;
  // LaunchAdam with per-step inputs read from device memory when the kernel runs (AdamRuntimeArgs):
  // the step's gradient check (a skip when it found NaN or Inf), loss-scale unscaling, global-norm
  // clipping, and device-resident learning rates and step counts. Graph-capturable on CUDA: nothing is
  // allocated and nothing waits for the device. Bit-identical to CpuAdam on the same inputs.
  // The default implementation serves backends without it: with empty `runtime` it is LaunchAdam,
  // otherwise Unimplemented.
  virtual absl::Status LaunchAdamWith(absl::Span<const AdamTensorArgs> tensors,
                                      absl::Span<const AdamScalars> scalars, const AdamRuntimeArgs& runtime,
                                      Stream& stream);
  // The gradient check over `grads`: writes GradStats (the exact sum of squares of base/exact_sum.h,
  // so the same bits as CpuAdam::ComputeGradStats over the same elements split in any way, and
  // found_inf) at the start of `workspace` (device memory of GradStatsWorkspaceBytes(grads.size()) bytes, 8-byte aligned, owned by
  // the caller and untouched by others until the launch completed). Graph-capturable on CUDA. Default
  // implementation: Unimplemented.
  virtual absl::Status LaunchGradStats(absl::Span<const GradTensorArgs> grads, void* workspace,
                                       size_t workspace_bytes, Stream& stream);
  // dst[i] = src[i] converted from `src_dtype` to `dst_dtype` (round to nearest even), device memory.
  virtual absl::Status LaunchConvert(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                                     int64_t numel, Stream& stream) = 0;

  // Convenience: synchronous copy. Safe for concurrent use. Runs on WrapStream(nullptr): on CUDA that
  // is the legacy default stream, so the copy is ordered after work already enqueued there (and on
  // blocking streams), but not after work on streams from CreateStream (they are non-blocking).
  absl::Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind);

 protected:
  Device() = default;
};

// Creates the device chosen by `options` (see DeviceOptions::backend). Errors name what was asked for
// and what was found (for example "FERRY_DEVICE=cuda but this build has no CUDA backend").
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(const DeviceOptions& options = {});

// True when this build includes the CUDA backend.
bool BuiltWithCuda();

// The host NUMA node of every CUDA device, by ordinal (-1 where sysfs does not say); empty without
// the CUDA backend or a device. For splitting a host among ranks that each drive one GPU.
std::vector<int> CudaNumaNodes();

// The ordinals of the CUDA devices whose primary context this process holds; empty without the CUDA
// backend or a device. A rank that drives GPU r holds r's alone, however its threads call Ferry.
std::vector<int> CudaPrimaryContexts();

}  // namespace ferry

#endif  // FERRY_DEVICE_DEVICE_H_
