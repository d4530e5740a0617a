// HybridOptimizer's early steps (see BeginGroups in hybrid_optimizer.h): offloaded groups whose grads
// are final start their D2H, CPU Adam and H2D on a background thread during the trainer's backward,
// speculating that the step neither clips nor skips. Step then keeps or recomputes each such group.
//
// Why it is exact: a speculative update reads the group's state and writes its spare buffers, so the
// state itself never changes until Step has validated the speculation (the step's AdamScalars of the
// group equal the ones the speculation used, bit for bit: the same learning rate, step and gradient
// multiplier give the same update from the same grads and state). A kept update swaps the buffers; a
// discarded one leaves them, and the group runs through the ordinary in-place pipeline, which rewrites
// its params. A skipped step rewrites the params from the masters. Double buffering was chosen over
// keeping a copy of the old state: the speculative pass then moves the same bytes as an in-place one
// (read the state, write the state), where a copy adds a third stream of writes; both need as much
// pinned memory again as the offloaded state.
//
// A deferred Step (see HybridOptimizer::deferred) leaves the rest of the early work running after it
// returns; Settle commits it. The early pass itself is in hybrid_optimizer_early_pass.cc.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/thread_affinity.h"
#include "ferry/status.h"
#include "optim/hybrid_optimizer.h"

namespace ferry {
namespace {

// Whether two sets of scalars give the same update: every field, bit for bit.
bool SameScalars(const AdamScalars& a, const AdamScalars& b) {
  const float fa[] = {a.lr, a.beta1, a.beta2, a.one_minus_beta1, a.one_minus_beta2, a.eps, a.weight_decay,
                      a.inv_bias_correction1, a.inv_sqrt_bias_correction2, a.grad_multiplier};
  const float fb[] = {b.lr, b.beta1, b.beta2, b.one_minus_beta1, b.one_minus_beta2, b.eps, b.weight_decay,
                      b.inv_bias_correction1, b.inv_sqrt_bias_correction2, b.grad_multiplier};
  return std::memcmp(fa, fb, sizeof(fa)) == 0 && a.mode == b.mode && a.bias_correction == b.bias_correction;
}

}  // namespace

absl::Status HybridOptimizer::BeginGroups(absl::Span<const size_t> groups, const HybridStepParams& params,
                                          Stream& trainer) {
  FERRY_RETURN_IF_ERROR(CheckStepParams(params));
  std::vector<bool> seen(groups_.size(), false);
  for (size_t g : groups) {
    if (g >= groups_.size()) return absl::InvalidArgumentError(absl::StrCat("no group ", g));
    if (seen[g] || (step_in_progress() && early_.announced[g])) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", groups_[g].name, "' was already announced in this step"));
    }
    seen[g] = true;
  }
  if (!step_in_progress()) FERRY_RETURN_IF_ERROR(StartEarlyStep(trainer));
  std::vector<size_t> ps;  // the groups' params not announced yet
  for (size_t g : groups) {
    for (size_t p : groups_[g].params) {
      if (!early_.param_announced[p]) ps.push_back(p);
    }
  }
  return Announce(ps, std::vector<size_t>(groups.begin(), groups.end()), params, trainer);
}

absl::Status HybridOptimizer::BeginParams(absl::Span<const size_t> ps, const HybridStepParams& params,
                                          Stream& trainer) {
  FERRY_RETURN_IF_ERROR(CheckStepParams(params));
  if (ps.empty()) return absl::InvalidArgumentError("no param named");
  std::vector<size_t> sorted(ps.begin(), ps.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    const size_t p = sorted[i];
    if (p >= params_.size()) return absl::InvalidArgumentError(absl::StrCat("no param ", p));
    if ((i > 0 && sorted[i - 1] == p) || (step_in_progress() && early_.param_announced[p])) {
      return absl::InvalidArgumentError(
          absl::StrCat("param '", params_[p].name, "' was already announced in this step"));
    }
  }
  if (!step_in_progress()) FERRY_RETURN_IF_ERROR(StartEarlyStep(trainer));
  return Announce(std::vector<size_t>(ps.begin(), ps.end()), {}, params, trainer);
}

