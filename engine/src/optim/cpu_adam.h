// Adam / AdamW on the CPU, over base/adam_math.h's element update, and the CPU's gradient check.
//
// Three implementations of the element loop, chosen at run time by the CPU's features: AVX-512 (with
// AVX512-BF16 conversions where present), AVX2 + FMA + F16C, and scalar. All produce bit-identical
// results: the SIMD paths compile the same generic update (base/adam_update.inc) for their vectors, and
// their dtype conversions equal ferry/dtype.h's bit for bit (NaN, subnormals and overflow included).
// Work is split into contiguous ranges handed to the thread pool; each element's update is independent,
// so the result does not depend on the split or the thread count. The gradient check's sum of squares is
// exact (base/exact_sum.h, accumulated by base/grad_squares.h on every ISA), so it too is the same bits
// on every path, thread count and split of the tensors, and equal to Device::LaunchGradStats on any
// backend.
//
// The SIMD paths round exactly like the scalar one only under the default floating-point environment;
// each worker sets it (round to nearest, no flush-to-zero, no denormals-are-zero) for the duration of
// its work and restores the caller's afterwards.
#ifndef FERRY_OPTIM_CPU_ADAM_H_
#define FERRY_OPTIM_CPU_ADAM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/adam_math.h"
#include "base/adam_state.h"
#include "base/thread_pool.h"
#include "trace/tracer.h"
#include "ferry/dtype.h"

