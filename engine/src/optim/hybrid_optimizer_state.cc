// HybridOptimizer's state outside Step: syncing masters from the model, reads and writes of single
// tensors, checkpoint snapshots and restores, and the masters' verification.
#include "optim/hybrid_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <utility>
#include <vector>

#include "base/logging.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/absl_compat.h"
#include "ferry/status.h"

namespace ferry {

absl::Status HybridOptimizer::SyncParamsFromModel(const std::vector<size_t>& params) {
  WaitForStateReaders();
  FERRY_RETURN_IF_ERROR(Synchronize());
  FERRY_RETURN_IF_ERROR(work_stream_->WaitFor(*step_done_));
  std::vector<size_t> host_params;
  std::vector<CopyRegion> host_regions;
  for (size_t p : params) {
    const OptimParam& op = params_[p];
    if (groups_[op.group].offloaded) {
      host_params.push_back(p);
      host_regions.push_back(CopyRegion{nullptr, op.param, static_cast<size_t>(op.numel) * DTypeSize(op.dtype)});
    } else {
      FERRY_RETURN_IF_ERROR(device_->LaunchConvert(StatePtr(p, StateKind::kMaster), state_dtype(p, StateKind::kMaster),
                                                   op.param, op.dtype, op.numel, *work_stream_));
    }
  }
  FERRY_RETURN_IF_ERROR(work_stream_->Synchronize());
  if (host_params.empty()) return absl::OkStatus();
  // 4-byte params first, so every chunk piece is whole elements (chunks are cut at multiples of 4).
  std::vector<size_t> order(host_params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(params_[host_params[a]].dtype) > DTypeSize(params_[host_params[b]].dtype);
  });
  {
    std::vector<size_t> sorted_params;
    std::vector<CopyRegion> sorted_regions;
    for (size_t i : order) {
      sorted_params.push_back(host_params[i]);
      sorted_regions.push_back(host_regions[i]);
    }
    host_params = std::move(sorted_params);
    host_regions = std::move(sorted_regions);
  }
  // Offloaded params come down chunk by chunk through the grad slots (each holds chunk_bytes) and are
  // widened into their fp32 masters.
  const std::vector<ChunkPlan> chunks = PlanChunks(host_regions, grad_slots_[0].bytes / 4 * 4);
  for (size_t k = 0; k < chunks.size(); ++k) {
    char* slot = grad_slots_[0].as<char>();
    std::vector<CopyRegion> regions;
    size_t at = 0;
    for (const ChunkPiece& piece : chunks[k].pieces) {
      regions.push_back(CopyRegion{slot + at, static_cast<const char*>(host_regions[piece.region].src) + piece.offset,
                                   piece.bytes});
      at += piece.bytes;
    }
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<TransferBatch> batch, transfer_->DeviceToHost(regions, step_done_.get()));
    FERRY_RETURN_IF_ERROR(batch->Wait());
    at = 0;
    for (const ChunkPiece& piece : chunks[k].pieces) {
      const OptimParam& op = params_[host_params[piece.region]];
      const size_t esize = DTypeSize(op.dtype);
      const DType master_dtype = state_dtype(host_params[piece.region], StateKind::kMaster);
      char* master = StatePtr(host_params[piece.region], StateKind::kMaster, piece.offset / esize);
      const char* src = slot + at;
      const size_t n = piece.bytes / esize;
      pool_->ParallelFor((n + 65535) / 65536, [&](size_t block) {
        const size_t end = std::min(n, (block + 1) * 65536);
        for (size_t e = block * 65536; e < end; ++e) StoreFromF32(master, master_dtype, e, LoadAsF32(src, op.dtype, e));
      });
      at += piece.bytes;
    }
  }
  return absl::OkStatus();
}

