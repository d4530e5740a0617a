// `ferry bench adam`'s correctness sample: windows of elements spread over a tensor, their state
// captured before a run and replayed with the scalar reference (AdamStepRangeTyped) to compare with the
// kernel's result bit for bit, for any state format.
#ifndef FERRY_TESTS_BENCH_ADAM_SAMPLE_H_
#define FERRY_TESTS_BENCH_ADAM_SAMPLE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/adam_element.h"
#include "base/adam_state.h"
#include "ferry/dtype.h"
#include "ferry/status.h"

namespace ferry::bench {

// Windows of elements spread over a tensor: their state before a run (as stored), replayed with the
// scalar path.
struct Sample {
  std::vector<int64_t> starts;
  static constexpr int64_t kWindow = 67;  // odd: windows straddle vector boundaries
  StateFormat format;
  std::vector<uint8_t> master, m, v;  // before the run, window after window, in the stored dtypes
  std::vector<uint8_t> grad;          // the (constant) gradients of the windows

  Sample(int64_t n, const StateFormat& f = {}) : format(f) {
    for (int w = 0; w < 16; ++w) starts.push_back(std::max<int64_t>(0, (n - kWindow) * w / 15));
  }
  int64_t len(size_t w, int64_t n) const { return std::min(kWindow, n - starts[w]); }
};

using ReadFn = std::function<absl::Status(void* dst, const void* src, size_t bytes)>;

inline absl::Status Capture(Sample& s, int64_t n, const void* master, const void* m, const void* v, const void* grad,
                     DType grad_dtype, const ReadFn& read) {
  const size_t ms = DTypeSize(s.format.master), vs = DTypeSize(s.format.moments), gsz = DTypeSize(grad_dtype);
  s.master.clear();
  s.m.clear();
  s.v.clear();
  s.grad.clear();
  size_t at = 0;
  for (size_t w = 0; w < s.starts.size(); ++w) {
    const size_t len = static_cast<size_t>(s.len(w, n));
    const size_t e0 = static_cast<size_t>(s.starts[w]);
    s.master.resize((at + len) * ms);
    s.m.resize((at + len) * vs);
    s.v.resize((at + len) * vs);
    s.grad.resize((at + len) * gsz);
    FERRY_RETURN_IF_ERROR(read(s.master.data() + at * ms, static_cast<const uint8_t*>(master) + e0 * ms, len * ms));
    FERRY_RETURN_IF_ERROR(read(s.m.data() + at * vs, static_cast<const uint8_t*>(m) + e0 * vs, len * vs));
    FERRY_RETURN_IF_ERROR(read(s.v.data() + at * vs, static_cast<const uint8_t*>(v) + e0 * vs, len * vs));
    FERRY_RETURN_IF_ERROR(read(s.grad.data() + at * gsz, static_cast<const uint8_t*>(grad) + e0 * gsz, len * gsz));
    at += len;
  }
  return absl::OkStatus();
}

// One step of a run: its scalars and its stochastic-rounding key (of a tensor whose element 0 is
// global element 0).
struct StepInputs {
  AdamScalars scalars;
  uint64_t tensor_key = 0;
};

// The stochastic-rounding key of step `step` of the benchmark's tensor.
inline uint64_t BenchKey(int64_t step) { return RoundingTensorKey(7, 42, step); }

// Replays `steps` on the sample with the scalar path (AdamStepRangeTyped) and compares with the tensor
// now. Returns the number of elements that differ.
inline absl::StatusOr<int64_t> Verify(const Sample& s, int64_t n, const std::vector<StepInputs>& steps,
                               const void* master, const void* m, const void* v, DType grad_dtype,
                               const void* param, DType param_dtype, const ReadFn& read) {
  const size_t ms = DTypeSize(s.format.master), vs = DTypeSize(s.format.moments), gsz = DTypeSize(grad_dtype);
  const size_t ps = DTypeSize(param_dtype);
  std::vector<uint8_t> pm = s.master, mm = s.m, vm = s.v;
  int64_t bad = 0;
  size_t at = 0;
  for (size_t w = 0; w < s.starts.size(); ++w) {
    const size_t len = static_cast<size_t>(s.len(w, n));
    const size_t e0 = static_cast<size_t>(s.starts[w]);
    std::vector<uint8_t> want_param(len * ps);
    for (const StepInputs& step : steps) {
      AdamStepRangeTyped(step.scalars, s.format, StateRoundingKey{step.tensor_key, s.starts[w]}, pm.data() + at * ms,
                         mm.data() + at * vs, vm.data() + at * vs, s.grad.data() + at * gsz, grad_dtype,
                         param != nullptr ? want_param.data() : nullptr, param_dtype, 0, static_cast<int64_t>(len));
    }
    std::vector<uint8_t> gp(len * ms), gm(len * vs), gv(len * vs), gparam(len * ps);
    FERRY_RETURN_IF_ERROR(read(gp.data(), static_cast<const uint8_t*>(master) + e0 * ms, gp.size()));
    FERRY_RETURN_IF_ERROR(read(gm.data(), static_cast<const uint8_t*>(m) + e0 * vs, gm.size()));
    FERRY_RETURN_IF_ERROR(read(gv.data(), static_cast<const uint8_t*>(v) + e0 * vs, gv.size()));
    if (param != nullptr) {
      FERRY_RETURN_IF_ERROR(read(gparam.data(), static_cast<const uint8_t*>(param) + e0 * ps, gparam.size()));
    }
    for (size_t i = 0; i < len; ++i) {
      bool same = std::memcmp(&gp[i * ms], &pm[(at + i) * ms], ms) == 0 &&
                  std::memcmp(&gm[i * vs], &mm[(at + i) * vs], vs) == 0 &&
                  std::memcmp(&gv[i * vs], &vm[(at + i) * vs], vs) == 0;
      if (param != nullptr) same = same && std::memcmp(&gparam[i * ps], &want_param[i * ps], ps) == 0;
      if (!same) ++bad;
    }
    at += len;
  }
  return bad;
}

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_ADAM_SAMPLE_H_
