// HybridOptimizer's offload pipeline: the D2H of grad chunks, CPU Adam and the H2D of params (see
// hybrid_optimizer.h), and its trace lanes.
#include "optim/hybrid_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "base/logging.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ferry/status.h"

namespace ferry {

void HybridOptimizer::TraceSubmitted(LaneTrace& lane, TransferBatch* batch) {
  if (options_.tracer == nullptr || batch == nullptr || batch->num_chunks() == 0) return;
  lane.queue.push_back(CopyTrace{batch, options_.tracer->NowNs()});
}

void HybridOptimizer::TraceObserve(LaneTrace& lane, bool block) {
  Tracer* const tracer = options_.tracer;
  if (tracer == nullptr) return;
  while (!lane.queue.empty()) {
    const CopyTrace& c = lane.queue.front();
    if (block) {
      (void)c.batch->Wait();  // its error, if any, is the caller's to report
    } else {
      absl::StatusOr<bool> done = c.batch->ChunkDone(c.batch->num_chunks() - 1);
      if (!done.ok() || !*done) return;
    }
    const int64_t now = tracer->NowNs();
    tracer->Complete(lane.name, "transfer", std::max(c.submit_ns, lane.last_end_ns), now,
                     {{"bytes", static_cast<double>(c.batch->bytes())}}, {}, lane.lane);
    lane.last_end_ns = now;
    lane.queue.pop_front();
  }
}

absl::StatusOr<std::unique_ptr<TransferBatch>> HybridOptimizer::SubmitGradChunk(const PipelinePlan& plan, size_t k,
                                                                                 size_t slot_index, Event& grads_ready) {
  std::vector<CopyRegion> regions;
  char* slot = grad_slots_[slot_index].as<char>();
  size_t at = 0;
  for (const ChunkPiece& piece : plan.chunks[k].pieces) {
    const OptimParam& op = params_[plan.params[piece.region]];
    regions.push_back(CopyRegion{slot + at, static_cast<const char*>(op.grad) + piece.offset, piece.bytes});
    at += piece.bytes;
  }
  return transfer_->DeviceToHost(regions, &grads_ready);
}

void HybridOptimizer::ChunkWork(const std::vector<size_t>& params, const ChunkPlan& chunk, const char* grad,
                                char* param_out, PipelineMode mode, const std::vector<AdamScalars>* scalars,
                                const std::vector<int64_t>* steps, AdamWork& work,
                                std::vector<CopyRegion>& uploads) const {
  const bool with_grads = mode != PipelineMode::kRestoreParams;
  size_t grad_at = 0, param_at = 0;
  for (const ChunkPiece& piece : chunk.pieces) {
    const size_t p = params[piece.region];
    const OptimParam& op = params_[p];
    const size_t gsize = DTypeSize(op.grad_dtype), psize = DTypeSize(op.dtype);
    FERRY_CHECK(piece.offset % gsize == 0 && piece.bytes % gsize == 0) << "chunk piece off element boundary";
    const size_t e0 = piece.offset / gsize;
    const size_t n = piece.bytes / gsize;
    CpuAdamTensor t;
    t.master = StatePtr(p, StateKind::kMaster, e0);
    t.exp_avg = StatePtr(p, StateKind::kExpAvg, e0);
    t.exp_avg_sq = StatePtr(p, StateKind::kExpAvgSq, e0);
    t.state = groups_[op.group].format;
    t.rounding = RoundingKey(p, e0, steps != nullptr ? (*steps)[op.group] : 0);
    if (mode == PipelineMode::kToSpare && HasSpare(p) && kept_in_place_[p] == 0) {
      // Read the state on the param's side, write the other. In place: a param without spare state
      // (under a budget; in a speculating part only once Step has kept the speculation), or one
      // begun after Step kept it (BeginChunk).
      t.master_src = t.master;
      t.exp_avg_src = t.exp_avg;
      t.exp_avg_sq_src = t.exp_avg_sq;
      t.master = SpareStatePtr(p, StateKind::kMaster, e0);
      t.exp_avg = SpareStatePtr(p, StateKind::kExpAvg, e0);
      t.exp_avg_sq = SpareStatePtr(p, StateKind::kExpAvgSq, e0);
    }
    t.grad = grad + grad_at;
    t.param = param_out + param_at;
    t.numel = static_cast<int64_t>(n);
    t.grad_dtype = op.grad_dtype;
    t.param_dtype = op.dtype;
    t.scalars = with_grads ? &(*scalars)[op.group] : nullptr;
    work.tensors.push_back(t);
    work.params.push_back(p);
    uploads.push_back(CopyRegion{static_cast<char*>(op.param) + e0 * psize, param_out + param_at, n * psize});
    grad_at += piece.bytes;
    param_at += n * psize;
  }
}

absl::Status HybridOptimizer::AdamRound(const AdamWork& work, size_t chunks, const std::function<void()>* meanwhile) {
  absl::StatusOr<RoundInFlight> round = StartAdamRound(work, chunks);
  if (!round.ok()) return round.status();
  if (meanwhile != nullptr) (*meanwhile)();
  FinishAdamRound(*round);
  return absl::OkStatus();
}

absl::StatusOr<HybridOptimizer::RoundInFlight> HybridOptimizer::StartAdamRound(const AdamWork& work, size_t chunks) {
  Tracer* const tracer = options_.tracer;
  if (fence_ != nullptr && !fence_->all_released()) {
    // A checkpoint still reads some offloaded state in place: the state of these chunks' params is
    // copied aside for it first (or, being written right now, waited for). Also before a
    // speculative update, which leaves that state as it is: conservative, and rare.
    TraceSpan acquire(tracer, "fence.acquire", "optim");
    fence_->Acquire(work.params, pool_);
  }
  RoundInFlight round;
  round.start_ns = SteadyNs();
  round.chunks = static_cast<double>(chunks);
  for (const CpuAdamTensor& t : work.tensors) {
    round.elements += static_cast<double>(t.numel);
    round.bytes += CpuAdamTrafficBytes(t);
    if (t.master_src != nullptr) round.spare_bytes += CpuAdamTrafficBytes(t);  // out of place
  }
  FERRY_ASSIGN_OR_RETURN(round.pending, cpu_adam_.Start(work.tensors, CpuAdamStepOptions{}));
  return round;
}

void HybridOptimizer::FinishAdamRound(RoundInFlight& round) {
  const CpuAdamStepResult result = round.pending.Finish();
  // A round ends when its last task did, not when its caller (the early thread, back from waiting for
  // copies in its `meanwhile`) came to finish it: the stats' busy time is the workers'. Rounds
  // started back to back overlap: each counts from where the one before it ended, so the rounds tile
  // the time CPU Adam was busy (the stats' sum; the trace's spans, whose writer adds each one's GB/s).
  const int64_t now_ns = SteadyNs();
  const int64_t end_ns = result.finished_ns > 0 ? std::clamp(result.finished_ns, round.start_ns, now_ns) : now_ns;
  // (A round whose last task ended before the one before it did adds nothing.)
  const int64_t start_ns = std::min(std::max(round.start_ns, last_round_end_ns_), end_ns);
  last_round_end_ns_ = std::max(last_round_end_ns_, end_ns);
  cpu_busy_ns_.fetch_add(end_ns - start_ns, std::memory_order_relaxed);
  cpu_bytes_.fetch_add(static_cast<uint64_t>(round.bytes), std::memory_order_relaxed);
  cpu_spare_bytes_.fetch_add(static_cast<uint64_t>(round.spare_bytes), std::memory_order_relaxed);
  Tracer* const tracer = options_.tracer;
  if (tracer != nullptr) {
    tracer->Complete("cpu_adam.round", "optim", tracer->FromSteadyNs(start_ns), tracer->FromSteadyNs(end_ns),
                     {{"chunks", round.chunks}, {"elements", round.elements}, {"bytes", round.bytes}});
  }
}

// The pipeline over grad chunks, `depth` = number of grad slots:
//   D2H of chunks up to k+depth-1 | CPU Adam on chunks k.. (a round) | H2D of the round before.
// Chunk k's grads land in grad slot k % depth; CPU Adam writes its new params into param slot
// k % (2 * depth), which the H2D of chunk k reads. A round takes every chunk that has landed (at most
// `depth`). While its workers compute, the calling thread (CPU Adam's `meanwhile`) submits the round
// before's uploads and the downloads into the grad slots that round freed, so the workers do not wait
// for those submissions between rounds (as in RunEarlyPass). Two rounds in a row hold at most
// 2 * depth chunks, so their param slots differ; a param slot is rewritten only after the H2D that
// read it completed. kRestoreParams copies no grads: each chunk's params are the masters rounded to
// the params' dtype.
absl::Status HybridOptimizer::RunPipeline(const PipelineRun& run) {
  const PipelinePlan& plan = *run.plan;
  if (plan.params.empty()) return absl::OkStatus();
  FERRY_CHECK(run.mode != PipelineMode::kToSpare) << "speculative updates run in RunEarlyPass";
  // The uploads of an earlier pass may still read the param slots this pass is about to write.
  if (last_upload_ != nullptr) FERRY_RETURN_IF_ERROR(last_upload_->Wait());
  const bool with_grads = run.mode != PipelineMode::kRestoreParams;
  const size_t num_chunks = plan.chunks.size();
  const size_t depth = grad_slots_.size();
  const size_t num_param_slots = param_slots_.size();
  FERRY_CHECK(num_param_slots >= 2 * depth) << "the pipeline needs two param slots per grad slot";
  std::vector<std::unique_ptr<TransferBatch>> down(num_chunks), up(num_chunks);
  auto submit_down = [&](size_t j) -> absl::Status {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TransferBatch> batch, SubmitGradChunk(plan, j, j % depth, *run.ready));
    down[j] = std::move(batch);
    TraceSubmitted(d2h_trace_, down[j].get());
    return absl::OkStatus();
  };
  absl::Status status;
  for (size_t k = 0; with_grads && k < std::min(depth, num_chunks) && status.ok(); ++k) status = submit_down(k);
  Tracer* const tracer = options_.tracer;
  // A batch done without blocking: its events complete in stream order, so its last chunk tells.
  auto done = [](TransferBatch* batch) {
    if (batch == nullptr) return false;
    if (batch->num_chunks() == 0) return true;
    absl::StatusOr<bool> d = batch->ChunkDone(batch->num_chunks() - 1);
    return d.ok() && *d;
  };
  // The round before's chunks [updated_begin, updated_end): their params go up, and their grad slots
  // take the next downloads.
  size_t updated_begin = 0, updated_end = 0;
  std::vector<std::vector<CopyRegion>> regions(depth), updated_regions(depth);
  auto upload_updated = [&]() -> absl::Status {
    for (; updated_begin < updated_end; ++updated_begin) {
      const size_t j = updated_begin;
      // The trainer's stream may still read the params until the grads are ready: the upload waits.
      FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TransferBatch> upload,
                             transfer_->HostToDevice(updated_regions[j % depth], run.ready));
      up[j] = std::move(upload);
      TraceSubmitted(h2d_trace_, up[j].get());
      for (const ChunkPiece& piece : plan.chunks[j].pieces) group_upload_[params_[plan.params[piece.region]].group] = up[j].get();
      last_upload_ = up[j].get();
      if (with_grads && j + depth < num_chunks) FERRY_RETURN_IF_ERROR(submit_down(j + depth));
    }
    return absl::OkStatus();
  };
  AdamWork work;
  size_t k = 0;
  while (k < num_chunks && status.ok()) {
    if (with_grads && down[k] == nullptr) {
      // Its grad slot is the round before's (that round took every slot): nothing to overlap that
      // round's submissions with, so they go now.
      status = upload_updated();
      FERRY_CHECK(!status.ok() || down[k] != nullptr) << "chunk " << k << "'s download was never submitted";
      continue;
    }
    {
      TraceSpan wait(tracer, "wait.copies", "optim");
      if (with_grads) status = down[k]->Wait();
      // Its param slot is rewritten now (the chunk that used it is two rounds back, uploaded).
      if (status.ok() && k >= num_param_slots) status = up[k - num_param_slots]->Wait();
    }
    if (!status.ok()) break;
    // Every further chunk that has already landed (and whose param slot is free) joins this round, so
    // CPU Adam runs as few parallel sections as the copies allow.
    size_t end = k + 1;
    while (end < num_chunks && end < k + depth && (!with_grads || done(down[end].get())) &&
           (end < num_param_slots || done(up[end - num_param_slots].get()))) {
      ++end;
    }
    work.tensors.clear();
    work.params.clear();
    for (size_t j = k; j < end; ++j) {
      regions[j % depth].clear();
      ChunkWork(plan.params, plan.chunks[j], grad_slots_[j % depth].as<char>(),
                param_slots_[j % num_param_slots].as<char>(), run.mode, run.scalars, /*steps=*/nullptr, work,
                regions[j % depth]);
    }
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
    absl::Status submitted;
    const std::function<void()> meanwhile = [&] { submitted = upload_updated(); };
    if (!with_grads) {
      // The params from the masters: the same rounding as every update's param output.
      pool_->ParallelFor(work.tensors.size(), [&](size_t i) {
        const CpuAdamTensor& t = work.tensors[i];
        for (int64_t e = 0; e < t.numel; ++e) {
          const size_t el = static_cast<size_t>(e);
          StoreFromF32(t.param, t.param_dtype, el, LoadAsF32(t.master, t.state.master, el));
        }
      }, &meanwhile);
    } else {
      status = AdamRound(work, end - k, &meanwhile);
    }
    if (status.ok()) status = submitted;
    // A round that returned before its `meanwhile` ran leaves the round before's submissions.
    if (status.ok()) status = upload_updated();
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
    if (!status.ok()) break;
    updated_begin = k;
    updated_end = end;
    regions.swap(updated_regions);
    k = end;
  }
  if (status.ok()) status = upload_updated();
  if (!status.ok()) {
    // Stopped early: grad copies still in flight read the trainer's grads, which it may change once
    // the step returns. They finish first (at most `depth` chunks).
    for (auto& batch : down) {
      if (batch != nullptr) (void)batch->Wait();
    }
  }
  // Everything submitted stays alive until it completed (WaitPending at the next call).
  for (auto& batch : down) {
    if (batch != nullptr) pending_.push_back(std::move(batch));
  }
  for (auto& batch : up) {
    if (batch != nullptr) pending_.push_back(std::move(batch));
  }
  return status;
}

}  // namespace ferry