absl::Status HybridOptimizer::StartEarlyStep(Stream& trainer) {
  // The first announcement of a step: the last step is committed and its copies are done (the
  // staging is free). The state later it left is written by the early pass before its first chunk
  // (or by Step before its own pipeline), not here on the trainer's thread.
  FERRY_RETURN_IF_ERROR(Settle(/*flush_state_later=*/false));
  FERRY_RETURN_IF_ERROR(WaitEarlyIdle());
  later_.NextStep();  // the early thread is idle: this step's pieces are told from those left
  FERRY_RETURN_IF_ERROR(WaitPending());
  if (snapshot_pending_) {
    // A checkpoint's copies of the params go before any of this step's uploads.
    FERRY_RETURN_IF_ERROR(trainer.WaitFor(*snapshot_done_));
    snapshot_pending_ = false;
  }
  const size_t n = groups_.size();
  early_ = EarlyStep{};
  early_.touched.assign(n, false);
  early_.announced.assign(n, false);
  early_.left.resize(n);
  early_.unqueued.resize(n);
  for (size_t g = 0; g < n; ++g) early_.left[g] = early_.unqueued[g] = groups_[g].params.size();
  early_.param_announced.assign(params_.size(), false);
  early_.scalars.assign(n, AdamScalars{});
  early_.mixed.assign(n, 0);
  early_.queued.assign(n, 0);
  part_of_param_.assign(params_.size(), -1);
  parts_used_ = 0;
  std::lock_guard<std::mutex> lock(early_mu_);
  early_done_.assign(n, 0);
  early_kept_ = false;
  kept_in_place_.assign(params_.size(), 0);
  early_in_place_.assign(n, 0);
  part_done_.clear();
  group_parts_left_.assign(n, 0);
  group_all_queued_.assign(n, 0);
  return absl::OkStatus();
}

absl::Status HybridOptimizer::Announce(const std::vector<size_t>& ps, const std::vector<size_t>& whole,
                                       const HybridStepParams& params, Stream& trainer) {
  // The speculation: no clipping, no NaN/Inf (the multiplier Step uses when nothing clips).
  const double multiplier = 1.0 / static_cast<double>(params.loss_scale);
  auto touch = [&](size_t g) {
    const AdamScalars scalars = GroupScalars(g, params, multiplier);
    if (!early_.touched[g]) {
      early_.touched[g] = true;
      early_.order.push_back(g);
      early_.scalars[g] = scalars;
    } else if (!SameScalars(early_.scalars[g], scalars)) {
      early_.mixed[g] = 1;  // its parts disagree: Step recomputes it
    }
  };
  std::vector<std::vector<size_t>> fresh(groups_.size());  // per group: params announced now
  std::vector<size_t> offloaded;
  for (size_t p : ps) {
    const size_t g = params_[p].group;
    touch(g);
    early_.param_announced[p] = true;
    if (--early_.left[g] == 0) early_.announced[g] = true;
    fresh[g].push_back(p);
    if (groups_[g].offloaded) offloaded.push_back(p);
  }
  if (!offloaded.empty()) early_.announcements.push_back(std::move(offloaded));
  for (size_t g : whole) {
    if (!early_.touched[g]) touch(g);
    early_.announced[g] = true;
  }
  // The offloaded params of the announcement, one part: their chunks coalesce across groups (a
  // decay / no-decay bucket's biases ride with its weights).
  EarlyPart part;
  part.priority = static_cast<int64_t>(early_.announcements.size()) - 1;  // the one just added
  bool any = false;
  for (size_t g = 0; g < groups_.size(); ++g) any = any || (!fresh[g].empty() && groups_[g].offloaded);
  if (!any || !(speculate_ || speculate_always_)) return absl::OkStatus();
  FERRY_RETURN_IF_ERROR(EnsureSpareState());
  for (size_t g = 0; g < groups_.size(); ++g) {
    // A param without spare state (EngineOptions::spare_state_fraction) updates once Step knows the step.
    bool in_part = false;
    for (size_t p : fresh[g]) {
      if (!HasSpare(p)) continue;
      part.params.push_back(p);
      in_part = true;
    }
    if (in_part) part.groups.push_back(g);
  }
  if (part.params.empty()) return absl::OkStatus();
  std::vector<EarlyPart> parts;
  parts.push_back(std::move(part));
  return QueueParts(std::move(parts), early_.scalars, trainer);
}