absl::Status HybridOptimizer::SyncFromModel(const std::vector<size_t>& groups, bool reset_optimizer) {
  std::vector<size_t> params;
  for (size_t g : groups) {
    if (g >= groups_.size()) return absl::InvalidArgumentError(absl::StrCat("no group ", g));
    for (size_t p : groups_[g].params) params.push_back(p);
  }
  FERRY_RETURN_IF_ERROR(SyncParamsFromModel(params));
  if (!reset_optimizer) return absl::OkStatus();
  for (size_t g : groups) {
    Group& grp = groups_[g];
    const size_t bytes = 2 * static_cast<size_t>(grp.layout.total_elements()) * DTypeSize(grp.format.moments);
    if (bytes == 0) {
      // no state on this rank
    } else if (grp.offloaded) {
      // Both sides: each param's moments are on its own (state_side_).
      std::memset(grp.state(StateKind::kExpAvg), 0, bytes);
      if (grp.spare_n > 0) {
        std::memset(grp.state(StateKind::kExpAvg, /*spare=*/true), 0,
                    2 * static_cast<size_t>(grp.spare_n) * DTypeSize(grp.format.moments));
      }
    } else {
      FERRY_RETURN_IF_ERROR(device_->MemsetAsync(grp.state(StateKind::kExpAvg), 0, bytes, *work_stream_));
    }
    grp.step = 0;
  }
  return work_stream_->Synchronize();
}

namespace {

// Converts n elements between state dtypes (kF32, kBF16): widening is exact, narrowing rounds to
// nearest even (ferry/dtype.h). Equal dtypes copy.
void ConvertState(void* dst, DType dst_dtype, const void* src, DType src_dtype, size_t n) {
  if (dst_dtype == src_dtype) {
    std::memcpy(dst, src, n * DTypeSize(dst_dtype));
    return;
  }
  for (size_t e = 0; e < n; ++e) StoreFromF32(dst, dst_dtype, e, LoadAsF32(src, src_dtype, e));
}

}  // namespace

