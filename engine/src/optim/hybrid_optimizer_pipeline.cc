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

absl::StatusOr<std::unique_ptr<TransferBatch>> HybridOptimizer::SubmitGradChunk(size_t k, Event& grads_ready) {
  std::vector<CopyRegion> regions;
  char* slot = grad_slots_[k % grad_slots_.size()].as<char>();
  size_t at = 0;
  for (const ChunkPiece& piece : grad_chunks_[k].pieces) {
    const OptimParam& op = params_[cpu_params_[piece.region]];
    regions.push_back(CopyRegion{slot + at, static_cast<const char*>(op.grad) + piece.offset, piece.bytes});
    at += piece.bytes;
  }
  return transfer_->DeviceToHost(regions, &grads_ready);
}

// The pipeline over grad chunks, `depth` = number of staging slots:
//   D2H of chunk k+depth-1 | CPU Adam on chunk k | H2D of chunk k-1, all in flight at once.
// Chunk k's grads land in grad slot k % depth; CPU Adam writes its new params into param slot k % depth,
// which the H2D of chunk k reads. A grad slot is refilled once CPU Adam has read it; a param slot is
// rewritten only after the H2D that read it completed.
absl::Status HybridOptimizer::StepCpuGroups(float lr, double grad_multiplier, Event& grads_ready) {
  if (cpu_params_.empty()) return absl::OkStatus();
  std::vector<AdamScalars> scalars(groups_.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    AdamHyper h = groups_[gi].hyper;
    h.lr = GroupLr(lr, groups_[gi].lr_scale);
    scalars[gi] = MakeAdamScalars(h, groups_[gi].step + 1, grad_multiplier);
  }
  const size_t num_chunks = grad_chunks_.size();
  const size_t depth = grad_slots_.size();
  std::vector<std::unique_ptr<TransferBatch>> down(num_chunks), up(num_chunks);
  for (size_t k = 0; k < std::min(depth, num_chunks); ++k) {
    absl::StatusOr<std::unique_ptr<TransferBatch>> first = SubmitGradChunk(k, grads_ready);
    if (!first.ok()) {
      d2h_trace_.queue.clear();  // the batches it points to go away with `down`
      return first.status();
    }
    down[k] = *std::move(first);
    TraceSubmitted(d2h_trace_, down[k].get());
  }
  Tracer* const tracer = options_.tracer;
  // A batch done without blocking: its events complete in stream order, so its last chunk tells.
  auto done = [](TransferBatch* batch) {
    if (batch == nullptr) return false;
    if (batch->num_chunks() == 0) return true;
    absl::StatusOr<bool> d = batch->ChunkDone(batch->num_chunks() - 1);
    return d.ok() && *d;
  };
  std::vector<CpuAdamTensor> work;
  std::vector<std::vector<CopyRegion>> regions(depth);
  absl::Status status;
  size_t k = 0;
  while (k < num_chunks && status.ok()) {
    {
      TraceSpan wait(tracer, "wait.copies", "optim");
      status = down[k]->Wait();
      if (status.ok() && k >= depth) status = up[k - depth]->Wait();  // its param slot is rewritten now
    }
    if (!status.ok()) break;
    // Every further chunk that has already landed (and whose param slot is free) joins this round, so
    // CPU Adam runs as few parallel sections as the copies allow.
    size_t end = k + 1;
    while (end < num_chunks && end < k + depth && done(down[end].get()) &&
           (end < depth || done(up[end - depth].get()))) {
      ++end;
    }
    work.clear();
    for (size_t j = k; j < end; ++j) {
      const char* grad_slot = grad_slots_[j % depth].as<char>();
      char* param_slot = param_slots_[j % depth].as<char>();
      std::vector<CopyRegion>& up_regions = regions[j - k];
      up_regions.clear();
      size_t grad_at = 0, param_at = 0;
      for (const ChunkPiece& piece : grad_chunks_[j].pieces) {
        const size_t p = cpu_params_[piece.region];
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
        t.rounding = RoundingKey(p, e0);
        t.grad = grad_slot + grad_at;
        t.param = param_slot + param_at;
        t.numel = static_cast<int64_t>(n);
        t.grad_dtype = op.grad_dtype;
        t.param_dtype = op.dtype;
        t.scalars = &scalars[op.group];
        work.push_back(t);
        up_regions.push_back(CopyRegion{static_cast<char*>(op.param) + e0 * psize, param_slot + param_at, n * psize});
        grad_at += piece.bytes;
        param_at += n * psize;
      }
    }
    if (fence_ != nullptr && !fence_->all_released()) {
      // A checkpoint still reads some offloaded state in place: the state of these chunks' params is
      // copied aside for it first (or, being written right now, waited for).
      std::vector<size_t> touched;
      for (size_t j = k; j < end; ++j) {
        for (const ChunkPiece& piece : grad_chunks_[j].pieces) touched.push_back(cpu_params_[piece.region]);
      }
      TraceSpan acquire(tracer, "fence.acquire", "optim");
      fence_->Acquire(touched, pool_);
    }
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
    {
      TraceSpan round(tracer, "cpu_adam.round", "optim");
      if (round.on()) {
        double elements = 0.0, bytes = 0.0;
        for (const CpuAdamTensor& t : work) {
          elements += static_cast<double>(t.numel);
          bytes += static_cast<double>(t.numel) *
                   static_cast<double>(2 * t.state.bytes_per_element() + DTypeSize(t.grad_dtype) + DTypeSize(t.param_dtype));
        }
        round.Arg("chunks", static_cast<double>(end - k));
        round.Arg("elements", elements);
        round.Arg("bytes", bytes);
      }
      status = cpu_adam_.Step(work);
    }
    TraceObserve(d2h_trace_, /*block=*/false);
    TraceObserve(h2d_trace_, /*block=*/false);
    for (size_t j = k; j < end && status.ok(); ++j) {
      // The trainer's stream may still read the params until the grads are ready: the upload waits.
      absl::StatusOr<std::unique_ptr<TransferBatch>> upload = transfer_->HostToDevice(regions[j - k], &grads_ready);
      if (!upload.ok()) {
        status = upload.status();
        break;
      }
      up[j] = *std::move(upload);
      TraceSubmitted(h2d_trace_, up[j].get());
      if (j + depth < num_chunks) {
        absl::StatusOr<std::unique_ptr<TransferBatch>> next = SubmitGradChunk(j + depth, grads_ready);
        if (!next.ok()) {
          status = next.status();
          break;
        }
        down[j + depth] = *std::move(next);
        TraceSubmitted(d2h_trace_, down[j + depth].get());
      }
    }
    k = end;
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