absl::Status HybridOptimizer::QueueParts(std::vector<EarlyPart> parts, const std::vector<AdamScalars>& scalars,
                                         Stream& trainer, bool in_place) {
  if (early_.events_used == early_events_.size()) {
    // Blocking: the early thread sleeps on it until the trainer's stream reaches this point.
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Event> event, device_->CreateBlockingEvent());
    early_events_.push_back(std::move(event));
  }
  Event* ready = early_events_[early_.events_used].get();
  FERRY_RETURN_IF_ERROR(trainer.Record(*ready));
  ++early_.events_used;
  while (part_events_.size() < parts_used_ + parts.size()) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Event> event, device_->CreateEvent());
    part_events_.push_back(std::move(event));
  }
  std::vector<size_t> completed;  // groups every param of which is in a part now
  for (EarlyPart& part : parts) {
    part.id = parts_used_++;
    part.uploaded = part_events_[part.id].get();
    for (size_t p : part.params) {
      part_of_param_[p] = static_cast<int64_t>(part.id);
      const size_t g = params_[p].group;
      early_.queued[g] = 1;
      if (--early_.unqueued[g] == 0) completed.push_back(g);
    }
  }
  std::vector<int64_t> steps(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) steps[g] = groups_[g].step + 1;
  {
    std::lock_guard<std::mutex> lock(early_mu_);
    part_done_.resize(parts_used_, 0);
    for (const EarlyPart& part : parts) {
      for (size_t g : part.groups) ++group_parts_left_[g];
    }
    for (size_t g : completed) group_all_queued_[g] = 1;
    early_queue_.push_back(EarlyItem{std::move(parts), ready, in_place, scalars, std::move(steps)});
  }
  if (!early_thread_.joinable()) early_thread_ = std::thread([this] {
      NameCurrentThread("ferry-early");
      EarlyLoop();
    });
  early_cv_.notify_all();
  return absl::OkStatus();
}

absl::Status HybridOptimizer::QueueRest(const std::vector<size_t>& groups, const std::vector<AdamScalars>& scalars,
                                        Stream& trainer, bool in_place) {
  // Buckets of about two chunks of grads, each with the priority of the announcement that held its
  // params (EarlyPart::priority): the early thread takes them in the order the next forward needs
  // them, which is the announcements' of this step's backward, reversed (a backward announces the
  // last layers first, and one announcement holds a layer's params of every group: decay / no-decay
  // groups interleave layer by layer, while their params are registered group by group, so the
  // registration order would put the first layer's biases after every weight). Speculating parts
  // not started yet (groups with spare state under a budget, when the CPU is behind the backward)
  // carry their announcement's priority too, so they go between these, where the forward needs
  // them, not after all of them. Params no announcement named go in registration order, last.
  const size_t bucket = std::max<size_t>(2 * options_.chunk_bytes, 1);
  std::vector<uint8_t> wanted(groups_.size(), 0);
  for (size_t g : groups) wanted[g] = groups_[g].offloaded ? 1 : 0;
  std::vector<EarlyPart> parts;
  // The params of `ps` that no part holds yet, in buckets in their order, appended to `parts`
  // last-to-first. The lists passed are disjoint: a param is announced at most once a step, and the
  // unnamed ones are those never announced.
  auto add = [&](const std::vector<size_t>& ps, int64_t priority) {
    std::vector<EarlyPart> run;
    EarlyPart part;
    part.priority = priority;
    size_t bytes = 0;
    for (size_t p : ps) {
      const size_t g = params_[p].group;
      if (wanted[g] == 0 || part_of_param_[p] >= 0) continue;
      if (std::find(part.groups.begin(), part.groups.end(), g) == part.groups.end()) part.groups.push_back(g);
      part.params.push_back(p);
      bytes += static_cast<size_t>(params_[p].numel) * DTypeSize(params_[p].grad_dtype);
      if (bytes >= bucket) {
        run.push_back(std::move(part));
        part = EarlyPart{};
        part.priority = priority;
        bytes = 0;
      }
    }
    if (!part.params.empty()) run.push_back(std::move(part));
    for (size_t i = run.size(); i-- > 0;) parts.push_back(std::move(run[i]));
  };
  std::vector<size_t> unnamed;
  for (size_t g : groups) {
    if (wanted[g] == 0) continue;
    for (size_t p : groups_[g].params) {
      if (p >= early_.param_announced.size() || !early_.param_announced[p]) unnamed.push_back(p);
    }
  }
  std::sort(unnamed.begin(), unnamed.end());
  add(unnamed, -1);
  // A trainer that announced in registration order (after its backward, its first announcement
  // holding lower params than its last) gets that order: its first announcement is taken first,
  // and these parts before any speculating one.
  const std::vector<std::vector<size_t>>& said = early_.announcements;
  const bool forward = said.size() > 1 && *std::min_element(said.front().begin(), said.front().end()) <
                                              *std::min_element(said.back().begin(), said.back().end());
  const int64_t n = static_cast<int64_t>(said.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = forward ? n - 1 - i : i;
    add(said[static_cast<size_t>(a)], forward ? 2 * n - 1 - a : a);
  }
  if (parts.empty()) return absl::OkStatus();
  if (!in_place) FERRY_RETURN_IF_ERROR(EnsureSpareState());
  return QueueParts(std::move(parts), scalars, trainer, in_place);
}