absl::Status HybridOptimizer::ReadStateRaw(size_t param, StateKind kind, void* host) {
  FERRY_RETURN_IF_ERROR(Synchronize());
  const OptimParam& op = params_[param];
  const size_t bytes = static_cast<size_t>(op.numel) * DTypeSize(state_dtype(param, kind));
  if (groups_[op.group].offloaded) {
    std::memcpy(host, StatePtr(param, kind), bytes);
    return absl::OkStatus();
  }
  FERRY_RETURN_IF_ERROR(device_->CopyAsync(host, StatePtr(param, kind), bytes, CopyKind::kDeviceToHost, *work_stream_));
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::ReadState(size_t param, StateKind kind, float* host) {
  const DType stored = state_dtype(param, kind);
  if (stored == DType::kF32) return ReadStateRaw(param, kind, host);
  std::vector<uint16_t> raw(static_cast<size_t>(params_[param].numel));
  FERRY_RETURN_IF_ERROR(ReadStateRaw(param, kind, raw.data()));
  ConvertState(host, DType::kF32, raw.data(), stored, raw.size());
  return absl::OkStatus();
}

absl::Status HybridOptimizer::WriteState(size_t param, StateKind kind, const float* host) {
  WaitForStateReaders();
  FERRY_RETURN_IF_ERROR(Synchronize());
  const OptimParam& op = params_[param];
  const DType stored = state_dtype(param, kind);
  const size_t n = static_cast<size_t>(op.numel);
  std::vector<char> narrowed;
  const void* src = host;
  if (stored != DType::kF32) {
    narrowed.resize(n * DTypeSize(stored));
    ConvertState(narrowed.data(), stored, host, DType::kF32, n);
    src = narrowed.data();
  }
  const size_t bytes = n * DTypeSize(stored);
  if (groups_[op.group].offloaded) {
    std::memcpy(StatePtr(param, kind), src, bytes);
    return absl::OkStatus();
  }
  FERRY_RETURN_IF_ERROR(device_->CopyAsync(StatePtr(param, kind), src, bytes, CopyKind::kHostToDevice, *work_stream_));
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::CopyItems(absl::Span<const SnapshotItem> items, bool to_host) {
  if (!to_host) WaitForStateReaders();
  FERRY_RETURN_IF_ERROR(Synchronize());
  const char* const op_name = to_host ? "Snapshot" : "Restore";
  for (const SnapshotItem& item : items) {
    if (item.param >= params_.size() || item.dst == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op_name, ": bad item for param ", item.param));
    }
    if (!item.is_param && item.dtype != DType::kF32 && item.dtype != DType::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat(op_name, ": the item for param '", params_[item.param].name,
                                                     "' has dtype ", ToAbsl(DTypeName(item.dtype)),
                                                     "; state is f32 or bf16"));
    }
  }
  struct Piece {
    char* dst;
    const char* src;
    size_t bytes;
  };
  std::vector<Piece> host_pieces;
  constexpr size_t kPiece = size_t{16} << 20;
  // Items whose dtype differs from the stored one go through a buffer of the stored dtype: converted
  // into it before a restore, out of it after a snapshot (both explicit, see SnapshotItem::dtype).
  struct Conversion {
    std::vector<char> stored;  // numel elements of the stored dtype
    void* item = nullptr;      // the caller's buffer, numel elements of item_dtype
    DType item_dtype = DType::kF32;
    DType stored_dtype = DType::kF32;
    size_t numel = 0;
  };
  std::deque<Conversion> conversions;  // stable addresses: copies in flight point into them
  std::vector<Conversion*> conversion_of(items.size(), nullptr);
  for (size_t i = 0; i < items.size(); ++i) {
    const SnapshotItem& item = items[i];
    if (item.is_param || item.dtype == state_dtype(item.param, item.kind)) continue;
    Conversion& c = conversions.emplace_back();
    c.item = item.dst;
    c.item_dtype = item.dtype;
    c.stored_dtype = state_dtype(item.param, item.kind);
    c.numel = static_cast<size_t>(params_[item.param].numel);
    c.stored.resize(c.numel * DTypeSize(c.stored_dtype));
    conversion_of[i] = &c;
  }
  if (!to_host) {
    pool_->ParallelFor(conversions.size(), [&](size_t k) {
      Conversion& c = conversions[k];
      ConvertState(c.stored.data(), c.stored_dtype, c.item, c.item_dtype, c.numel);
    });
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const SnapshotItem& item = items[i];
    const OptimParam& op = params_[item.param];
    if (item.is_param) {
      const size_t pbytes = static_cast<size_t>(op.numel) * DTypeSize(op.dtype);
      absl::Status st = to_host ? device_->CopyAsync(item.dst, op.param, pbytes, CopyKind::kDeviceToHost, *work_stream_)
                                : device_->CopyAsync(op.param, item.dst, pbytes, CopyKind::kHostToDevice, *work_stream_);
      if (!st.ok()) {
        (void)work_stream_->Synchronize();  // nothing enqueued may outlive the caller's buffers
        return st;
      }
      continue;
    }
    const size_t bytes = static_cast<size_t>(op.numel) * DTypeSize(state_dtype(item.param, item.kind));
    char* state = StatePtr(item.param, item.kind);
    char* host = static_cast<char*>(item.dst);
    if (conversion_of[i] != nullptr) host = conversion_of[i]->stored.data();
    if (!groups_[op.group].offloaded) {
      absl::Status st = to_host ? device_->CopyAsync(host, state, bytes, CopyKind::kDeviceToHost, *work_stream_)
                                : device_->CopyAsync(state, host, bytes, CopyKind::kHostToDevice, *work_stream_);
      if (!st.ok()) {
        (void)work_stream_->Synchronize();
        return st;
      }
      continue;
    }
    for (size_t at = 0; at < bytes; at += kPiece) {
      const size_t len = std::min(kPiece, bytes - at);
      host_pieces.push_back(to_host ? Piece{host + at, state + at, len} : Piece{state + at, host + at, len});
    }
  }
  pool_->ParallelFor(host_pieces.size(), [&](size_t k) {
    std::memcpy(host_pieces[k].dst, host_pieces[k].src, host_pieces[k].bytes);
  });
  FERRY_RETURN_IF_ERROR(work_stream_->Synchronize());
  if (to_host) {
    pool_->ParallelFor(conversions.size(), [&](size_t k) {
      const Conversion& c = conversions[k];
      ConvertState(c.item, c.item_dtype, c.stored.data(), c.stored_dtype, c.numel);
    });
  }
  return absl::OkStatus();
}

absl::Status HybridOptimizer::Snapshot(absl::Span<const SnapshotItem> items) { return CopyItems(items, true); }

absl::Status HybridOptimizer::Restore(absl::Span<const SnapshotItem> items) { return CopyItems(items, false); }

