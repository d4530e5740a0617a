// The early thread's pass (see BeginGroups and deferred() in hybrid_optimizer.h): the speculative
// updates of the announced offloaded groups, through the staging ring (the grad and param slots).
//
// Which chunk goes down next is decided as slots free up: a chunk of the part of the highest
// priority whose grads are final (its announcement's event has completed; EarlyPart::priority: its
// announcement's index, the latest queued on a tie), else the next chunk of the earliest queued
// part still to go down (the next to become final: the device orders its copy after the
// announcement). During a backward that is the part whose grads became final last, and that is the
// one the trainer's next forward needs first (a backward announces the last layers first): when the
// host runs ahead of the GPU and CPU Adam is the slower, the work left when the backward ends runs
// in forward order, overlapping the trainer's next forward, which waits per part (WaitParamsOf)
// after a deferred Step. What a decided Step queues (QueueRest) carries the same priorities, so it
// interleaves with the speculating parts not started yet in that order. Until Step has kept the
// speculation, a param begun goes down whole before another begins, so that what is left then is
// params not begun, which run in place from the keep on (BeginChunk). Announcements made while
// the pass runs join it at its next round. Grads stay in the ring's few slots, which the host's
// last-level cache holds (PCIe writes land there): a copy of every grad in host memory, read back
// later, costs CPU Adam about a fifth of its rate (measured on the H200 machine). A round of CPU
// Adam takes every landed chunk and starts while the round before still runs (no barrier: the
// workers go from one to the next); then the early thread finishes the round before, uploads its
// new params and fills the grad slots it freed (its CUDA calls took ~90 us between rounds, ~10 ms
// of a 735M step, when they ran between rounds), and helps with the running round's tasks while it
// watches for the next chunk. The new params go up through the param slots in turn (twice as many
// as grad slots, so a round does not wait for the uploads of the rounds before).
#include <algorithm>
#include <deque>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "ferry/status.h"
#include "optim/hybrid_optimizer.h"

