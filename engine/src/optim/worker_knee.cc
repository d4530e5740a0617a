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
#include "ferry/status.h"
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
  if (ranks > 1) {
    return absl::StrCat(workers, " of ", rates.back().first, " workers per rank (CPU Adam's G params/s of ", ranks,
                        " ranks measuring together, by workers per rank: ", out,
                        absl::StrFormat("; measured in %.2f s)", seconds));
  }
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

size_t PickMostWithin(const std::vector<std::pair<size_t, double>>& rates, double tolerance) {
  double best = 0;
  for (const auto& [n, rate] : rates) best = std::max(best, rate);
  size_t most = 0;
  for (const auto& [n, rate] : rates) {
    if (rate >= (1.0 - tolerance) * best) most = std::max(most, n);
  }
  return most;
}

namespace {

// CPU Adam on scratch memory (fp32 master and moments, bf16 grads and params: the 28 bytes per element
// of an in-place update), allocated here and first touched by the widest pool, so that its pages are
// spread as the workers will use them.
class KneeScratch {
 public:
  KneeScratch(int64_t elements, size_t widest, const std::vector<int>& cpus) : n_(static_cast<size_t>(elements)) {
    master_ = Allocate(n_ * 4);
    m_ = Allocate(n_ * 4);
    v_ = Allocate(n_ * 4);
    grad_ = Allocate(n_ * 2);
    param_ = Allocate(n_ * 2);
    if (!ok()) return;
    ThreadPool pool(widest, 0, cpus, "ferry-knee");
    const size_t parts = widest * 4;
    pool.ParallelFor(parts, [&](size_t p) {
      const size_t lo = n_ * p / parts, hi = n_ * (p + 1) / parts;
      for (size_t i = lo; i < hi; ++i) {
        static_cast<float*>(master_.get())[i] = 0.01f;
        static_cast<float*>(m_.get())[i] = 0.0f;
        static_cast<float*>(v_.get())[i] = 0.0f;
        static_cast<uint16_t*>(grad_.get())[i] = 0x3c00;  // bf16 0.0078125
      }
    });
  }
  bool ok() const { return master_ && m_ && v_ && grad_ && param_; }

  size_t elements() const { return n_; }

  // CPU Adam's best rate of three steps (after one to warm up) with `workers` workers beside the
  // calling thread (as the engine's pool runs them), in G params/s; 0 when a step failed.
  double Rate(size_t workers, const std::vector<int>& cpus) {
    double best = 0;
    const absl::Status s = Steps(workers, cpus, [] { return absl::OkStatus(); }, [&](double seconds) {
      best = std::max(best, static_cast<double>(n_) / seconds / 1e9);
    });
    return s.ok() ? best : 0;
  }

  // With `workers` workers: one step to warm up, then `between()` (called even when the warm-up
  // failed, so that a rank keeps step with the others; its error is returned first), then
  // kTimedSteps steps, each one's seconds given to `each`. An error when a step failed.
  template <typename Between, typename Each>
  absl::Status Steps(size_t workers, const std::vector<int>& cpus, Between between, Each each) {
    ThreadPool pool(workers, -1, cpus, "ferry-knee");
    CpuAdam adam(&pool);
    AdamScalars scalars = MakeAdamScalars(AdamHyper{}, 1);
    CpuAdamTensor t{master_.get(), m_.get(), v_.get(), grad_.get(), param_.get(), static_cast<int64_t>(n_),
                    DType::kBF16, DType::kBF16, &scalars};
    const absl::Status warm = adam.Step({&t, 1});
    FERRY_RETURN_IF_ERROR(between());
    FERRY_RETURN_IF_ERROR(warm);
    for (int rep = 0; rep < kTimedSteps; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      FERRY_RETURN_IF_ERROR(adam.Step({&t, 1}));
      each(Seconds(t0));
    }
    return absl::OkStatus();
  }

  static constexpr int kTimedSteps = 3;

 private:
  size_t n_;
  Scratch master_, m_, v_, grad_, param_;
};

}  // namespace

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
  KneeScratch scratch(elements, max_workers, cpus);
  if (!scratch.ok()) return knee;  // no memory to measure with: take every worker
  for (size_t workers : KneeLadder(max_workers)) {
    const double rate = scratch.Rate(workers, cpus);
    if (rate <= 0) return knee;
    knee.rates.push_back({workers, rate});
  }
  knee.workers = std::max<size_t>(1, PickKnee(knee.rates, kKneeTolerance));
  knee.seconds = Seconds(start);
  cache->emplace(std::make_pair(max_workers, cpus), knee);
  return knee;
}

std::vector<size_t> SharedKneeLadder(size_t max_workers) {
  const size_t m = std::max<size_t>(1, max_workers);
  std::vector<size_t> ladder = {(m + 1) / 2, (3 * m + 3) / 4, m};
  ladder.erase(std::unique(ladder.begin(), ladder.end()), ladder.end());
  return ladder;
}

absl::StatusOr<WorkerKnee> MeasureSharedKnee(Comm& comm, size_t max_workers, const std::vector<int>& cpus,
                                             absl::Duration timeout, int64_t elements) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<size_t> ladder = SharedKneeLadder(max_workers);
  KneeScratch scratch(elements, ladder.back(), cpus);
  // [whether some rank could not measure, each count's seconds of the timed steps]: the ranks' most.
  // Each count's rate is the bytes every rank moved over the time the slowest took from a common
  // start: a rank's own best step, summed over the ranks, counts the steps a rank ran after the
  // others had finished (the whole host's bandwidth to itself) and overstated the larger counts.
  std::vector<double> most(1 + ladder.size(), 0.0);
  most[0] = scratch.ok() ? 0.0 : 1.0;
  for (size_t i = 0; i < ladder.size(); ++i) {
    FERRY_RETURN_IF_ERROR(comm.Barrier(timeout));  // every rank builds its pool and warms up at once
    absl::Status started;
    auto common_start = [&] { return started = comm.Barrier(timeout); };
    double seconds = 0;
    const absl::Status s =
        scratch.ok() ? scratch.Steps(ladder[i], cpus, common_start, [&](double t) { seconds += t; }) : common_start();
    FERRY_RETURN_IF_ERROR(started);  // a collective failed: every rank gets an error
    if (!scratch.ok() || !s.ok()) most[0] = 1.0;
    most[1 + i] = seconds;
  }
  FERRY_RETURN_IF_ERROR(comm.AllReduce(absl::MakeSpan(most), ReduceOp::kMax, timeout));
  WorkerKnee knee;
  knee.seconds = Seconds(start);
  knee.ranks = comm.world_size();
  if (most[0] > 0) return knee;  // some rank could not measure: keep the rule
  const double moved = static_cast<double>(scratch.elements()) * KneeScratch::kTimedSteps * comm.world_size();
  for (size_t i = 0; i < ladder.size(); ++i) knee.rates.push_back({ladder[i], moved / most[1 + i] / 1e9});
  knee.workers = std::max<size_t>(1, PickMostWithin(knee.rates, kSharedKneeTolerance));
  return knee;
}

}  // namespace ferry
