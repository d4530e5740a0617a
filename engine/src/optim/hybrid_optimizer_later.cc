// HybridOptimizer's state later (optim/state_later.h): the early pass writes the new params of some
// of a decided step's in-place pieces first and their state afterwards.
//
// Only decided updates are split: a piece updated in place by the early pass (begun after Step kept
// the speculation, a param without spare state, or a part Step queued once it decided), whose
// scalars are the step's; Step's own pipeline splits nothing. Such a piece's state is read by
// nothing before RunStateLater writes it: the early thread writes the pieces left at the start of its
// next pass, before any chunk, and in its idle time after a pass (yielding to a caller that waits for
// it); the trainer's thread writes them between steps
// (Settle, which every state read, write, save and Step runs first, but for the next step's first
// announcement, whose early pass writes them; Step before its own pipeline; RestoreParams, which
// reads the masters). A group whose update is undone or recomputed drops its pieces of that step
// first (their state is still the step before's); pieces a step before left are never dropped. A
// param keeps its side (its update is in place), so CommitSpare may run before or after its state
// is written.
#include <algorithm>
#include <utility>

#include "base/logging.h"
#include "ferry/status.h"
#include "optim/hybrid_optimizer.h"

namespace ferry {
namespace {

// Elements per round of RunStateLater: about 0.1 ms of a 16-thread host's CPU Adam, so that a round
// ends soon after a caller starts waiting for the early thread.
constexpr int64_t kLaterRoundElements = int64_t{1} << 22;

}  // namespace

void HybridOptimizer::StageStateLater(AdamWork& work) {
  if (!later_.on()) return;
  if (!later_.allocated()) {
    size_t grad_bytes = 0;
    for (const OptimParam& op : params_) {
      const Group& g = groups_[op.group];
      if (g.offloaded && g.format.all_f32()) grad_bytes += static_cast<size_t>(op.numel) * DTypeSize(op.grad_dtype);
    }
    if (absl::Status s = later_.Ensure(grad_bytes); !s.ok()) {
      FERRY_LOG(WARNING) << s << "; the state is written with the params";
      return;
    }
    later_kept_bytes_.store(later_.capacity(), std::memory_order_relaxed);
    later_limit_bytes_.store(later_.limit(), std::memory_order_relaxed);
  }
  for (size_t i = 0; i < work.tensors.size(); ++i) {
    CpuAdamTensor& t = work.tensors[i];
    const size_t p = work.params[i];
    // Out of place, `master` is not on the param's side (Stage checks the rest).
    if (t.master_src != nullptr) continue;
    const size_t e0 = static_cast<size_t>(static_cast<char*>(t.master) - StatePtr(p, StateKind::kMaster)) /
                      DTypeSize(t.state.master);
    later_.Stage(t, p, params_[p].group, e0);
  }
}

absl::Status HybridOptimizer::RunStateLater(bool yield) {
  if (later_.empty()) return absl::OkStatus();
  TraceSpan span(options_.tracer, "state_later", "optim");
  const std::vector<StateLater::Piece>& pieces = later_.pieces();
  size_t done = 0;
  double elements = 0.0;
  absl::Status status;
  while (done < pieces.size()) {
    if (yield) {
      if (early_waiters_.load(std::memory_order_relaxed) > 0) break;
      std::lock_guard<std::mutex> lock(early_mu_);
      if (!early_queue_.empty()) break;
    }
    AdamWork work;
    int64_t round = 0;
    size_t end = done;
    for (; end < pieces.size() && round < kLaterRoundElements; ++end) {
      const StateLater::Piece& piece = pieces[end];
      const OptimParam& op = params_[piece.param];
      CpuAdamTensor t;
      t.master = StatePtr(piece.param, StateKind::kMaster, piece.e0);
      t.exp_avg = StatePtr(piece.param, StateKind::kExpAvg, piece.e0);
      t.exp_avg_sq = StatePtr(piece.param, StateKind::kExpAvgSq, piece.e0);
      t.state = groups_[piece.group].format;
      t.grad = later_.grads(piece);
      t.grad_dtype = op.grad_dtype;
      t.param_dtype = op.dtype;
      t.numel = piece.n;
      t.scalars = &piece.scalars;
      work.tensors.push_back(t);
      work.params.push_back(piece.param);
      round += piece.n;
    }
    absl::StatusOr<RoundInFlight> flight = StartAdamRound(work, 0);
    if (!flight.ok()) {
      status = flight.status();
      break;
    }
    FinishAdamRound(*flight);
    cpu_later_bytes_.fetch_add(static_cast<uint64_t>(flight->bytes), std::memory_order_relaxed);
    elements += static_cast<double>(round);
    done = end;
  }
  if (span.on()) {
    span.Arg("elements", elements);
    span.Arg("left", static_cast<double>(pieces.size() - done));
    span.Arg("yield", yield ? 1.0 : 0.0);
    span.Arg("limit", static_cast<double>(later_.limit()));  // bytes of kept grads a cycle may stage
  }
  later_.Done(done, /*idle=*/yield);
  later_limit_bytes_.store(later_.limit(), std::memory_order_relaxed);
  return status;
}

absl::Status HybridOptimizer::FlushStateLater() {
  if (later_.empty()) return absl::OkStatus();
  {
    // Between steps the early thread runs only the idle-time rounds of RunStateLater (or nothing): it
    // yields to this wait.
    std::unique_lock<std::mutex> lock(early_mu_);
    WaitEarlyQuiet(lock);
  }
  return RunStateLater(/*yield=*/false);
}

void HybridOptimizer::DropStateLater(const std::vector<size_t>& groups) {
  if (later_.empty() || groups.empty()) return;
  std::vector<uint8_t> drop(groups_.size(), 0);
  for (size_t g : groups) drop[g] = 1;
  later_.Drop(drop);
}

}  // namespace ferry
