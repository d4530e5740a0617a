#include "optim/cpu_adam.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "base/absl_compat.h"
#include "base/adam_element.h"
#include "base/grad_squares.h"
#include "ferry/status.h"
#include "optim/cpu_adam_kernels.h"

namespace ferry {

namespace cpu_adam_internal {

void AdamRangeScalar(const CpuAdamTensor& t, const AdamScalars& s, int64_t begin, int64_t end) {
  if (t.param_only) {
    // The new param alone (fp32 state, in place: Start checked); the state is read, not written.
    const float* const master = static_cast<const float*>(t.master);
    const float* const exp_avg = static_cast<const float*>(t.exp_avg);
    const float* const exp_avg_sq = static_cast<const float*>(t.exp_avg_sq);
    for (int64_t i = begin; i < end; ++i) {
      const size_t k = static_cast<size_t>(i);
      float p = master[k], m = exp_avg[k], v = exp_avg_sq[k];
      AdamUpdate(s, p, m, v, LoadAsF32(t.grad, t.grad_dtype, k));
      StoreFromF32(t.param, t.param_dtype, k, p);
    }
    if (t.grad_copy != nullptr && end > begin) {
      const size_t gs = DTypeSize(t.grad_dtype);
      std::memcpy(static_cast<char*>(t.grad_copy) + static_cast<size_t>(begin) * gs,
                  static_cast<const char*>(t.grad) + static_cast<size_t>(begin) * gs,
                  static_cast<size_t>(end - begin) * gs);
    }
    return;
  }
  if (t.master_src != nullptr) {
    // Out of place, element by element: the old state moves to its new place, then updates there.
    const size_t ms = DTypeSize(t.state.master), vs = DTypeSize(t.state.moments);
    const size_t b = static_cast<size_t>(begin), n = static_cast<size_t>(end - begin);
    std::memcpy(static_cast<char*>(t.master) + b * ms, static_cast<const char*>(t.master_src) + b * ms, n * ms);
    std::memcpy(static_cast<char*>(t.exp_avg) + b * vs, static_cast<const char*>(t.exp_avg_src) + b * vs, n * vs);
    std::memcpy(static_cast<char*>(t.exp_avg_sq) + b * vs, static_cast<const char*>(t.exp_avg_sq_src) + b * vs, n * vs);
    CpuAdamTensor in_place = t;
    in_place.master_src = in_place.exp_avg_src = in_place.exp_avg_sq_src = nullptr;
    AdamRangeScalar(in_place, s, begin, end);
    return;
  }
  if (!t.state.all_f32()) {
    AdamStepRangeTyped(s, t.state, t.rounding, t.master, t.exp_avg, t.exp_avg_sq, t.grad, t.grad_dtype, t.param,
                       t.param_dtype, begin, end);
    return;
  }
  float* const master = static_cast<float*>(t.master);
  float* const exp_avg = static_cast<float*>(t.exp_avg);
  float* const exp_avg_sq = static_cast<float*>(t.exp_avg_sq);
  for (int64_t i = begin; i < end; ++i) {
    AdamStepElement(s, master, exp_avg, exp_avg_sq, t.grad, t.grad_dtype, t.param, t.param_dtype,
                    static_cast<size_t>(i));
  }
}

}  // namespace cpu_adam_internal

namespace {

using cpu_adam_internal::AdamRangeFn;

// Tasks per participating thread. Tasks are claimed as threads become free, so a thread slowed by
// something else (the trainer's own threads, the copies submitted meanwhile) does not hold up the
// step; the last tasks of a round are what the other threads wait for at its end. Measured on the
// 735M bench_train model (H100 host, 16 threads, fp32 moments, overlap): 16 per thread took the
// overlapped iteration from 212-223 ms (4 per thread) to 191-204 ms, bf16 moments 166 -> 151-157 ms.
// A round of one chunk reaches 16 per thread only with blocks of 16K elements (kDefaultBlockElements).
// 32 per thread with 8K-element blocks was no better on the H200 machine (171.5-176.4 against
// 165.2-172.8 ms, interleaved).
constexpr int64_t kTasksPerThread = 16;

// The floating-point environment the kernels need, for the lifetime of the guard: round to nearest,
// all exceptions masked, no flush-to-zero, no denormals-are-zero (a trainer may have set FTZ/DAZ on its
// threads; the SIMD conversions and arithmetic would then differ from the scalar path and the GPU).
class ScopedDefaultFloatEnv {
 public:
#if defined(__x86_64__)
  ScopedDefaultFloatEnv() : saved_(_mm_getcsr()) { _mm_setcsr(kDefaultMxcsr); }
  ~ScopedDefaultFloatEnv() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kDefaultMxcsr = 0x1F80;  // all exceptions masked, nearest, no FTZ/DAZ
  unsigned saved_;
#else
  ScopedDefaultFloatEnv() = default;
#endif
};

bool ValidDType(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }
bool ValidStateDType(DType t) { return t == DType::kF32 || t == DType::kBF16; }

absl::Status CheckPointer(const void* p, size_t alignment, size_t index, absl::string_view what,
                          absl::string_view op) {
  if (p == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(op, ": tensor ", index, " has a null ", what));
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": tensor ", index, " ", what, " (", absl::Hex(reinterpret_cast<uintptr_t>(p)),
                     ") is not aligned to its element size of ", alignment, " bytes"));
  }
  return absl::OkStatus();
}