namespace ferry {

// One contiguous range of a tensor to update. All pointers are host memory, aligned to their element
// size.
struct CpuAdamTensor {
  void* master = nullptr;      // `state.master` (fp32 unless the state format says bf16)
  void* exp_avg = nullptr;     // `state.moments`
  void* exp_avg_sq = nullptr;  // `state.moments`
  const void* grad = nullptr;  // `grad_dtype`
  void* param = nullptr;       // written as master rounded to `param_dtype`; may be null
  int64_t numel = 0;
  DType grad_dtype = DType::kF32;
  DType param_dtype = DType::kF32;
  const AdamScalars* scalars = nullptr;  // this tensor's per-step scalars
  // How the state is stored (base/adam_state.h). With stochastic rounding, `rounding` gives this
  // step's key of the param and the global index of this range's element 0 (so any split of a tensor
  // into ranges, threads or ranks rounds the same).
  StateFormat state;
  StateRoundingKey rounding;
  // Out of place (a speculative step): when set, the state is read from these (in `state`'s dtypes)
  // and the new state written to master, exp_avg and exp_avg_sq (which must not overlap them). All
  // three or none.
  const void* master_src = nullptr;
  const void* exp_avg_src = nullptr;
  const void* exp_avg_sq_src = nullptr;
  // The param first, the state later (what the next forward needs, before what only the next step
  // reads): when set, the state is read (in place; no *_src) and not written, the param (required)
  // takes the new value, and `grad_copy` (when set; `grad_dtype`, not overlapping `grad`) the grad's
  // bits. An in-place update of the same tensor afterwards with `grad = grad_copy` and no param then
  // writes the state the whole update would have, bit for bit. fp32 state only.
  bool param_only = false;
  void* grad_copy = nullptr;
};

// One gradient tensor of a gradient check. Host memory, aligned to its element size.
struct CpuGradTensor {
  const void* grad = nullptr;
  int64_t numel = 0;
  DType dtype = DType::kF32;
};

// The implementations of the element loop.
enum class CpuAdamIsa : uint8_t {
  kAuto = 0,       // FERRY_CPU_ADAM when set, else the best this CPU supports
  kScalar = 1,     // plain C++ (the reference)
  kAvx2 = 2,       // AVX2 + FMA + F16C
  kAvx512 = 3,     // AVX-512 F/BW/VL/DQ; bf16 conversions in integer arithmetic
  kAvx512Bf16 = 4  // kAvx512 with AVX512-BF16's hardware fp32 -> bf16 conversion
};
// "auto", "scalar", "avx2", "avx512", "avx512bf16".
std::string_view CpuAdamIsaName(CpuAdamIsa isa);
// Parses the names above (the values of FERRY_CPU_ADAM).
absl::StatusOr<CpuAdamIsa> ParseCpuAdamIsa(std::string_view name);
// True when this CPU can run `isa` (kAuto and kScalar: always).
bool CpuSupportsAdamIsa(CpuAdamIsa isa);
// The fastest implementation this CPU supports.
CpuAdamIsa BestCpuAdamIsa();

// The smallest range of elements a CpuAdam task covers by default. A round of one 8 MiB chunk of bf16
// grads (4M elements) is then cut into 256 tasks (16 per thread on 16 threads), so the threads' last
// tasks end within ~50 us of each other; with 64K elements it was 64 tasks, and the round's tail
// (~70 us per thread) cost 1-chunk rounds 12% of their rate (135 against 150 GB/s, H200 machine trace).
// The 735M bench_train loop with overlap took 190-196 instead of 200-201 ms, and 165-173 instead of
// 174-193 ms, interleaved on one H200 host.
inline constexpr int64_t kDefaultBlockElements = int64_t{1} << 14;

struct CpuAdamOptions {
  // kAuto: the environment variable FERRY_CPU_ADAM (scalar|avx2|avx512|avx512bf16|auto) when set,
  // else the best this CPU supports. Anything else forces that implementation (tests, benchmarks).
  CpuAdamIsa isa = CpuAdamIsa::kAuto;
  // The smallest range handed to one thread (elements).
  int64_t block_elements = kDefaultBlockElements;
};

// Per-step inputs of Step beyond the tensors' AdamScalars (all optional).
struct CpuAdamStepOptions {
  // The gradient check of this step (from ComputeGradStats, or Device::LaunchGradStats copied to host
  // memory), covering every group of the step. When found_inf is set, Step changes nothing and
  // reports the skip.
  const GradStats* grad_stats = nullptr;
  // With no grad_stats: run ComputeGradStats over the tensors' own gradients first.
  bool check_grads = false;
  // The loss scale the gradients carry (> 0), or 0 for none.
  float grad_scale = 0.0f;
  // Clip the unscaled gradients to this global L2 norm (needs grad_stats or check_grads); 0: no clip.
  float max_grad_norm = 0.0f;
  // Work for the calling thread while the workers start on the update (the offload pipeline submits
  // its copies): run once when the arguments are valid (also for a skipped step), before Step
  // returns. Borrowed; null: none.
  const std::function<void()>* meanwhile = nullptr;
  // When grad_scale > 0 or max_grad_norm > 0, every tensor's gradient multiplier is replaced by
  // AdamGradMultiplier(grad_scale or 1, sum_sq, max_grad_norm) (the same rule as
  // Device::LaunchAdamWith, so both give the same bits).
};

struct CpuAdamStepResult {
  bool skipped = false;    // a NaN or Inf gradient was found: nothing was changed
  GradStats grad_stats{};  // the gradient check used (zero when none)
  // Start/Finish: when the round's last task ended (steady clock, SteadyNs), which is before Finish
  // returned when its caller came late; 0 when not known.
  int64_t finished_ns = 0;
};

// The host memory one update of `t` moves: master, m and v read and written (read only with
// `param_only`), the grad read, the param (when set) and the grad's copy (when set) written. For traces'
// GB/s.
inline double CpuAdamTrafficBytes(const CpuAdamTensor& t) {
  const double state = static_cast<double>(t.state.bytes_per_element());
  const double grad = static_cast<double>(DTypeSize(t.grad_dtype));
  return static_cast<double>(t.numel) *
         ((t.param_only ? 1.0 : 2.0) * state + grad + (t.grad_copy != nullptr ? grad : 0.0) +
          (t.param != nullptr ? static_cast<double>(DTypeSize(t.param_dtype)) : 0.0));
}

struct CpuAdamRound;

// A CpuAdam::Start whose tasks may still run on the pool. Finish waits for them and gives the step's
// result; destroying one unfinished finishes it. Move-only.
class CpuAdamPending final {
 public:
  CpuAdamPending();
  CpuAdamPending(CpuAdamPending&&) noexcept;
  CpuAdamPending& operator=(CpuAdamPending&& other) noexcept;
  CpuAdamPending(const CpuAdamPending&) = delete;
  CpuAdamPending& operator=(const CpuAdamPending&) = delete;
  ~CpuAdamPending();

