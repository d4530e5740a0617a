// The early thread's pass (see BeginGroups and deferred() in hybrid_optimizer.h): the speculative
// updates of the announced offloaded groups.
//
// Every announced group's grads go down at once, each group into its own place in early_grads_ (one
// transfer batch per group, its copies ordered after the group's announcement on the trainer's
// stream), so that the trainer's grads are free as soon as the last download has run. Announcements
// made while the pass runs join it at its next round. CPU Adam then takes, each round, up to
// `depth` landed chunks, the latest downloaded first: during a backward that is the group whose
// grads became final last, which is the one the trainer's next forward needs first (a backward
// announces the last layers first). When the host runs ahead of the GPU, every group is announced
// before its grads exist, the pass waits for the first download in order, and once the backward has
// ended the rest of the work runs in forward order, overlapping the trainer's next forward, which
// waits per group (WaitParams). The new params go up through the param slots, in turn, a slot being
// reused once its last upload has completed (two rounds later: by then it has).
#include <algorithm>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "ferry/status.h"
#include "optim/hybrid_optimizer.h"

namespace ferry {

absl::Status HybridOptimizer::RunEarlyPass(EarlyItem first) {
  Tracer* const tracer = options_.tracer;
  TraceSpan span(tracer, "early.pipeline", "optim");
  // The uploads of an earlier pass may still read the param slots this pass is about to write.
  if (last_upload_ != nullptr) FERRY_RETURN_IF_ERROR(last_upload_->Wait());
  const size_t depth = grad_slots_.size();  // chunks per round; the param slots are twice as many
  const size_t num_slots = param_slots_.size();
  // Per group; CPU Adam's tensors point into `scalars`, which never grows.
  std::vector<AdamScalars> scalars(groups_.size());
  std::vector<int64_t> steps(groups_.size(), 0);
  struct GroupWork {
    size_t group = 0;
    Event* ready = nullptr;          // the announcement: its grads are final after it
    std::vector<size_t> params;      // in the order of the batch's regions (4-byte grads first)
    char* grads = nullptr;           // its place in early_grads_
    std::unique_ptr<TransferBatch> down;
    size_t left = 0;                 // chunks not yet updated
  };
  struct PassChunk {
    size_t work = 0;  // index into `works`
    size_t k = 0;     // chunk of its batch
    bool updated = false;
  };
  std::deque<GroupWork> works;  // stable addresses
  std::vector<PassChunk> chunks;    // in download order: they land in this order
  std::vector<std::unique_ptr<TransferBatch>> uploads;
  std::vector<TransferBatch*> slot_upload(num_slots, nullptr);
  size_t next_slot = 0, landed = 0, updated = 0;

  // A group is done once its last chunk's upload is enqueued: group_uploaded_ follows it on the H2D
  // stream (whose uploads run in order), and WaitParams may use it.
  auto finish_group = [&](size_t g) -> absl::Status {
    FERRY_RETURN_IF_ERROR(transfer_->h2d_stream().Record(*group_uploaded_[g]));
    {
      std::lock_guard<std::mutex> lock(early_mu_);
      early_done_[g] = 1;
    }
    early_cv_.notify_all();
    return absl::OkStatus();
  };
  // Enqueues the downloads of `items`' groups, then records early_downloaded_ after them.
  auto join = [&](std::deque<EarlyItem>& items) -> absl::Status {
    size_t joined = 0;
    std::vector<size_t> empty_groups;
    for (EarlyItem& item : items) {
      for (size_t g : item.groups) {
        scalars[g] = item.scalars[g];
        steps[g] = item.steps[g];
        GroupWork w;
        w.group = g;
        w.ready = item.ready;
        w.params = PlanFor({g}).params;
        w.grads = early_grads_.as<char>() + early_grad_offset_[g];
        std::vector<CopyRegion> regions;
        size_t at = 0;
        for (size_t p : w.params) {
          const size_t bytes = static_cast<size_t>(params_[p].numel) * DTypeSize(params_[p].grad_dtype);
          regions.push_back(CopyRegion{w.grads + at, params_[p].grad, bytes});
          at += bytes;
        }
        FERRY_ASSIGN_OR_RETURN(w.down, transfer_->DeviceToHost(regions, item.ready));
        TraceSubmitted(d2h_trace_, w.down.get());
        w.left = w.down->num_chunks();
        for (size_t k = 0; k < w.left; ++k) chunks.push_back(PassChunk{works.size(), k});
        if (w.left == 0) empty_groups.push_back(g);  // no elements on this rank
        works.push_back(std::move(w));
        ++joined;
      }
    }
    if (joined == 0) return absl::OkStatus();
    FERRY_RETURN_IF_ERROR(transfer_->d2h_stream().Record(*early_downloaded_));
    {
      std::lock_guard<std::mutex> lock(early_mu_);
      early_downloads_ += joined;
    }
    early_cv_.notify_all();
    for (size_t g : empty_groups) FERRY_RETURN_IF_ERROR(finish_group(g));
    return absl::OkStatus();
  };

  absl::Status status;
  {
    std::deque<EarlyItem> items;
    items.push_back(std::move(first));
    status = join(items);
  }
  AdamWork work;
  std::vector<std::vector<CopyRegion>> up_regions;
  while (status.ok()) {
    if (early_cancel_.load(std::memory_order_relaxed)) {
      status = absl::CancelledError("the step's early work was cancelled");
      break;
    }
    {
      std::deque<EarlyItem> items;  // announced since the last round
      {
        std::lock_guard<std::mutex> lock(early_mu_);
        items.swap(early_queue_);
      }
      status = join(items);
      if (!status.ok()) break;
    }
    while (landed < chunks.size()) {
      const PassChunk& c = chunks[landed];
      absl::StatusOr<bool> done = works[c.work].down->ChunkDone(c.k);
      if (!done.ok()) status = done.status();
      if (!done.ok() || !*done) break;
      ++landed;
    }
    if (!status.ok()) break;
    // The round: the latest landed chunks not yet updated.
    std::vector<size_t> round;
    for (size_t i = landed; i-- > 0 && round.size() < depth;) {
      if (!chunks[i].updated) round.push_back(i);
    }
    if (round.empty()) {
      if (updated == chunks.size()) {
        std::lock_guard<std::mutex> lock(early_mu_);
        if (early_queue_.empty()) break;  // done; a later announcement starts a new pass
        continue;
      }
      // Nothing landed yet: wait for the next download in order. Sleep on its announcement's event
      // (a blocking one) rather than spin on the copy's: that wait can last the rest of the
      // backward, and CPU Adam needs the core.
      const PassChunk& c = chunks[landed];
      GroupWork& w = works[c.work];
      absl::StatusOr<bool> reached = w.ready->Query();
      if (reached.ok() && !*reached) {
        TraceSpan wait(tracer, "wait.grads", "optim");
        status = w.ready->Synchronize();
        if (!status.ok()) break;
      }
      TraceSpan wait(tracer, "wait.copies", "optim");
      status = w.down->WaitChunk(c.k);
      continue;
    }
    std::sort(round.begin(), round.end());
    std::vector<size_t> slots(round.size());
    {
      TraceSpan wait(tracer, "wait.copies", "optim");
      for (size_t r = 0; r < round.size() && status.ok(); ++r) {
        slots[r] = next_slot;
        next_slot = (next_slot + 1) % num_slots;
        if (slot_upload[slots[r]] != nullptr) status = slot_upload[slots[r]]->Wait();  // its slot is rewritten now
      }
    }
    if (!status.ok()) break;
    work.tensors.clear();
    work.params.clear();
    up_regions.assign(round.size(), {});
    for (size_t r = 0; r < round.size(); ++r) {
      const PassChunk& c = chunks[round[r]];
      const GroupWork& w = works[c.work];
      const ChunkPlan& plan = w.down->chunk(c.k);
      ChunkWork(w.params, plan, w.grads + plan.begin, param_slots_[slots[r]].as<char>(), PipelineMode::kToSpare,
                &scalars, &steps, work, up_regions[r]);
    }
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
    status = AdamRound(work, round.size());
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
    for (size_t r = 0; r < round.size() && status.ok(); ++r) {
      PassChunk& c = chunks[round[r]];
      GroupWork& w = works[c.work];
      // The trainer's stream may still read the params until the grads are ready: the upload waits.
      absl::StatusOr<std::unique_ptr<TransferBatch>> upload = transfer_->HostToDevice(up_regions[r], w.ready);
      if (!upload.ok()) {
        status = upload.status();
        break;
      }
      TraceSubmitted(h2d_trace_, upload->get());
      slot_upload[slots[r]] = upload->get();
      last_upload_ = upload->get();
      uploads.push_back(*std::move(upload));
      c.updated = true;
      ++updated;
      if (--w.left == 0) status = finish_group(w.group);
    }
  }
  if (span.on()) {
    span.Arg("groups", static_cast<double>(works.size()));
    span.Arg("chunks", static_cast<double>(chunks.size()));
  }
  if (!status.ok()) {
    // Stopped early: downloads still in flight read the trainer's grads. They finish first.
    for (GroupWork& w : works) (void)w.down->Wait();
  }
  // Everything submitted stays alive until it completed (WaitPending at the next call).
  for (GroupWork& w : works) pending_.push_back(std::move(w.down));
  for (auto& batch : uploads) pending_.push_back(std::move(batch));
  return status;
}

}  // namespace ferry