// CpuAdamTensor::param_only and grad_copy.
absl::Status CheckParamOnly(const CpuAdamTensor& t, size_t index) {
  if (!t.param_only) {
    if (t.grad_copy == nullptr) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("CpuAdam::Step: tensor ", index, " sets grad_copy without param_only"));
  }
  const char* wrong = !t.state.all_f32()        ? "a state that is not fp32"
                      : t.master_src != nullptr ? "out-of-place sources (the state is not written)"
                      : t.param == nullptr      ? "no param (it would write nothing)"
                                                : nullptr;
  if (wrong != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("CpuAdam::Step: tensor ", index, " is param_only with ", wrong));
  }
  if (t.grad_copy == nullptr) return absl::OkStatus();
  FERRY_RETURN_IF_ERROR(CheckPointer(t.grad_copy, DTypeSize(t.grad_dtype), index, "grad_copy", "CpuAdam::Step"));
  const auto at = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  const uintptr_t bytes = static_cast<uintptr_t>(t.numel) * DTypeSize(t.grad_dtype);
  if (at(t.grad_copy) < at(t.grad) + bytes && at(t.grad) < at(t.grad_copy) + bytes) {
    return absl::InvalidArgumentError(absl::StrCat("CpuAdam::Step: tensor ", index, " grad_copy overlaps its grad"));
  }
  return absl::OkStatus();
}

AdamRangeFn RangeFn(CpuAdamIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case CpuAdamIsa::kAvx2: return &cpu_adam_internal::AdamRangeAvx2;
    case CpuAdamIsa::kAvx512: return &cpu_adam_internal::AdamRangeAvx512;
    case CpuAdamIsa::kAvx512Bf16: return &cpu_adam_internal::AdamRangeAvx512Bf16;
#endif
    default: return &cpu_adam_internal::AdamRangeScalar;
  }
}

// The ISA to use for `requested` (kAuto: FERRY_CPU_ADAM, else the best), or why it cannot be used.
absl::StatusOr<CpuAdamIsa> ResolveIsa(CpuAdamIsa requested) {
  std::string source = "CpuAdamOptions::isa";
  if (requested == CpuAdamIsa::kAuto) {
    const char* env = std::getenv("FERRY_CPU_ADAM");
    if (env == nullptr || *env == '\0') return BestCpuAdamIsa();
    absl::StatusOr<CpuAdamIsa> parsed = ParseCpuAdamIsa(env);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("FERRY_CPU_ADAM: ", parsed.status().message()));
    }
    if (*parsed == CpuAdamIsa::kAuto) return BestCpuAdamIsa();
    requested = *parsed;
    source = "FERRY_CPU_ADAM";
  }
  if (!CpuSupportsAdamIsa(requested)) {
    return absl::FailedPreconditionError(absl::StrCat(
        source, "=", ToAbsl(CpuAdamIsaName(requested)),
        " but this CPU does not support it (best: ", ToAbsl(CpuAdamIsaName(BestCpuAdamIsa())), ")"));
  }
  return requested;
}

}  // namespace

std::string_view CpuAdamIsaName(CpuAdamIsa isa) {
  switch (isa) {
    case CpuAdamIsa::kAuto: return "auto";
    case CpuAdamIsa::kScalar: return "scalar";
    case CpuAdamIsa::kAvx2: return "avx2";
    case CpuAdamIsa::kAvx512: return "avx512";
    case CpuAdamIsa::kAvx512Bf16: return "avx512bf16";
  }
  return "invalid";
}