absl::Status HybridOptimizer::SnapshotDeviceAsync(absl::Span<const SnapshotItem> items) {
  // Validate everything first: nothing is enqueued for a bad request.
  for (const SnapshotItem& item : items) {
    if (item.param >= params_.size() || item.dst == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("SnapshotDeviceAsync: bad item for param ", item.param));
    }
    if (!item.is_param && groups_[params_[item.param].group].offloaded) {
      return absl::InvalidArgumentError(absl::StrCat("SnapshotDeviceAsync: the state of param '",
                                                     params_[item.param].name,
                                                     "' is offloaded; it is read in place, not copied"));
    }
    if (!item.is_param && item.dtype != state_dtype(item.param, item.kind)) {
      return absl::InvalidArgumentError(absl::StrCat("SnapshotDeviceAsync: the item for param '", params_[item.param].name,
                                                     "' asks for ", ToAbsl(DTypeName(item.dtype)), " but the state is ",
                                                     ToAbsl(DTypeName(state_dtype(item.param, item.kind)))));
    }
  }
  // After the last step's work on the trainer's stream (its kernels, and its uploads of the
  // offloaded groups' params, which the trainer's stream waited for).
  FERRY_RETURN_IF_ERROR(work_stream_->WaitFor(*step_done_));
  for (const SnapshotItem& item : items) {
    const OptimParam& op = params_[item.param];
    absl::Status st =
        item.is_param
            ? device_->CopyAsync(item.dst, op.param, static_cast<size_t>(op.numel) * DTypeSize(op.dtype),
                                 CopyKind::kDeviceToHost, *work_stream_)
            : device_->CopyAsync(item.dst, StatePtr(item.param, item.kind),
                                 static_cast<size_t>(op.numel) * DTypeSize(state_dtype(item.param, item.kind)),
                                 CopyKind::kDeviceToHost, *work_stream_);
    if (!st.ok()) {
      (void)work_stream_->Synchronize();  // nothing enqueued may outlive the caller's buffers
      return st;
    }
  }
  FERRY_RETURN_IF_ERROR(work_stream_->Record(*snapshot_done_));
  snapshot_pending_ = true;
  return absl::OkStatus();
}

absl::Status HybridOptimizer::WaitSnapshot() { return snapshot_done_->Synchronize(); }

absl::Status HybridOptimizer::ReadParam(size_t param, void* host) {
  FERRY_RETURN_IF_ERROR(Synchronize());
  const OptimParam& op = params_[param];
  FERRY_RETURN_IF_ERROR(device_->CopyAsync(host, op.param, static_cast<size_t>(op.numel) * DTypeSize(op.dtype),
                                           CopyKind::kDeviceToHost, *work_stream_));
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::WriteParam(size_t param, const void* host) {
  FERRY_RETURN_IF_ERROR(Synchronize());
  const OptimParam& op = params_[param];
  FERRY_RETURN_IF_ERROR(device_->CopyAsync(op.param, host, static_cast<size_t>(op.numel) * DTypeSize(op.dtype),
                                           CopyKind::kHostToDevice, *work_stream_));
  return work_stream_->Synchronize();
}

absl::Status HybridOptimizer::VerifyMasters() {
  std::vector<char> param_bytes;
  std::vector<float> master;
  for (size_t p = 0; p < params_.size(); ++p) {
    const OptimParam& op = params_[p];
    const size_t esize = DTypeSize(op.dtype);
    param_bytes.resize(static_cast<size_t>(op.numel) * esize);
    master.resize(static_cast<size_t>(op.numel));
    FERRY_RETURN_IF_ERROR(ReadParam(p, param_bytes.data()));
    FERRY_RETURN_IF_ERROR(ReadState(p, StateKind::kMaster, master.data()));
    for (size_t e = 0; e < master.size(); ++e) {
      char rounded[4];
      StoreFromF32(rounded, op.dtype, 0, master[e]);
      if (std::memcmp(rounded, param_bytes.data() + e * esize, esize) != 0) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "stale master: group '%s', param '%s', element %d: the param is %g but its fp32 master is %g "
            "(%s); sync the masters from the model (SyncFromModel, or an after_load policy that syncs) "
            "before stepping",
            groups_[op.group].name, op.name, e, LoadAsF32(param_bytes.data(), op.dtype, e), master[e],
            groups_[op.group].offloaded ? "pinned host memory" : "GPU memory"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry
