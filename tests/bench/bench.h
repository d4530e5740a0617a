// Benchmarks runnable as `ferry bench NAME [ARGS...]`. Each benchmark measures its hardware ceilings in
// the same run (pinned copies, device-to-device copy, STREAM triad) and prints its figures beside them
// as ratios; none asserts a time.
//
// A benchmark is a function `int Fn(int argc, char** argv)` (argv[0] is the benchmark's name; returns
// the process exit status) registered once with FERRY_BENCH in its own tests/bench/<name>_bench.cc.
#ifndef FERRY_TESTS_BENCH_BENCH_H_
#define FERRY_TESTS_BENCH_BENCH_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "device/device.h"
#include "ferry/status.h"

namespace ferry::bench {

using BenchFn = int (*)(int argc, char** argv);

struct BenchInfo {
  std::string name;
  std::string help;  // one line
  BenchFn fn;
};

// Every registered benchmark, sorted by name.
std::vector<BenchInfo> Benches();

struct Registrar {
  Registrar(const char* name, const char* help, BenchFn fn);
};

// Wall-clock seconds since an arbitrary point.
inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The median of `samples` (which it reorders). REQUIRES: not empty.
inline double Median(std::vector<double>& samples) {
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  return n % 2 == 1 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

// `n` 16-bit elements of device memory, filled with `fill` repeated. REQUIRES: `fill` not empty.
inline absl::StatusOr<DeviceBuffer> FilledBuffer16(Device& device, int64_t n, const std::vector<uint16_t>& fill) {
  FERRY_ASSIGN_OR_RETURN(DeviceBuffer b, device.Allocate(static_cast<size_t>(n) * 2));
  for (int64_t at = 0; at < n; at += static_cast<int64_t>(fill.size())) {
    const size_t len = static_cast<size_t>(std::min<int64_t>(n - at, static_cast<int64_t>(fill.size())));
    FERRY_RETURN_IF_ERROR(device.Copy(b.as<uint16_t>() + at, fill.data(), len * 2, CopyKind::kHostToDevice));
  }
  return b;
}

}  // namespace ferry::bench

#define FERRY_BENCH_CONCAT_INNER_(a, b) a##b
#define FERRY_BENCH_CONCAT_(a, b) FERRY_BENCH_CONCAT_INNER_(a, b)
// FERRY_BENCH(transfer, "pinned arena + Transfer vs pageable copies and the pinned ceiling", RunTransfer);
#define FERRY_BENCH(name, help, fn) \
  static ::ferry::bench::Registrar FERRY_BENCH_CONCAT_(ferry_bench_registrar_, name)(#name, help, fn)

#endif  // FERRY_TESTS_BENCH_BENCH_H_