absl::StatusOr<CpuAdamIsa> ParseCpuAdamIsa(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(ToAbsl(name));
  for (CpuAdamIsa isa : {CpuAdamIsa::kAuto, CpuAdamIsa::kScalar, CpuAdamIsa::kAvx2, CpuAdamIsa::kAvx512,
                         CpuAdamIsa::kAvx512Bf16}) {
    if (n == CpuAdamIsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown CPU Adam implementation '", ToAbsl(name),
                                                 "' (expected auto, scalar, avx2, avx512 or avx512bf16)"));
}

bool CpuSupportsAdamIsa(CpuAdamIsa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case CpuAdamIsa::kAuto:
    case CpuAdamIsa::kScalar: return true;
    case CpuAdamIsa::kAvx2: return avx2;
    case CpuAdamIsa::kAvx512: return avx512;
    case CpuAdamIsa::kAvx512Bf16: return avx512 && __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return isa == CpuAdamIsa::kAuto || isa == CpuAdamIsa::kScalar;
#endif
}

CpuAdamIsa BestCpuAdamIsa() {
  for (CpuAdamIsa isa : {CpuAdamIsa::kAvx512Bf16, CpuAdamIsa::kAvx512, CpuAdamIsa::kAvx2}) {
    if (CpuSupportsAdamIsa(isa)) return isa;
  }
  return CpuAdamIsa::kScalar;
}

CpuAdam::CpuAdam(ThreadPool* pool, int64_t block_elements)
    : CpuAdam(pool, CpuAdamOptions{.isa = CpuAdamIsa::kAuto, .block_elements = block_elements}) {}

CpuAdam::CpuAdam(ThreadPool* pool, const CpuAdamOptions& options)
    : pool_(pool), block_elements_(options.block_elements > 0 ? options.block_elements : kDefaultBlockElements) {
  absl::StatusOr<CpuAdamIsa> isa = ResolveIsa(options.isa);
  if (isa.ok()) {
    isa_ = *isa;
  } else {
    init_status_ = isa.status();
  }
}

void CpuAdam::StepSerial(const CpuAdamTensor& t, int64_t begin, int64_t end) {
  cpu_adam_internal::AdamRangeScalar(t, *t.scalars, begin, end);
}

namespace {

// Task `task` of `num_tasks` over the joined range of `tensors` (ends[i]: the running end of tensor i):
// the elements [total * task / num_tasks, total * (task + 1) / num_tasks), tensor by tensor.
void RunTask(absl::Span<const CpuAdamTensor> tensors, absl::Span<const AdamScalars> scalars,
             const std::vector<int64_t>& ends, int64_t total, int64_t num_tasks,
             void (*range_fn)(const CpuAdamTensor&, const AdamScalars&, int64_t, int64_t), size_t task) {
  const ScopedDefaultFloatEnv float_env;
  const int64_t lo = total * static_cast<int64_t>(task) / num_tasks;
  const int64_t hi = total * (static_cast<int64_t>(task) + 1) / num_tasks;
  size_t i = static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin());
  for (int64_t at = lo; at < hi && i < tensors.size(); ++i) {
    const int64_t start = ends[i] - tensors[i].numel;
    const int64_t stop = std::min(ends[i], hi);
    if (stop > at) range_fn(tensors[i], scalars[i], at - start, stop - start);
    at = stop;
  }
}

}  // namespace

int64_t CpuAdam::NumTasks(int64_t total) const {
  const int64_t participants = static_cast<int64_t>(pool_->num_threads()) + 1;
  return std::max<int64_t>(1, std::min((total + block_elements_ - 1) / block_elements_,
                                       kTasksPerThread * participants));
}

