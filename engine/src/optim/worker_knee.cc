#include "optim/worker_knee.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/adam_math.h"
#include "base/thread_pool.h"
#include "optim/cpu_adam.h"

namespace ferry {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Scratch = std::unique_ptr<void, FreeDeleter>;

Scratch Allocate(size_t bytes) { return Scratch(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)); }

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

std::string WorkerKnee::Describe() const {
  std::string out;
  for (const auto& [n, rate] : rates) absl::StrAppend(&out, out.empty() ? "" : ", ", n, ": ", absl::StrFormat("%.2f", rate));
  if (rates.empty()) return absl::StrCat(workers, " workers (not measured)");
  return absl::StrCat(workers, " of ", rates.back().first, " workers (CPU Adam's G params/s by workers: ", out,
                      absl::StrFormat("; measured in %.2f s)", seconds));
}

std::vector<size_t> KneeLadder(size_t max_workers) {
  std::vector<size_t> ladder;
  for (size_t n = 8; n < max_workers; n = n % 3 == 0 ? n / 3 * 4 : n / 2 * 3) ladder.push_back(n);  // 8 12 16 24 32 48 64
  ladder.push_back(std::max<size_t>(1, max_workers));
  return ladder;
}

size_t PickKnee(const std::vector<std::pair<size_t, double>>& rates, double tolerance) {
  double best = 0;
  for (const auto& [n, rate] : rates) best = std::max(best, rate);
  for (const auto& [n, rate] : rates) {
    if (rate >= (1.0 - tolerance) * best) return n;
  }
  return 0;
}

WorkerKnee MeasureWorkerKnee(size_t max_workers, const std::vector<int>& cpus, int64_t elements) {
  WorkerKnee knee;
  knee.workers = std::max<size_t>(1, max_workers);
  if (max_workers <= kKneeProbeAbove) return knee;
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<size_t, std::vector<int>>, WorkerKnee>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find({max_workers, cpus});
  if (it != cache->end()) return it->second;
  const auto start = std::chrono::steady_clock::now();
  // fp32 master and moments, bf16 grads and params: the 28 bytes per element of an in-place update.
  const size_t n = static_cast<size_t>(elements);
  Scratch master = Allocate(n * 4), m = Allocate(n * 4), v = Allocate(n * 4), grad = Allocate(n * 2),
          param = Allocate(n * 2);
  if (!master || !m || !v || !grad || !param) return knee;  // no memory to measure with: take every worker
  AdamScalars scalars = MakeAdamScalars(AdamHyper{}, 1);
  CpuAdamTensor t{master.get(), m.get(), v.get(), grad.get(), param.get(), elements, DType::kBF16, DType::kBF16,
                  &scalars};
  {
    // First touch by the widest pool, so that the pages are spread as the workers will use them.
    ThreadPool pool(max_workers, 0, cpus);
    const size_t parts = max_workers * 4;
    pool.ParallelFor(parts, [&](size_t p) {
      const size_t lo = n * p / parts, hi = n * (p + 1) / parts;
      for (size_t i = lo; i < hi; ++i) {
        static_cast<float*>(master.get())[i] = 0.01f;
        static_cast<float*>(m.get())[i] = 0.0f;
        static_cast<float*>(v.get())[i] = 0.0f;
        static_cast<uint16_t*>(grad.get())[i] = 0x3c00;  // bf16 0.0078125
      }
    });
  }
  for (size_t workers : KneeLadder(max_workers)) {
    // The engine's pool runs `workers` workers beside the thread that steps: the same here.
    ThreadPool pool(workers, -1, cpus);
    CpuAdam adam(&pool);
    if (!adam.Step({&t, 1}).ok()) return knee;  // warm-up
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!adam.Step({&t, 1}).ok()) return knee;
      const double s = Seconds(t0);
      best = std::max(best, static_cast<double>(elements) / s / 1e9);
    }
    knee.rates.push_back({workers, best});
  }
  knee.workers = std::max<size_t>(1, PickKnee(knee.rates, kKneeTolerance));
  knee.seconds = Seconds(start);
  cache->emplace(std::make_pair(max_workers, cpus), knee);
  return knee;
}

}  // namespace ferry