void HybridOptimizer::ResetParts() {
  for (size_t g = 0; g < groups_.size(); ++g) {
    early_.queued[g] = 0;
    early_.unqueued[g] = groups_[g].params.size();
  }
  part_of_param_.assign(params_.size(), -1);
  std::lock_guard<std::mutex> lock(early_mu_);
  early_done_.assign(groups_.size(), 0);
  early_kept_ = false;
  group_parts_left_.assign(groups_.size(), 0);
  group_all_queued_.assign(groups_.size(), 0);
}

void HybridOptimizer::EarlyLoop() {
  if (options_.tracer != nullptr) options_.tracer->NameThread("ferry early step");
  for (;;) {
    EarlyItem first;
    {
      std::unique_lock<std::mutex> lock(early_mu_);
      early_cv_.wait(lock, [this] { return early_exit_ || !early_queue_.empty(); });
      if (early_queue_.empty()) return;  // early_exit_
      first = std::move(early_queue_.front());
      early_queue_.pop_front();
      early_busy_ = true;
    }
    absl::Status status = early_cancel_.load(std::memory_order_relaxed)
                              ? absl::CancelledError("the step's early work was cancelled")
                              : RunEarlyPass(std::move(first));
    // Idle time: the state of the pieces whose params went up first (until someone waits for this
    // thread or work is queued).
    if (status.ok()) status = RunStateLater(/*yield=*/true);
    {
      std::lock_guard<std::mutex> lock(early_mu_);
      // Moved, not copied: the error then has one owner at a time, and no reference count is shared
      // between this thread and WaitEarlyIdle's reader (Abseil's, which ThreadSanitizer cannot see).
      if (!status.ok() && early_status_.ok()) early_status_ = std::move(status);
      early_busy_ = false;
    }
    early_cv_.notify_all();
  }
}

void HybridOptimizer::WaitEarlyQuiet(std::unique_lock<std::mutex>& lock) {
  early_waiters_.fetch_add(1);  // the early thread's idle-time rounds yield (RunStateLater)
  early_cv_.wait(lock, [this] { return !early_busy_ && early_queue_.empty(); });
  early_waiters_.fetch_sub(1);
}

absl::Status HybridOptimizer::WaitEarlyIdle() {
  std::unique_lock<std::mutex> lock(early_mu_);
  WaitEarlyQuiet(lock);
  absl::Status status = std::move(early_status_);
  early_status_ = absl::OkStatus();
  return status;
}

void HybridOptimizer::StopEarlyThread() {
  if (!early_thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(early_mu_);
    early_exit_ = true;
    early_cancel_.store(true);
  }
  early_cv_.notify_all();
  early_thread_.join();
}