// One Step's update on the pool: the tensors' elements laid end to end, cut into equal contiguous
// ranges (each thread walks memory sequentially, and a range covers several tensors when they are
// small). It owns copies of everything its tasks read, so that it can run while its caller goes on
// (Start).
struct CpuAdamRound {
  std::vector<CpuAdamTensor> tensors;
  std::vector<AdamScalars> scalars;
  std::vector<int64_t> ends;  // running end of each tensor in the joined range
  int64_t total = 0;
  int64_t num_tasks = 0;
  AdamRangeFn range_fn = nullptr;
  CpuAdamStepResult result;
  ThreadPool::Pending pending;
  // Tracing (when `tracer` is set): one slot per participating thread (the workers and whoever runs
  // a task while it waits), claimed by its first task of this round; only that thread writes it, and
  // the join orders those writes before Finish reads them.
  struct Slot {
    int tid = 0;
    int64_t start_ns = 0;
    int64_t end_ns = 0;
    int64_t elements = 0;
    int64_t cpu_start_ns = 0;  // the thread's CPU time (ThreadCpuNs) at start_ns and at end_ns
    int64_t cpu_end_ns = 0;
  };
  Tracer* tracer = nullptr;
  uint64_t id = 0;
  std::vector<Slot> slots;
  std::atomic<size_t> next_slot{0};
  double bytes_per_element = 0.0;  // CpuAdamTrafficBytes per element

  void Task(size_t task);
  void TracedTask(size_t task);
  // Joins the tasks, then records the threads' spans.
  void Finish();
};

void CpuAdamRound::Task(size_t task) {
  RunTask(tensors, scalars, ends, total, num_tasks, range_fn, task);
}

void CpuAdamRound::TracedTask(size_t task) {
  thread_local uint64_t my_round = 0;
  thread_local size_t my_slot = 0;
  const int64_t start_ns = tracer->NowNs();
  if (my_round != id) {
    my_round = id;
    my_slot = next_slot.fetch_add(1, std::memory_order_relaxed);
    if (my_slot < slots.size()) {
      tracer->NameThread("cpu adam worker", /*if_unnamed=*/true);
      slots[my_slot].tid = tracer->ThreadId();
      slots[my_slot].start_ns = start_ns;
      slots[my_slot].cpu_start_ns = ThreadCpuNs();
    }
  }
  Task(task);
  const int64_t lo = total * static_cast<int64_t>(task) / num_tasks;
  const int64_t hi = total * (static_cast<int64_t>(task) + 1) / num_tasks;
  if (my_slot < slots.size()) {
    slots[my_slot].end_ns = tracer->NowNs();
    slots[my_slot].cpu_end_ns = ThreadCpuNs();
    slots[my_slot].elements += hi - lo;
  }
}

void CpuAdamRound::Finish() {
  result.finished_ns = pending.Join();
  if (tracer == nullptr) return;
  const size_t used = std::min(next_slot.load(std::memory_order_relaxed), slots.size());
  for (size_t s = 0; s < used; ++s) {
    const Slot& slot = slots[s];
    tracer->Complete("cpu_adam.thread", "optim", slot.start_ns, slot.end_ns,
                     {{"elements", static_cast<double>(slot.elements)},
                      {"bytes", static_cast<double>(slot.elements) * bytes_per_element},
                      {"cpu_us", static_cast<double>(slot.cpu_end_ns - slot.cpu_start_ns) / 1e3}},
                     {}, slot.tid);
  }
  tracer = nullptr;
}

void CpuAdam::Post(Round& round) {
  round.ends.resize(round.tensors.size());
  for (size_t i = 0; i < round.tensors.size(); ++i) round.ends[i] = round.total += round.tensors[i].numel;
  if (round.total == 0) return;
  round.num_tasks = NumTasks(round.total);
  round.range_fn = RangeFn(isa_);
  if (tracer_ != nullptr) {
    static std::atomic<uint64_t> rounds{0};
    double traffic = 0.0;
    for (const CpuAdamTensor& t : round.tensors) traffic += CpuAdamTrafficBytes(t);
    round.tracer = tracer_;
    round.id = rounds.fetch_add(1, std::memory_order_relaxed) + 1;
    round.slots.resize(pool_->num_threads() + 1);
    round.bytes_per_element = traffic / static_cast<double>(round.total);
  }
  Round* const r = &round;
  round.pending = pool_->Post(static_cast<size_t>(round.num_tasks), [r](size_t task) {
    if (r->tracer != nullptr) {
      r->TracedTask(task);
    } else {
      r->Task(task);
    }
  });
}

CpuAdamPending::CpuAdamPending() = default;
CpuAdamPending::CpuAdamPending(CpuAdamPending&&) noexcept = default;
CpuAdamPending& CpuAdamPending::operator=(CpuAdamPending&& other) noexcept {
  if (this != &other) {
    Finish();
    round_ = std::move(other.round_);
  }
  return *this;
}
CpuAdamPending::~CpuAdamPending() { Finish(); }

bool CpuAdamPending::HelpOne() { return round_ != nullptr && round_->pending.RunOne(); }

