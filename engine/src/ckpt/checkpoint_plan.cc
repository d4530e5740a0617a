#include "ckpt/checkpoint_plan.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/absl_compat.h"
#include "ckpt/ckpt_io.h"
#include "ferry/status.h"
#include "shard/layout.h"

namespace ferry {
namespace {

using ckpt_internal::Annotate;


absl::Status ValidateRequest(const std::string& root, int64_t step,
                             absl::Span<const TensorRecord> tensors,
                             absl::Span<const SkipRecord> skipped,
                             const CheckpointWriteOptions& options, bool local_data) {
  if (root.empty()) return absl::InvalidArgumentError("WriteCheckpoint: empty checkpoint root");
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("WriteCheckpoint: negative step ", step));
  }
  if (options.keep_last < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteCheckpoint: keep_last ", options.keep_last, " must be >= 0"));
  }
  absl::flat_hash_set<absl::string_view> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorRecord& t = tensors[i];
    if (t.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("WriteCheckpoint: tensors[", i, "] has no name"));
    }
    const std::string where = absl::StrCat("WriteCheckpoint: tensor '", t.name, "'");
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, " appears more than once"));
    }
    if (t.name == kSafetensorsMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the name is reserved by safetensors"));
    }
    if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": invalid dtype value ", static_cast<int>(t.dtype)));
    }
    if (t.kind.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": empty kind"));
    absl::StatusOr<uint64_t> expected = ShapeBytes(t.dtype, t.shape);
    if (!expected.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", expected.status().message()));
    }
    if (*expected != t.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": bytes is ", t.bytes, " but ",
                                                     ToAbsl(DTypeName(t.dtype)), " ",
                                                     ShapeString(t.shape), " needs ", *expected));
    }
    if (t.data == nullptr && t.bytes > 0 && !local_data) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": data is null but bytes is ", t.bytes));
    }
  }
  for (size_t i = 0; i < skipped.size(); ++i) {
    if (skipped[i].what.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("WriteCheckpoint: skipped[", i, "] says nothing about what was skipped"));
    }
  }
  return absl::OkStatus();
}

// The order of a rank's pieces in its file: 4-byte types first, then 2-byte ones, each in plan
// order. The data section starts 8-byte aligned, so every piece is then aligned to its element
// size, which mmap-based readers (safe_open, numpy views) prefer; safetensors forbids gaps, so
// padding is not an option.
std::vector<size_t> FileOrder(absl::Span<const TensorRecord> tensors,
                              absl::Span<const ShardPiece> pieces) {
  std::vector<size_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(tensors[pieces[a].tensor].dtype) > DTypeSize(tensors[pieces[b].tensor].dtype);
  });
  return order;
}

// The plan of rank `rank`'s file: `pieces` (of `tensors`) in file order, entries and header.
absl::StatusOr<RankFilePlan> PlanRankFile(absl::Span<const TensorRecord> tensors,
                                          absl::Span<const ShardPiece> pieces, int rank,
                                          const std::map<std::string, std::string>& metadata) {
  RankFilePlan plan;
  plan.rank = rank;
  plan.file_name = RankFileName(rank);
  uint64_t offset = 0;
  for (size_t k : FileOrder(tensors, pieces)) {
    const ShardPiece& p = pieces[k];
    if (p.tensor >= tensors.size() || p.global_offset + p.length > tensors[p.tensor].bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, ": a piece of tensor index ",
          p.tensor, " at byte ", p.global_offset, " + ", p.length, " lies outside the tensors"));
    }
    const TensorRecord& t = tensors[p.tensor];
    if (p.length > 0 && (t.data == nullptr || p.global_offset < t.data_begin)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, ": tensor '", t.name, "': the piece at byte ", p.global_offset,
          " is not inside this rank's data (", t.data == nullptr ? "none" : "it starts at byte ",
          t.data == nullptr ? "" : absl::StrCat(t.data_begin), ")"));
    }
    const uint64_t es = DTypeSize(t.dtype);
    const bool whole = p.global_offset == 0 && p.length == t.bytes;
    plan.pieces.push_back(p);
    plan.entries.push_back(
        {.name = ChunkEntryName(t.name, t.dtype, t.bytes, p.global_offset, p.length),
         .dtype = t.dtype,
         .shape = whole ? t.shape : std::vector<int64_t>{static_cast<int64_t>(p.length / es)},
         .begin = offset,
         .end = offset + p.length});
    offset += p.length;
  }
  absl::StatusOr<std::string> header = EncodeSafetensorsHeader(metadata, plan.entries);
  if (!header.ok()) {
    return Annotate(header.status(), absl::StrCat(" (", RankFileName(rank), ")"));
  }
  plan.header = *std::move(header);
  return plan;
}

// The manifest of a write, without chunks.
Manifest ManifestSkeleton(int64_t step, int world_size, absl::Span<const TensorRecord> tensors,
                          absl::Span<const SkipRecord> skipped,
                          const std::map<std::string, std::string>& metadata) {
  Manifest m;
  m.step = step;
  m.world_size = world_size;
  m.metadata = metadata;
  m.skipped.assign(skipped.begin(), skipped.end());
  m.tensors.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorRecord& t = tensors[i];
    ManifestTensor& mt = m.tensors[i];
    mt.name = t.name;
    mt.kind = t.kind;
    mt.group = t.group;
    mt.dtype = t.dtype;
    mt.shape = t.shape;
    mt.bytes = t.bytes;
  }
  return m;
}
}  // namespace