absl::StatusOr<std::vector<size_t>> HybridOptimizer::SettleEarly(bool skipped, bool discard, bool may_defer,
                                                                 const std::vector<AdamScalars>& scalars,
                                                                 Stream& trainer, HybridStepResult& result) {
  bool valid = !skipped && !discard;
  std::vector<size_t> started;  // offloaded groups a part of which was started
  for (size_t g : early_.order) {
    if (early_.queued[g] == 0) continue;
    started.push_back(g);
    if (early_.mixed[g] != 0 || !SameScalars(early_.scalars[g], scalars[g])) valid = false;
  }
  if (!valid) early_cancel_.store(true);  // stop what still runs: it is recomputed or undone
  if (valid) {
    // From here on every param the early thread begins runs in place: the speculation's scalars are
    // the step's own (BeginChunk, kept_in_place_; in place is faster than into the spare buffers: 132
    // against 110 GB/s in `ferry bench adam` on the H200 host).
    {
      std::lock_guard<std::mutex> lock(early_mu_);
      early_kept_ = kept_in_place_on_;
    }
    // Groups announced in part finish on the early thread (a kept group commits whole): the params
    // no announcement held, or held without spare state (under a budget), start now, their grads
    // being final.
    std::vector<size_t> partial;
    for (size_t g : started) {
      if (early_.unqueued[g] != 0) partial.push_back(g);
    }
    FERRY_RETURN_IF_ERROR(QueueRest(partial, scalars, trainer));
  }
  if (may_defer && !skipped && spare_arena_ != nullptr) {
    // The step is decided and the trainer waits per layer: every offloaded group's update not kept
    // from the early work (never announced, speculation paused, or a speculation that failed: a
    // clip reached, other scalars, grads changed) runs on the early thread too, with the step's own
    // scalars, in place (as Step's own pipeline would: faster than into the spare buffers), beside
    // the trainer's next forward, rather than in Step.
    if (!valid) {
      TraceSpan wait(options_.tracer, "early.cancel", "optim");
      const absl::Status early_status = WaitEarlyIdle();
      early_cancel_.store(false);
      if (!early_status.ok() && !absl::IsCancelled(early_status)) {
        FERRY_LOG(WARNING) << "work started early failed; the step recomputes it: " << early_status;
      }
      ResetParts();
    }
    std::vector<size_t> all, rest;
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (!groups_[g].offloaded || groups_[g].params.empty()) continue;
      all.push_back(g);
      if (early_.queued[g] == 0) rest.push_back(g);
    }
    FERRY_RETURN_IF_ERROR(QueueRest(rest, scalars, trainer, /*in_place=*/true));
    FERRY_ASSIGN_OR_RETURN(const bool deferred, DeferSettle(all, rest));
    if (deferred) {
      (valid ? result.early_committed : result.early_recomputed) += started.size();
      early_ = EarlyStep{};
      return std::vector<size_t>{};
    }
    valid = false;  // the early work failed already: Step recomputes every group as usual
    early_cancel_.store(true);
  }
  absl::Status early_status;
  {
    TraceSpan wait(options_.tracer, "early.wait", "optim");
    early_status = WaitEarlyIdle();
  }
  early_cancel_.store(false);
  if (!early_status.ok() && !absl::IsCancelled(early_status)) {
    FERRY_LOG(WARNING) << "work started early failed; the step recomputes what it left untouched: " << early_status;
  }
  std::vector<size_t> rest;
  if (skipped) {
    const absl::Status restored = RestoreParams(started, trainer);
    early_ = EarlyStep{};
    if (!restored.ok()) return restored;
    return rest;
  }
  std::vector<uint8_t> done, in_place;
  {
    std::lock_guard<std::mutex> lock(early_mu_);
    done = early_done_;
    in_place = early_in_place_;
  }
  if (!later_.empty()) {
    std::vector<size_t> uncommitted;  // their pieces of the state later go (recomputed, or reported)
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g].offloaded && !(early_.queued[g] != 0 && valid && done[g] != 0)) uncommitted.push_back(g);
    }
    DropStateLater(uncommitted);
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& group = groups_[g];
    if (!group.offloaded) continue;
    if (early_.queued[g] != 0 && valid && done[g] != 0) {
      CommitSpare(g);
      ++result.early_committed;
    } else if (early_.queued[g] != 0 && in_place[g] != 0) {
      // Some of its params updated in place once the step was kept (no spare state, or started
      // after the keep), and the early work stopped before the group was done: Step cannot
      // recompute it from untouched state.
      early_ = EarlyStep{};
      return absl::InternalError(absl::StrCat("the early update of group '", group.name, "' stopped before finishing ",
                                              "(", early_status.ok() ? "no error" : early_status.message(),
                                              "), with params updated in place: its state is partly updated"));
    } else {
      if (early_.queued[g] != 0) ++result.early_recomputed;
      rest.push_back(g);
    }
  }
  early_ = EarlyStep{};
  return rest;
}

absl::StatusOr<bool> HybridOptimizer::DeferSettle(const std::vector<size_t>& started,
                                                  const std::vector<size_t>& in_place) {
  {
    std::lock_guard<std::mutex> lock(early_mu_);
    if (!early_status_.ok()) return false;  // the early work failed: Step settles it as usual
  }
  deferred_ = true;
  deferred_groups_ = started;
  deferred_in_place_.assign(groups_.size(), 0);
  for (size_t g : in_place) deferred_in_place_[g] = 1;
  return true;
}