CpuAdamStepResult CpuAdamPending::Finish() {
  if (round_ == nullptr) return CpuAdamStepResult{};
  round_->Finish();
  CpuAdamStepResult result = round_->result;
  round_.reset();
  return result;
}

absl::Status CpuAdam::Step(absl::Span<const CpuAdamTensor> tensors) {
  return Step(tensors, CpuAdamStepOptions{}).status();
}

absl::StatusOr<CpuAdamStepResult> CpuAdam::Step(absl::Span<const CpuAdamTensor> tensors,
                                                const CpuAdamStepOptions& options) {
  FERRY_ASSIGN_OR_RETURN(CpuAdamPending pending, Start(tensors, options));
  if (options.meanwhile != nullptr) (*options.meanwhile)();
  return pending.Finish();
}

absl::StatusOr<CpuAdamPending> CpuAdam::Start(absl::Span<const CpuAdamTensor> tensors,
                                              const CpuAdamStepOptions& options) {
  FERRY_RETURN_IF_ERROR(init_status_);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const CpuAdamTensor& t = tensors[i];
    if (t.numel < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("CpuAdam::Step: tensor ", i, " has negative length ", t.numel));
    }
    if (!ValidDType(t.grad_dtype) || !ValidDType(t.param_dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("CpuAdam::Step: tensor ", i, " has an invalid dtype (grad ",
                       static_cast<int>(t.grad_dtype), ", param ", static_cast<int>(t.param_dtype), ")"));
    }
    if (t.numel == 0) continue;
    if (t.scalars == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("CpuAdam::Step: tensor ", i, " has a null scalars"));
    }
    if (t.scalars->mode != AdamMode::kAdamW && t.scalars->mode != AdamMode::kAdamL2) {
      return absl::InvalidArgumentError(absl::StrCat("CpuAdam::Step: tensor ", i, " has an invalid mode ",
                                                     static_cast<int>(t.scalars->mode)));
    }
    if (!ValidStateDType(t.state.master) || !ValidStateDType(t.state.moments) ||
        (t.state.rounding != StateRounding::kNearest && t.state.rounding != StateRounding::kStochastic)) {
      return absl::InvalidArgumentError(absl::StrCat("CpuAdam::Step: tensor ", i, " has an invalid state format"));
    }
    FERRY_RETURN_IF_ERROR(CheckPointer(t.master, DTypeSize(t.state.master), i, "master", "CpuAdam::Step"));
    FERRY_RETURN_IF_ERROR(CheckPointer(t.exp_avg, DTypeSize(t.state.moments), i, "exp_avg", "CpuAdam::Step"));
    FERRY_RETURN_IF_ERROR(CheckPointer(t.exp_avg_sq, DTypeSize(t.state.moments), i, "exp_avg_sq", "CpuAdam::Step"));
    if ((t.master_src == nullptr) != (t.exp_avg_src == nullptr) || (t.master_src == nullptr) != (t.exp_avg_sq_src == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("CpuAdam::Step: tensor ", i, " sets some of master_src, exp_avg_src, exp_avg_sq_src but not all"));
    }
    if (t.master_src != nullptr) {
      FERRY_RETURN_IF_ERROR(CheckPointer(t.master_src, DTypeSize(t.state.master), i, "master_src", "CpuAdam::Step"));
      FERRY_RETURN_IF_ERROR(CheckPointer(t.exp_avg_src, DTypeSize(t.state.moments), i, "exp_avg_src", "CpuAdam::Step"));
      FERRY_RETURN_IF_ERROR(CheckPointer(t.exp_avg_sq_src, DTypeSize(t.state.moments), i, "exp_avg_sq_src", "CpuAdam::Step"));
    }
    FERRY_RETURN_IF_ERROR(CheckPointer(t.grad, DTypeSize(t.grad_dtype), i, "grad", "CpuAdam::Step"));
    if (t.param != nullptr) {
      FERRY_RETURN_IF_ERROR(CheckPointer(t.param, DTypeSize(t.param_dtype), i, "param", "CpuAdam::Step"));
    }
    FERRY_RETURN_IF_ERROR(CheckParamOnly(t, i));
  }
  if (!(options.grad_scale >= 0.0f) || !(options.grad_scale <= 3.4028234663852886e38f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CpuAdam::Step: grad_scale must be finite and > 0 (or 0 for none), got ", options.grad_scale));
  }
  if (!(options.max_grad_norm >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CpuAdam::Step: max_grad_norm must be >= 0, got ", options.max_grad_norm));
  }
  if (options.max_grad_norm > 0.0f && options.grad_stats == nullptr && !options.check_grads) {
    return absl::InvalidArgumentError(
        "CpuAdam::Step: max_grad_norm needs the gradient check (grad_stats or check_grads)");
  }

  CpuAdamPending pending;
  pending.round_ = std::make_unique<Round>();
  Round& round = *pending.round_;
  CpuAdamStepResult& result = round.result;
  const GradStats* stats = options.grad_stats;
  if (stats == nullptr && options.check_grads) {
    std::vector<CpuGradTensor> grads;
    grads.reserve(tensors.size());
    for (const CpuAdamTensor& t : tensors) grads.push_back(CpuGradTensor{t.grad, t.numel, t.grad_dtype});
    FERRY_ASSIGN_OR_RETURN(result.grad_stats, ComputeGradStats(grads));
    stats = &result.grad_stats;
  } else if (stats != nullptr) {
    result.grad_stats = *stats;
  }
  if (stats != nullptr && stats->found_inf != 0) {
    result.skipped = true;
    return pending;
  }

  std::vector<AdamScalars>& scalars = round.scalars;
  scalars.resize(tensors.size());
  const bool set_multiplier = options.grad_scale > 0.0f || options.max_grad_norm > 0.0f;
  const float multiplier =
      set_multiplier ? AdamGradMultiplier(options.grad_scale > 0.0f ? options.grad_scale : 1.0f,
                                          stats != nullptr ? stats->sum_sq : 0.0, options.max_grad_norm)
                     : 1.0f;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel == 0) continue;
    scalars[i] = *tensors[i].scalars;
    if (set_multiplier) scalars[i].grad_multiplier = multiplier;
  }
  round.tensors.assign(tensors.begin(), tensors.end());
  Post(round);
  return pending;
}