namespace ferry {

bool HybridOptimizer::BeginChunk(const PipelinePlan& plan, size_t k, const std::vector<size_t>& groups,
                                  PipelineMode mode) {
  std::lock_guard<std::mutex> lock(early_mu_);
  if (mode == PipelineMode::kInPlace) {
    if (k == 0) {
      for (size_t g : groups) early_in_place_[g] = 1;
    }
    return false;
  }
  // A speculating part: each param whose first piece is in this chunk begins now, in place once Step
  // has kept the speculation (the pass jumps to each part as its grads become final, so most parts
  // have begun when Step decides; a param is the unit, since its state lives on one side), and in
  // place anyway without spare state.
  for (const ChunkPiece& piece : plan.chunks[k].pieces) {
    if (piece.offset != 0) continue;
    const size_t p = plan.params[piece.region];
    if (early_kept_ && HasSpare(p)) kept_in_place_[p] = 1;
    if (early_kept_ || !HasSpare(p)) early_in_place_[params_[p].group] = 1;
  }
  return early_kept_;
}

absl::Status HybridOptimizer::RunEarlyPass(EarlyItem first) {
  Tracer* const tracer = options_.tracer;
  TraceSpan span(tracer, "early.pipeline", "optim");
  // The uploads of an earlier pass may still read the param slots this pass is about to write.
  if (last_upload_ != nullptr) FERRY_RETURN_IF_ERROR(last_upload_->Wait());
  // The state later left by the passes before: written before this pass reads any state.
  FERRY_RETURN_IF_ERROR(RunStateLater(/*yield=*/false));
  const size_t depth = grad_slots_.size();
  const size_t num_param_slots = param_slots_.size();
  // Per group; CPU Adam's tensors point into `scalars`, which never grows.
  std::vector<AdamScalars> scalars(groups_.size());
  std::vector<int64_t> steps(groups_.size(), 0);
  struct GroupWork {  // a part of the update (EarlyPart)
    std::vector<size_t> groups;
    size_t part = 0;
    PipelineMode mode = PipelineMode::kToSpare;  // kInPlace: a decided step's (EarlyItem::in_place)
    Event* uploaded = nullptr;
    Event* ready = nullptr;  // the announcement: its grads are final after it
    PipelinePlan plan;       // over the part's params alone
    size_t next_down = 0;    // its next chunk to download
    size_t left = 0;         // chunks not yet updated
    bool final = false;      // its announcement's event was seen complete
    int64_t priority = 0;    // EarlyPart::priority
  };
  struct Download {
    size_t work = 0;  // index into `works`
    size_t k = 0;     // chunk of its plan
    size_t slot = 0;  // grad slot
    std::unique_ptr<TransferBatch> batch;
    size_t param_slot = 0;  // once in a round: where CPU Adam writes its new params
  };
  std::deque<GroupWork> works;     // in the order queued
  std::vector<size_t> by_priority;  // indices into works: the highest priority first, the latest on a tie
  std::deque<Download> in_flight;  // in submission order: they land in this order
  std::vector<size_t> free_slots(depth);
  for (size_t i = 0; i < depth; ++i) free_slots[i] = depth - 1 - i;
  std::vector<std::unique_ptr<TransferBatch>> done_batches;
  std::vector<TransferBatch*> param_slot_upload(num_param_slots, nullptr);
  size_t next_param_slot = 0, first_open = 0;  // works before first_open are all downloaded

  // A part is done once its last chunk's upload is enqueued: its event follows it on the H2D stream
  // (whose uploads run in order), and WaitParamsOf may use it; so is its group once every param of
  // it is in a part and every part is done (group_uploaded_, for WaitParams).
  auto finish_part = [&](const GroupWork& w) -> absl::Status {
    TraceSpan done(tracer, "early.part_done", "optim");
    if (done.on()) {
      done.Arg("part", static_cast<double>(w.part));
      // The step its update computes (`ferry trace` lines up the ranks' update ends by it).
      if (!w.groups.empty()) done.Arg("step", static_cast<double>(steps[w.groups.front()]));
    }
    Stream& h2d = transfer_->h2d_stream();
    FERRY_RETURN_IF_ERROR(h2d.Record(*w.uploaded));
    {
      std::lock_guard<std::mutex> lock(early_mu_);
      part_done_[w.part] = 1;
      for (size_t g : w.groups) {
        if (--group_parts_left_[g] == 0 && group_all_queued_[g] != 0) {
          FERRY_RETURN_IF_ERROR(h2d.Record(*group_uploaded_[g]));
          early_done_[g] = 1;
        }
      }
    }
    early_cv_.notify_all();
    return absl::OkStatus();
  };
  // Scalars of a group are set by its first part in this pass (later parts of a step carry the same,
  // and the running rounds read them).
  std::vector<uint8_t> have_scalars(groups_.size(), 0);
  auto join = [&](std::deque<EarlyItem>& items) -> absl::Status {
    if (items.empty()) return absl::OkStatus();  // every round looks: the order stands as it was
    for (EarlyItem& item : items) {
      for (EarlyPart& part : item.parts) {
        for (size_t g : part.groups) {
          if (have_scalars[g] == 0) {
            scalars[g] = item.scalars[g];
            steps[g] = item.steps[g];
            have_scalars[g] = 1;
          }
        }
        GroupWork w;
        w.groups = std::move(part.groups);
        w.part = part.id;
        w.mode = item.in_place ? PipelineMode::kInPlace : PipelineMode::kToSpare;
        w.uploaded = part.uploaded;
        w.ready = item.ready;
        w.priority = part.priority;
        w.plan = PlanForParams(std::move(part.params));
        w.left = w.plan.chunks.size();
        works.push_back(std::move(w));
        if (works.back().left == 0) FERRY_RETURN_IF_ERROR(finish_part(works.back()));  // no elements
        by_priority.push_back(works.size() - 1);
      }
    }
    // Those all down leave the list; the rest in order.
    by_priority.erase(std::remove_if(by_priority.begin(), by_priority.end(),
                                     [&](size_t i) { return works[i].next_down == works[i].plan.chunks.size(); }),
                      by_priority.end());
    std::sort(by_priority.begin(), by_priority.end(), [&](size_t a, size_t b) {
      return works[a].priority != works[b].priority ? works[a].priority > works[b].priority : a > b;
    });
    return absl::OkStatus();
  };
  // The next chunk to download: of the part of the highest priority seen final, else of the
  // earliest queued part not yet all down. Null when every chunk is down.
  constexpr size_t kNone = static_cast<size_t>(-1);
  // Until Step has kept the speculation (kept_seen), a param begun is downloaded whole before another
  // begins (`open`: the work whose last chunk down ended inside a param): what is left when Step
  // keeps it is then params not begun, which run in place (BeginChunk), rather than the rest of
  // every part begun as its grads became final. After the keep, chunk by chunk as above.
  bool kept_seen = false;
  size_t open = static_cast<size_t>(-1);
  auto pick = [&]() -> size_t {
    if (param_first_on_ && !kept_seen && open < works.size() && works[open].next_down < works[open].plan.chunks.size()) {
      return open;
    }
    while (first_open < works.size() && works[first_open].next_down == works[first_open].plan.chunks.size()) ++first_open;
    for (size_t i : by_priority) {
      GroupWork& w = works[i];
      if (w.next_down == w.plan.chunks.size()) continue;
      if (!w.final) {
        absl::StatusOr<bool> reached = w.ready->Query();
        w.final = reached.ok() && *reached;
      }
      if (w.final) return i;
    }
    return first_open < works.size() ? first_open : kNone;
  };

  absl::Status status;
  {
    std::deque<EarlyItem> items;
    items.push_back(std::move(first));
    status = join(items);
  }
  // Announcements made since the last look join; downloads go into the free grad slots.
  auto refill = [&]() -> absl::Status {
    {
      std::deque<EarlyItem> items;
      {
        std::lock_guard<std::mutex> lock(early_mu_);
        items.swap(early_queue_);
      }
      FERRY_RETURN_IF_ERROR(join(items));
    }
    while (!free_slots.empty()) {
      const size_t i = pick();
      if (i == kNone) break;
      GroupWork& w = works[i];
      const bool kept = BeginChunk(w.plan, w.next_down, w.groups, w.mode);
      kept_seen = kept_seen || kept;
      {
        const ChunkPiece& last = w.plan.chunks[w.next_down].pieces.back();
        const OptimParam& op = params_[w.plan.params[last.region]];
        open = last.offset + last.bytes < static_cast<size_t>(op.numel) * DTypeSize(op.grad_dtype) ? i : kNone;
      }
      if (w.next_down == 0) {
        TraceSpan start(tracer, "early.part_start", "optim");  // its first chunk goes down now
        if (start.on()) {
          start.Arg("part", static_cast<double>(w.part));
          start.Arg("priority", static_cast<double>(w.priority));
          const bool speculating_kept = kept && w.mode == PipelineMode::kToSpare;
          start.Arg("in_place", w.mode == PipelineMode::kInPlace || speculating_kept ? 1.0 : 0.0);
          start.Arg("kept", speculating_kept ? 1.0 : 0.0);
        }
      }
      const size_t slot = free_slots.back();
      FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TransferBatch> down, SubmitGradChunk(w.plan, w.next_down, slot, *w.ready));
      TraceSubmitted(d2h_trace_, down.get());
      free_slots.pop_back();
      in_flight.push_back(Download{i, w.next_down, slot, std::move(down)});
      ++w.next_down;
    }
    return absl::OkStatus();
  };
  // The round on the workers, not finished yet. The next one starts as soon as a chunk has landed,
  // before this one is finished, so the workers go from one round to the next without a barrier
  // (a round's start and its last tasks cost each thread ~5% of a 1.7 ms round on the H200 machine).
  struct Running {
    std::vector<Download> chunks;
    std::vector<std::vector<CopyRegion>> regions;  // per chunk: the uploads of its new params
    AdamWork work;
    RoundInFlight flight;
  };
  std::unique_ptr<Running> running;
  // Finishes the running round; its new params go up and its grad slots take the next downloads
  // (the next round runs meanwhile). On an error, the chunks not uploaded leave their groups
  // unfinished (Settle restores them).
  auto finish_running = [&]() -> absl::Status {
    std::unique_ptr<Running> r = std::move(running);
    FinishAdamRound(r->flight);
    absl::Status s;
    for (size_t c = 0; c < r->chunks.size() && s.ok(); ++c) {
      Download& d = r->chunks[c];
      GroupWork& w = works[d.work];
      // The trainer's stream may still read the params until the grads are final: the upload waits.
      absl::StatusOr<std::unique_ptr<TransferBatch>> upload = transfer_->HostToDevice(r->regions[c], w.ready);
      if (!upload.ok()) {
        s = upload.status();
        break;
      }
      TraceSubmitted(h2d_trace_, upload->get());
      param_slot_upload[d.param_slot] = upload->get();
      last_upload_ = upload->get();
      done_batches.push_back(*std::move(upload));
      free_slots.push_back(d.slot);  // CPU Adam has read it
      if (--w.left == 0) s = finish_part(w);
    }
    for (Download& d : r->chunks) done_batches.push_back(std::move(d.batch));
    if (s.ok()) s = refill();
    return s;
  };
  if (status.ok()) status = refill();
  while (status.ok()) {
    if (early_cancel_.load(std::memory_order_relaxed)) {
      status = absl::CancelledError("the step's early work was cancelled");
      break;
    }
    // The next round: every landed download (they land in submission order).
    size_t landed = 0;
    while (landed < in_flight.size()) {
      const Download& d = in_flight[landed];
      absl::StatusOr<bool> done = d.batch->ChunkDone(d.batch->num_chunks() - 1);
      if (!done.ok()) status = done.status();
      if (!done.ok() || !*done) break;
      ++landed;
    }
    if (!status.ok()) break;
    if (landed == 0) {
      if (running != nullptr) {
        // Help the workers with the running round, a task at a time, while the next chunks land;
        // once it has no task left to take, finish it.
        if (running->flight.pending.HelpOne()) continue;
        status = finish_running();
        continue;
      }
      if (in_flight.empty()) {
        std::lock_guard<std::mutex> lock(early_mu_);
        if (early_queue_.empty()) break;  // done; a later announcement starts a new pass
      } else {
        // Nothing landed yet: wait for the first download. Sleep on its announcement's event (a
        // blocking one) rather than spin on the copy's: that wait can last the rest of the backward,
        // and CPU Adam needs the core.
        const Download& d = in_flight.front();
        GroupWork& w = works[d.work];
        if (!w.final) {
          absl::StatusOr<bool> reached = w.ready->Query();
          if (reached.ok() && !*reached) {
            TraceSpan wait(tracer, "wait.grads", "optim");
            status = w.ready->Synchronize();
            if (!status.ok()) break;
          }
          w.final = true;
        }
        TraceSpan wait(tracer, "wait.copies", "optim");
        status = d.batch->Wait();
        if (!status.ok()) break;
      }
      status = refill();
      continue;
    }
    auto next = std::make_unique<Running>();
    for (size_t r = 0; r < landed; ++r) {
      next->chunks.push_back(std::move(in_flight.front()));
      in_flight.pop_front();
    }
    {
      TraceSpan wait(tracer, "wait.copies", "optim");
      for (size_t r = 0; r < landed && status.ok(); ++r) {
        next->chunks[r].param_slot = next_param_slot;
        next_param_slot = (next_param_slot + 1) % num_param_slots;
        TransferBatch* previous = param_slot_upload[next->chunks[r].param_slot];
        if (previous != nullptr) status = previous->Wait();  // the slot is rewritten now
      }
    }
    if (status.ok()) {
      next->regions.assign(landed, {});
      for (size_t r = 0; r < landed; ++r) {
        const Download& d = next->chunks[r];
        const GroupWork& w = works[d.work];
        ChunkWork(w.plan.params, w.plan.chunks[d.k], grad_slots_[d.slot].as<char>(),
                  param_slots_[d.param_slot].as<char>(), w.mode, &scalars, &steps, next->work,
                  next->regions[r]);
      }
      StageStateLater(next->work);  // FERRY_STATE_LATER: in-place pieces write their params first
      TraceObserve(d2h_trace_, /*block=*/false);
      TraceObserve(h2d_trace_, /*block=*/false);
      absl::StatusOr<RoundInFlight> flight = StartAdamRound(next->work, landed);
      if (flight.ok()) {
        next->flight = *std::move(flight);
      } else {
        status = flight.status();
      }
    }
    if (!status.ok()) {
      for (Download& d : next->chunks) done_batches.push_back(std::move(d.batch));
      break;
    }
    // Two rounds in a row hold at most `depth` chunks (this one's downloads went into the slots the
    // running one did not hold), and three in a row at most 2 * depth: so the param slots of this
    // round differ from those of the running one and of the one whose uploads were just submitted.
    if (running != nullptr) status = finish_running();
    running = std::move(next);
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
  }
  if (running != nullptr) {
    // Stopped with a round on the workers: it finishes (they read the slots); its chunks are not
    // uploaded, so their groups stay unfinished (Settle restores them).
    FinishAdamRound(running->flight);
    for (Download& d : running->chunks) done_batches.push_back(std::move(d.batch));
    running.reset();
  }
  if (span.on()) span.Arg("parts", static_cast<double>(works.size()));
  if (!status.ok()) {
    // Stopped early: downloads still in flight read the trainer's grads. They finish first.
    for (Download& d : in_flight) (void)d.batch->Wait();
  }
  // Everything submitted stays alive until it completed (WaitPending at the next call).
  for (Download& d : in_flight) pending_.push_back(std::move(d.batch));
  for (auto& batch : done_batches) pending_.push_back(std::move(batch));
  return status;
}

}  // namespace ferry