absl::Status HybridOptimizer::Settle(bool flush_state_later) {
  // Between steps, the state of the pieces whose params went up first (the state later) is written
  // before anything reads it; a step with announcements leaves them to its early pass, which writes
  // them before its first chunk, or to Step before its own pipeline.
  flush_state_later = flush_state_later && !step_in_progress();
  if (!deferred_) return flush_state_later ? FlushStateLater() : absl::OkStatus();
  deferred_ = false;
  absl::Status status;
  {
    TraceSpan span(options_.tracer, "early.settle", "optim");
    status = WaitEarlyIdle();
  }
  std::vector<size_t> failed;
  {
    std::lock_guard<std::mutex> lock(early_mu_);
    for (size_t g : deferred_groups_) {
      if (early_done_[g] != 0) {
        if (deferred_in_place_[g] == 0) CommitSpare(g);
      } else {
        failed.push_back(g);
      }
    }
  }
  deferred_groups_.clear();
  // step_done_ marks the end of the whole step again (Synchronize, snapshots, WaitParams): after the
  // trainer's part (trainer_point_, recorded by Step) and the last upload.
  absl::Status ordered = work_stream_->WaitFor(*trainer_point_);
  if (ordered.ok() && last_upload_ != nullptr) ordered = last_upload_->MakeStreamWait(*work_stream_);
  if (ordered.ok()) ordered = work_stream_->Record(*step_done_);
  if (failed.empty()) {
    if (!status.ok()) FERRY_LOG(WARNING) << "the last step's work reported an error after completing: " << status;
    const absl::Status later = flush_state_later ? FlushStateLater() : absl::OkStatus();
    return ordered.ok() ? later : ordered;
  }
  DropStateLater(failed);  // they keep the state of the step before
  // Those groups keep the state of the step before: their step count goes back, and their params
  // (some of them already uploaded) are rewritten from the unchanged masters. A group updated in
  // place may have part of its state updated, as after a Step whose own pipeline failed.
  std::vector<std::string> names;
  bool partly = false;
  for (size_t g : failed) {
    --groups_[g].step;
    names.push_back(absl::StrCat("'", groups_[g].name, "'"));
    partly = partly || deferred_in_place_[g] != 0 || early_in_place_[g] != 0;
  }
  const absl::Status restored = RestoreParams(failed, *work_stream_);
  if (status.ok()) status = absl::InternalError("the early work stopped before finishing");
  return absl::Status(status.code(),
                      absl::StrCat("the last step's update of groups ", absl::StrJoin(names, ", "),
                                   " did not complete after Step returned (", status.message(), "); they keep "
                                   "their state of the step before",
                                   partly ? " (those updated in place possibly in part, as after a failed Step)" : "",
                                   restored.ok() ? " and their params were rewritten from it"
                                                 : absl::StrCat(", but rewriting their params failed: ", restored.message())));
}

absl::Status HybridOptimizer::RestoreParams(const std::vector<size_t>& groups, Stream& trainer) {
  FERRY_RETURN_IF_ERROR(FlushStateLater());  // the masters it reads
  const PipelinePlan plan = PlanFor(groups);
  if (plan.params.empty()) return absl::OkStatus();
  FERRY_RETURN_IF_ERROR(trainer.Record(*grads_ready_));
  FERRY_RETURN_IF_ERROR(
      RunPipeline(PipelineRun{.plan = &plan, .ready = grads_ready_.get(), .mode = PipelineMode::kRestoreParams}));
  return FinishUploads(/*trainer_waits=*/true, trainer);
}

absl::Status HybridOptimizer::AbandonEarly(Stream& trainer) {
  std::vector<size_t> started;
  for (size_t g : early_.order) {
    if (early_.queued[g] != 0) started.push_back(g);
  }
  early_cancel_.store(true);
  const absl::Status early_status = WaitEarlyIdle();
  early_cancel_.store(false);
  if (!early_status.ok() && !absl::IsCancelled(early_status)) {
    FERRY_LOG(WARNING) << "work started early failed: " << early_status;
  }
  early_ = EarlyStep{};
  DropStateLater(started);  // nothing of their state changes
  return RestoreParams(started, trainer);
}

}  // namespace ferry