absl::StatusOr<GradStats> CpuAdam::ComputeGradStats(absl::Span<const CpuGradTensor> grads) {
  FERRY_RETURN_IF_ERROR(init_status_);
  std::vector<int64_t> ends(grads.size());  // running end of each tensor in the joined range
  int64_t total = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const CpuGradTensor& g = grads[i];
    if (g.numel < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("CpuAdam::ComputeGradStats: tensor ", i, " has negative length ", g.numel));
    }
    if (!ValidDType(g.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("CpuAdam::ComputeGradStats: tensor ", i,
                                                     " has an invalid dtype ", static_cast<int>(g.dtype)));
    }
    if (g.numel > 0) {
      FERRY_RETURN_IF_ERROR(CheckPointer(g.grad, DTypeSize(g.dtype), i, "grad", "CpuAdam::ComputeGradStats"));
    }
    ends[i] = total += g.numel;
  }
  // The sum is exact (base/exact_sum.h), so any split gives the same bits: tasks take equal contiguous
  // ranges of the tensors laid end to end, each sums its own, and the partial sums are added in any order.
  const int64_t num_tasks = NumTasks(total);
  std::vector<ExactSumSq> sums(static_cast<size_t>(num_tasks));
  std::vector<uint8_t> found_inf(static_cast<size_t>(num_tasks), 0);
  if (total > 0) {
    pool_->ParallelFor(static_cast<size_t>(num_tasks), [&](size_t task) {
      const int64_t lo = total * static_cast<int64_t>(task) / num_tasks;
      const int64_t hi = total * (static_cast<int64_t>(task) + 1) / num_tasks;
      GradSquareAccumulator acc;
      size_t i = static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin());
      for (int64_t at = lo; at < hi && i < grads.size(); ++i) {
        const int64_t start = ends[i] - grads[i].numel;
        const int64_t stop = std::min(ends[i], hi);
        if (stop > at) acc.Add(grads[i].grad, grads[i].dtype, at - start, stop - start);
        at = stop;
      }
      sums[task] = acc.Sum();
      found_inf[task] = acc.found_inf() ? 1 : 0;
    });
  }
  ExactSumSq sum{};
  bool any_inf = false;
  for (size_t task = 0; task < sums.size(); ++task) {
    if (total > 0) sum.Add(sums[task]);
    any_inf = any_inf || found_inf[task] != 0;
  }
  return GradStatsFromExact(sum, any_inf);
}

}  // namespace ferry