  // Returns when every task has finished (their writes are visible after); waiting, the calling
  // thread runs tasks of rounds started after this one. Called again: an empty result.
  CpuAdamStepResult Finish();
  // Runs one of its tasks not yet claimed on the calling thread (a caller with something to watch
  // helps between looks); false when none was left.
  bool HelpOne();

 private:
  friend class CpuAdam;
  std::unique_ptr<CpuAdamRound> round_;
};

// CpuAdam updates many tensors on a thread pool. One thread at a time per object; the pool may be
// shared (but not called from one of its own tasks).
class CpuAdam final {
 public:
  // REQUIRES: `pool` outlives this object.
  explicit CpuAdam(ThreadPool* pool, int64_t block_elements = kDefaultBlockElements);
  CpuAdam(ThreadPool* pool, const CpuAdamOptions& options);

  // The implementation in use. When the one asked for (options or FERRY_CPU_ADAM) is unknown or not
  // supported by this CPU, init_status() says so, every call fails with it, and isa() is kScalar.
  CpuAdamIsa isa() const { return isa_; }
  const absl::Status& init_status() const { return init_status_; }

  // Updates every tensor in place. Errors (nothing changed): a null or misaligned pointer, a negative
  // length.
  absl::Status Step(absl::Span<const CpuAdamTensor> tensors);
  // The same with the step's gradient check, unscaling and clipping (see CpuAdamStepOptions).
  // Errors (nothing changed): as above, and options out of range (grad_scale < 0, max_grad_norm < 0,
  // clipping without a gradient check).
  absl::StatusOr<CpuAdamStepResult> Step(absl::Span<const CpuAdamTensor> tensors,
                                         const CpuAdamStepOptions& options);
  // Step without waiting: validates, runs the gradient check when asked (on the calling thread and
  // the pool), hands the update to the pool's workers and returns. The tensors' memory must stay as
  // it is until Finish (the tensor list itself is copied). `options.meanwhile` is not run (the caller
  // goes on with its own work). Rounds started one after another run back to back: a worker that
  // finds no task left in one starts on the next without waiting for the others, so a pipeline that
  // starts round k + 1 before finishing round k has no barrier between them. Errors: as Step's,
  // before anything runs.
  absl::StatusOr<CpuAdamPending> Start(absl::Span<const CpuAdamTensor> tensors, const CpuAdamStepOptions& options);

  // The gradient check over `grads` (the exact sum of squares of the finite elements, its rounding to
  // double, and whether any element is NaN or Inf; see GradStats). Errors: a null or misaligned
  // pointer, a negative length, an invalid dtype.
  absl::StatusOr<GradStats> ComputeGradStats(absl::Span<const CpuGradTensor> grads);

  // The scalar update of elements [begin, end) of `t` on the calling thread (the reference path).
  static void StepSerial(const CpuAdamTensor& t, int64_t begin, int64_t end);

  // Tracing: each Step then records one "cpu_adam.thread" span per participating thread (first task
  // start to last task end, with its elements and bytes of memory traffic). Borrowed; null: off.
  void set_tracer(Tracer* tracer) { tracer_ = tracer; }

 private:
  using Round = CpuAdamRound;
  // Sets the round's task split and hands its tasks to the pool (none when it has no elements).
  void Post(Round& round);
  // How many tasks `total` elements are cut into: kTasksPerThread per participating thread (the pool's
  // and the caller), none smaller than a block, at least one.
  int64_t NumTasks(int64_t total) const;

  ThreadPool* pool_;
  int64_t block_elements_;
  CpuAdamIsa isa_ = CpuAdamIsa::kScalar;
  absl::Status init_status_;
  Tracer* tracer_ = nullptr;
};

}  // namespace ferry

#endif  // FERRY_OPTIM_CPU_ADAM_H_