absl::Status ValidateWriteRequest(const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors,
                                  absl::Span<const SkipRecord> skipped, const CheckpointWriteOptions& options,
                                  bool local_data) {
  return ValidateRequest(root, step, tensors, skipped, options, local_data);
}

std::string RankFileName(int64_t rank) { return absl::StrFormat("rank-%05d.safetensors", rank); }

std::string ChunkEntryName(absl::string_view tensor, DType dtype, uint64_t tensor_bytes,
                           uint64_t global_offset, uint64_t length) {
  if (global_offset == 0 && length == tensor_bytes) return std::string(tensor);
  const uint64_t es = DTypeSize(dtype);
  return absl::StrCat(tensor, "[", global_offset / es, ":", (global_offset + length) / es, "]");
}

absl::StatusOr<CheckpointShards> CheckpointShards::Plan(absl::Span<const TensorRecord> tensors,
                                                        int world_size) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CheckpointShards: world size ", world_size, " must be >= 1"));
  }
  CheckpointShards shards;
  shards.pieces_.resize(static_cast<size_t>(world_size));
  std::vector<std::string> kinds;  // in order of first appearance
  absl::flat_hash_map<std::string, std::vector<size_t>> by_kind;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorRecord& t = tensors[i];
    absl::StatusOr<uint64_t> bytes = ShapeBytes(t.dtype, t.shape);
    if (!bytes.ok() || *bytes != t.bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("CheckpointShards: tensor '", t.name, "' has ", t.bytes, " bytes, which ",
                       ToAbsl(DTypeName(t.dtype)), " ", ShapeString(t.shape), " does not match"));
    }
    auto [it, inserted] = by_kind.try_emplace(t.kind);
    if (inserted) kinds.push_back(t.kind);
    it->second.push_back(i);
  }
  for (const std::string& kind : kinds) {
    std::vector<size_t> nonempty;
    std::vector<int64_t> numels;
    for (size_t i : by_kind[kind]) {
      const TensorRecord& t = tensors[i];
      const uint64_t numel = t.bytes / DTypeSize(t.dtype);
      if (numel == 0) {
        shards.pieces_[0].push_back({.tensor = i, .global_offset = 0, .length = 0});
      } else {
        nonempty.push_back(i);
        numels.push_back(static_cast<int64_t>(numel));
      }
    }
    if (nonempty.empty()) continue;
    absl::StatusOr<Layout> layout = Layout::Pack(numels, 1);
    if (!layout.ok()) return Annotate(layout.status(), absl::StrCat(" (kind '", kind, "')"));
    FERRY_ASSIGN_OR_RETURN(ShardPlan plan, ShardPlan::Partition(*layout, world_size));
    for (int r = 0; r < world_size; ++r) {
      for (const Chunk& c : plan.chunks(r)) {
        const size_t i = nonempty[c.tensor];
        const uint64_t es = DTypeSize(tensors[i].dtype);
        shards.pieces_[static_cast<size_t>(r)].push_back(
            {.tensor = i,
             .global_offset = static_cast<uint64_t>(c.tensor_offset) * es,
             .length = static_cast<uint64_t>(c.numel) * es});
      }
    }
  }
  return shards;
}

absl::StatusOr<SavePlan> PlanSave(const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors,
                                  int world_size, absl::Span<const SkipRecord> skipped,
                                  const std::map<std::string, std::string>& metadata,
                                  const CheckpointWriteOptions& options) {
  FERRY_RETURN_IF_ERROR(ValidateRequest(root, step, tensors, skipped, options, /*local_data=*/false));
  absl::StatusOr<CheckpointShards> shards = CheckpointShards::Plan(tensors, world_size);
  if (!shards.ok()) return Annotate(shards.status(), " (WriteCheckpoint)");
  SavePlan plan;
  for (int r = 0; r < world_size; ++r) {
    absl::StatusOr<RankFilePlan> file = PlanRankFile(tensors, shards->pieces(r), r, metadata);
    if (!file.ok()) return Annotate(file.status(), " (WriteCheckpoint)");
    plan.files.push_back(*std::move(file));
  }
  plan.skeleton = ManifestSkeleton(step, world_size, tensors, skipped, metadata);
  absl::Status s = SerializeManifest(plan.skeleton).status();
  if (!s.ok()) return Annotate(s, " (WriteCheckpoint)");
  return plan;
}

absl::StatusOr<SavePlan> PlanRankSave(const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors,
                                      int world_size, int rank, std::vector<ShardPiece> pieces,
                                      absl::Span<const SkipRecord> skipped,
                                      const std::map<std::string, std::string>& metadata,
                                      const CheckpointWriteOptions& options) {
  FERRY_RETURN_IF_ERROR(ValidateRequest(root, step, tensors, skipped, options, /*local_data=*/true));
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint: rank ", rank, " of world size ", world_size));
  }
  SavePlan plan;
  FERRY_ASSIGN_OR_RETURN(RankFilePlan file, PlanRankFile(tensors, pieces, rank, metadata));
  plan.files.push_back(std::move(file));
  plan.skeleton = ManifestSkeleton(step, world_size, tensors, skipped, metadata);
  return plan;
}

}  // namespace ferry
