#include "ckpt/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errors.h"
#include "base/logging.h"
#include "base/absl_compat.h"
#include "ckpt/posix_file.h"
#include "shard/layout.h"
#include "ckpt/safetensors.h"
#include "ferry/status.h"
#include "xxhash.h"

namespace ferry {
namespace {

static_assert(sizeof(size_t) == sizeof(uint64_t), "checkpoint offsets assume a 64-bit size_t");

constexpr absl::string_view kStepPrefix = "step-";
constexpr absl::string_view kIncompleteSuffix = ".incomplete";
constexpr absl::string_view kDeletingSuffix = ".deleting";
constexpr absl::string_view kLatestFileName = "latest";
// Tensors are written and read in pieces of this size, each hashed right after it is written or
// read, while it is still in cache: one pass over the data, large system calls.
constexpr size_t kIoChunkBytes = size_t{8} << 20;
constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;
constexpr uint64_t kMaxLatestBytes = 4096;
constexpr size_t kMaxStepDigits = 19;  // int64_t; SimpleAtoi refuses overflow

struct Xxh3StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using Xxh3State = std::unique_ptr<XXH3_state_t, Xxh3StateDeleter>;

absl::StatusOr<Xxh3State> NewXxh3State() {
  Xxh3State state(XXH3_createState());
  if (state == nullptr) return absl::ResourceExhaustedError("XXH3_createState: out of memory");
  return state;
}

void ResetXxh3(XXH3_state_t* state) {
  // Only fails for a null state, which NewXxh3State excludes.
  XXH_errorcode rc = XXH3_64bits_reset(state);
  (void)rc;
}

std::string StepDirName(int64_t step) { return absl::StrFormat("%s%08d", kStepPrefix, step); }

// The step of a committed directory name "step-<digits>"; nullopt for anything else.
std::optional<int64_t> ParseStepDirName(absl::string_view name) {
  if (!absl::StartsWith(name, kStepPrefix)) return std::nullopt;
  absl::string_view digits = name.substr(kStepPrefix.size());
  if (digits.empty() || digits.size() > kMaxStepDigits) return std::nullopt;
  for (char c : digits) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return std::nullopt;
  }
  int64_t step = 0;
  if (!absl::SimpleAtoi(digits, &step)) return std::nullopt;
  return step;
}

absl::string_view BaseName(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

absl::Status Annotate(const absl::Status& s, absl::string_view more) {
  return absl::Status(s.code(), absl::StrCat(s.message(), more));
}

// ---- writing ------------------------------------------------------------------------------------

absl::Status ValidateRequest(const std::string& root, int64_t step,
                             absl::Span<const TensorRecord> tensors,
                             absl::Span<const SkipRecord> skipped,
                             const CheckpointWriteOptions& options, bool local_data = false) {
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

// The order of the tensors in the file: 4-byte types first, then 2-byte ones, each in the caller's
// order. The data section starts 8-byte aligned, so every tensor is then aligned to its element
// size, which mmap-based readers (safe_open, numpy views) prefer; safetensors forbids gaps, so

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

// What a rank's file holds, computed from the request alone: the pieces in file order, their
// safetensors entries and the encoded header. Building it checks every string (UTF-8) and name.
struct RankFilePlan {
  std::vector<ShardPiece> pieces;  // in file order
  std::vector<SafetensorsEntry> entries;
  std::string header;  // length prefix + padded JSON
};

absl::StatusOr<RankFilePlan> PlanRankFile(absl::Span<const TensorRecord> tensors,
                                          const CheckpointShards& shards, int rank,
                                          const std::map<std::string, std::string>& metadata) {
  if (rank < 0 || rank >= shards.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside [0, world size ", shards.world_size(), ")"));
  }
  const std::vector<ShardPiece>& pieces = shards.pieces(rank);
  RankFilePlan plan;
  uint64_t offset = 0;
  for (size_t k : FileOrder(tensors, pieces)) {
    const ShardPiece& p = pieces[k];
    if (p.tensor >= tensors.size() || p.global_offset + p.length > tensors[p.tensor].bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank, ": the shard plan was made from other tensors (piece of tensor ",
          p.tensor, " at ", p.global_offset, " + ", p.length, " does not fit)"));
    }
    const TensorRecord& t = tensors[p.tensor];
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

// Starts the writeback of ranges of one file as the writers finish them, on a thread of its own:
// sync_file_range blocks while the disk's queue is full, and the writers, which only copy into the
// page cache, must not wait for the disk (an asynchronous save releases the memory it reads as soon
// as its bytes are in the page cache). Advisory: durability comes from the final fsync.
class WritebackQueue final {
 public:
  explicit WritebackQueue(const WritableFile* file) : file_(file), thread_([this] { Loop(); }) {}
  ~WritebackQueue() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  WritebackQueue(const WritebackQueue&) = delete;
  WritebackQueue& operator=(const WritebackQueue&) = delete;

  void Add(uint64_t offset, uint64_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ranges_.emplace_back(offset, n);
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return done_ || !ranges_.empty(); });
      if (ranges_.empty()) return;  // done, nothing left
      std::vector<std::pair<uint64_t, uint64_t>> batch;
      batch.swap(ranges_);
      lock.unlock();
      // A failure shows up in fsync.
      for (const auto& [offset, n] : batch) (void)file_->StartWriteback(offset, n);
      lock.lock();
    }
  }

  const WritableFile* file_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<uint64_t, uint64_t>> ranges_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after everything above is initialised
};

// Writes piece `p` of `t` (whose bytes are at `data`) at `file_offset` of `file` in bounded pieces,
// hashing each right after it is written (while it is still in cache), and returns its checksum. Each piece written is
// handed to `writeback` (if not null).
absl::StatusOr<uint64_t> WritePiece(const WritableFile& file, const TensorRecord& t,
                                    const char* data, const ShardPiece& p, uint64_t file_offset,
                                    WritebackQueue* writeback) {
  FERRY_ASSIGN_OR_RETURN(Xxh3State hash, NewXxh3State());
  ResetXxh3(hash.get());
  const char* src = data + (p.global_offset - t.data_begin);
  for (uint64_t done = 0; done < p.length;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kIoChunkBytes, p.length - done));
    absl::Status s = file.WriteAt(file_offset + done, src + done, n);
    if (!s.ok()) return Annotate(s, absl::StrCat(" (writing tensor '", t.name, "')"));
    XXH3_64bits_update(hash.get(), src + done, n);
    // Start the writeback of what was just written, so the final fsync has little left to do.
    if (writeback != nullptr) writeback->Add(file_offset + done, n);
    done += n;
  }
  return XXH3_64bits_digest(hash.get());
}

// Every check WriteShardedCheckpoint makes before touching the disk.
absl::StatusOr<CheckpointShards> PrepareWrite(const std::string& root, int64_t step,
                                              absl::Span<const TensorRecord> tensors,
                                              int world_size,
                                              absl::Span<const SkipRecord> skipped,
                                              const std::map<std::string, std::string>& metadata,
                                              const CheckpointWriteOptions& options) {
  FERRY_RETURN_IF_ERROR(ValidateRequest(root, step, tensors, skipped, options));
  absl::StatusOr<CheckpointShards> shards = CheckpointShards::Plan(tensors, world_size);
  if (!shards.ok()) return Annotate(shards.status(), " (WriteCheckpoint)");
  for (int r = 0; r < world_size; ++r) {
    absl::Status s = PlanRankFile(tensors, *shards, r, metadata).status();
    if (!s.ok()) return Annotate(s, " (WriteCheckpoint)");
  }
  absl::Status s =
      SerializeManifest(ManifestSkeleton(step, world_size, tensors, skipped, metadata)).status();
  if (!s.ok()) return Annotate(s, " (WriteCheckpoint)");
  return shards;
}

absl::Status CleanUpAfter(const absl::Status& failure, const std::string& tmp_dir) {
  absl::StatusOr<bool> exists = PathExists(tmp_dir);
  absl::Status s = exists.status();
  if (s.ok() && *exists) s = RemoveTree(tmp_dir);
  if (!s.ok()) {
    return Annotate(failure, absl::StrCat("; removing ", tmp_dir, " also failed: ", s.message()));
  }
  return failure;
}

// The checkpoint <root>/<name> has just been renamed into place: fsyncs the root and replaces
// `latest`. If `latest` could not be replaced, renames the checkpoint back and removes it, so the
// root is exactly as it was (and the step can be retried). Only when the final fsync after the
// rename of `latest` fails does the new checkpoint stay (committed and named by `latest`): the
// error says so.
absl::Status AnnounceOrRollBack(const std::string& root, const std::string& name, bool sync) {
  const std::string dir = JoinPath(root, name);
  absl::Status s = sync ? SyncDir(root) : absl::OkStatus();
  bool renamed = false;
  if (s.ok()) {
    s = ReplaceFileAtomically(root, std::string(kLatestFileName), absl::StrCat(name, "\n"), sync,
                              &renamed);
  }
  if (s.ok()) return s;
  if (renamed) {
    return Annotate(s, absl::StrCat(" (checkpoint ", dir,
                                    " is committed and `latest` names it, but its durability "
                                    "could not be confirmed)"));
  }
  const std::string tmp_dir = absl::StrCat(dir, kIncompleteSuffix);
  absl::Status undo = Rename(dir, tmp_dir);
  if (undo.ok()) undo = RemoveTree(tmp_dir);
  if (undo.ok() && sync) undo = SyncDir(root);
  if (!undo.ok()) {
    return Annotate(s, absl::StrCat("; rolling back ", dir, " also failed: ", undo.message()));
  }
  return s;
}

// The committed checkpoints under root as (step, name), ascending by step.
absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> CommittedSteps(
    const std::string& root) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(root));
  std::vector<std::pair<int64_t, std::string>> steps;
  for (std::string& name : names) {
    std::optional<int64_t> step = ParseStepDirName(name);
    if (!step.has_value()) continue;
    FERRY_ASSIGN_OR_RETURN(bool is_dir, IsDirectory(JoinPath(root, name)));
    if (is_dir) steps.emplace_back(*step, std::move(name));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Deletes a committed checkpoint: renamed first (atomic), so a crash halfway through deleting
// leaves a *.deleting directory that no reader takes for a checkpoint.
absl::Status DeleteCheckpoint(const std::string& root, const std::string& name, bool sync) {
  const std::string dir = JoinPath(root, name);
  const std::string doomed = absl::StrCat(dir, kDeletingSuffix);
  FERRY_ASSIGN_OR_RETURN(bool stale, PathExists(doomed));
  if (stale) FERRY_RETURN_IF_ERROR(RemoveTree(doomed));
  FERRY_RETURN_IF_ERROR(Rename(dir, doomed));
  if (sync) FERRY_RETURN_IF_ERROR(SyncDir(root));
  return RemoveTree(doomed);
}

// keep_last: keeps `new_step` and the keep_last - 1 newest checkpoints with a smaller step; deletes
// the others with a smaller step, oldest first. Larger steps are not touched.
absl::Status ApplyRetention(const std::string& root, int64_t new_step, int keep_last, bool sync) {
  FERRY_ASSIGN_OR_RETURN(auto steps, CommittedSteps(root));
  std::vector<std::string> older;
  for (auto& [step, name] : steps) {
    if (step < new_step) older.push_back(name);
  }
  const size_t keep_older = static_cast<size_t>(keep_last) - 1;
  if (older.size() <= keep_older) return absl::OkStatus();
  const size_t to_delete = older.size() - keep_older;
  for (size_t i = 0; i < to_delete; ++i) {
    FERRY_RETURN_IF_ERROR(DeleteCheckpoint(root, older[i], sync));
  }
  return absl::OkStatus();
}

// ---- reading ------------------------------------------------------------------------------------

// `path` itself if it holds manifest.json, else the directory its `latest` names.
absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(bool exists, PathExists(path));
  if (!exists) {
    return absl::NotFoundError(absl::StrCat("checkpoint path ", path, " does not exist"));
  }
  FERRY_ASSIGN_OR_RETURN(bool is_dir, IsDirectory(path));
  if (!is_dir) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint path ", path, " is not a directory"));
  }
  FERRY_ASSIGN_OR_RETURN(bool has_manifest, PathExists(JoinPath(path, kManifestFileName)));
  if (has_manifest) return path;
  const std::string latest_path = JoinPath(path, kLatestFileName);
  FERRY_ASSIGN_OR_RETURN(bool has_latest, PathExists(latest_path));
  if (!has_latest) {
    return absl::NotFoundError(absl::StrCat(path, " is neither a checkpoint directory (no ",
                                            kManifestFileName, ") nor a checkpoint root (no ",
                                            kLatestFileName, ")"));
  }
  FERRY_ASSIGN_OR_RETURN(std::string latest, ReadFileToString(latest_path, kMaxLatestBytes));
  absl::string_view name = absl::StripAsciiWhitespace(latest);
  if (name.empty() || name == "." || name == ".." || name.find('/') != absl::string_view::npos ||
      name.find('\0') != absl::string_view::npos) {
    return absl::DataLossError(absl::StrCat(latest_path, " must name a checkpoint directory in ",
                                            path, ", found '", absl::CHexEscape(latest), "'"));
  }
  const std::string dir = JoinPath(path, name);
  FERRY_ASSIGN_OR_RETURN(bool dir_has_manifest, PathExists(JoinPath(dir, kManifestFileName)));
  if (!dir_has_manifest) {
    return absl::NotFoundError(
        absl::StrCat(latest_path, " names ", name, ", but ", dir, " has no ", kManifestFileName));
  }
  return dir;
}


}  // namespace

absl::Status ValidateWriteRequest(const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors,
                                  absl::Span<const SkipRecord> skipped, const CheckpointWriteOptions& options,
                                  bool local_data) {
  return ValidateRequest(root, step, tensors, skipped, options, local_data);
}

absl::StatusOr<CheckpointShards> LocalShards(int world_size, int rank, std::vector<ShardPiece> pieces) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("LocalShards: rank ", rank, " of world size ", world_size));
  }
  CheckpointShards shards;
  shards.pieces_.resize(static_cast<size_t>(world_size));
  shards.pieces_[static_cast<size_t>(rank)] = std::move(pieces);
  return shards;
}

std::string CheckpointDirName(int64_t step) { return StepDirName(step); }

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

absl::StatusOr<std::string> BeginCheckpoint(const std::string& root, int64_t step,
                                            const CheckpointWriteOptions& options) {
  FERRY_RETURN_IF_ERROR(ValidateRequest(root, step, {}, {}, options));
  const std::string final_dir = JoinPath(root, StepDirName(step));
  const std::string tmp_dir = absl::StrCat(final_dir, kIncompleteSuffix);
  FERRY_RETURN_IF_ERROR(MakeDirs(root, options.fsync));
  FERRY_ASSIGN_OR_RETURN(bool exists, PathExists(final_dir));
  if (exists) {
    return absl::AlreadyExistsError(absl::StrCat(
        "checkpoint ", final_dir, " already exists; checkpoints are never overwritten"));
  }
  FERRY_ASSIGN_OR_RETURN(bool stale, PathExists(tmp_dir));
  if (stale) FERRY_RETURN_IF_ERROR(RemoveTree(tmp_dir));  // left by a crashed write of this step
  if (::mkdir(tmp_dir.c_str(), 0755) != 0) {
    return PosixError(absl::StrCat("mkdir ", tmp_dir), errno);
  }
  return tmp_dir;
}

absl::StatusOr<RankChunks> WriteRankFile(const std::string& tmp_dir,
                                         absl::Span<const TensorRecord> tensors,
                                         const CheckpointShards& shards, int rank,
                                         const std::map<std::string, std::string>& metadata,
                                         const CheckpointWriteOptions& options) {
  FERRY_ASSIGN_OR_RETURN(RankFilePlan plan, PlanRankFile(tensors, shards, rank, metadata));
  Tracer* const tracer = options.tracer;
  TraceSpan file_span(tracer, "ckpt.write", "ckpt");
  if (file_span.on()) {
    tracer->NameThread("ckpt writer", /*if_unnamed=*/true);
    uint64_t bytes = plan.header.size();
    for (const ShardPiece& p : plan.pieces) bytes += p.length;
    file_span.Arg("bytes", static_cast<double>(bytes));
    file_span.Arg("rank", rank);
    file_span.Detail(RankFileName(rank));
  }
  for (const ShardPiece& p : plan.pieces) {
    const TensorRecord& t = tensors[p.tensor];
    if (t.data == nullptr && p.length > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("WriteRankFile: tensor '", t.name, "' has null data"));
    }
    if (p.global_offset < t.data_begin) {
      return absl::InvalidArgumentError(absl::StrCat("WriteRankFile: tensor '", t.name, "': a piece at byte ",
                                                     p.global_offset, " lies before the data's first byte ",
                                                     t.data_begin));
    }
  }
  const std::string file_name = RankFileName(rank);
  FERRY_ASSIGN_OR_RETURN(WritableFile file, WritableFile::Create(JoinPath(tmp_dir, file_name)));
  FERRY_RETURN_IF_ERROR(file.WriteAt(0, plan.header.data(), plan.header.size()));
  RankChunks out;
  out.rank = rank;
  out.chunks.resize(plan.pieces.size());
  std::vector<absl::Status> status(plan.pieces.size());
  // The pieces in the order their bytes are to be read (TensorRecord::write_order), each written at
  // its place in the file.
  std::vector<size_t> order(plan.pieces.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[plan.pieces[a].tensor].write_order < tensors[plan.pieces[b].tensor].write_order;
  });
  std::optional<WritebackQueue> writeback_queue;
  WritebackQueue* writeback = nullptr;
  if (options.fsync) writeback = &writeback_queue.emplace(&file);
  auto write_one = [&](size_t i) {
    const size_t k = order[i];
    const ShardPiece& p = plan.pieces[k];
    const uint64_t file_offset = plan.header.size() + plan.entries[k].begin;
    const char* data = static_cast<const char*>(tensors[p.tensor].data);
    TraceSpan piece_span(tracer, "ckpt.write.piece", "ckpt");
    if (piece_span.on()) {
      tracer->NameThread("ckpt io", /*if_unnamed=*/true);
      piece_span.Arg("bytes", static_cast<double>(p.length));
      piece_span.Detail(tensors[p.tensor].name);
    }
    if (options.before_write) {
      absl::StatusOr<const void*> ready = options.before_write(p.tensor);
      if (!ready.ok()) {
        status[k] = Annotate(ready.status(), absl::StrCat(" (before writing tensor '", tensors[p.tensor].name, "')"));
        return;
      }
      if (*ready != nullptr) data = static_cast<const char*>(*ready);
    }
    absl::StatusOr<uint64_t> checksum =
        WritePiece(file, tensors[p.tensor], data, p, file_offset, writeback);
    if (!checksum.ok()) {
      status[k] = checksum.status();
      return;
    }
    if (options.after_write) options.after_write(p.tensor, p.global_offset, p.length);
    out.chunks[k] = {p.tensor,
                     ManifestChunk{.rank = rank,
                                   .file = file_name,
                                   .global_offset = p.global_offset,
                                   .length = p.length,
                                   .file_offset = file_offset,
                                   .checksum = *checksum}};
  };
  if (options.pool != nullptr && plan.pieces.size() > 1) {
    options.pool->ParallelFor(plan.pieces.size(), write_one);
  } else {
    for (size_t k = 0; k < plan.pieces.size(); ++k) write_one(k);
  }
  writeback_queue.reset();  // joins its thread: nothing uses the file besides this one any more
  for (const absl::Status& s : status) FERRY_RETURN_IF_ERROR(s);
  if (options.fsync) {
    TraceSpan sync_span(tracer, "ckpt.fsync", "ckpt");
    sync_span.Detail(file_name);
    FERRY_RETURN_IF_ERROR(file.Sync());
  }
  FERRY_RETURN_IF_ERROR(file.Close());
  return out;
}

absl::StatusOr<std::string> CommitCheckpoint(const std::string& root, int64_t step,
                                             absl::Span<const TensorRecord> tensors,
                                             absl::Span<const SkipRecord> skipped,
                                             const std::map<std::string, std::string>& metadata,
                                             int world_size, absl::Span<const RankChunks> ranks,
                                             const CheckpointWriteOptions& options) {
  const std::string name = StepDirName(step);
  const std::string final_dir = JoinPath(root, name);
  const std::string tmp_dir = absl::StrCat(final_dir, kIncompleteSuffix);
  TraceSpan commit_span(options.tracer, "ckpt.commit", "ckpt");
  commit_span.Detail(name);
  // Assembles the manifest from every rank's chunks; nothing on disk changes until it is complete.
  auto assemble = [&]() -> absl::StatusOr<std::string> {
    if (world_size < 1 || ranks.size() != static_cast<size_t>(world_size)) {
      return absl::InvalidArgumentError(absl::StrCat("CommitCheckpoint: ", ranks.size(),
                                                     " ranks reported, world size ", world_size));
    }
    Manifest m = ManifestSkeleton(step, world_size, tensors, skipped, metadata);
    std::vector<bool> seen(static_cast<size_t>(world_size), false);
    for (const RankChunks& r : ranks) {
      if (r.rank < 0 || r.rank >= world_size || seen[static_cast<size_t>(r.rank)]) {
        return absl::InvalidArgumentError(
            absl::StrCat("CommitCheckpoint: rank ", r.rank, " is out of range or reported twice"));
      }
      seen[static_cast<size_t>(r.rank)] = true;
      for (const auto& [tensor, chunk] : r.chunks) {
        if (tensor >= m.tensors.size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "CommitCheckpoint: rank ", r.rank, " reports a chunk of tensor index ", tensor));
        }
        m.tensors[tensor].chunks.push_back(chunk);
      }
    }
    for (ManifestTensor& t : m.tensors) {
      std::sort(t.chunks.begin(), t.chunks.end(),
                [](const ManifestChunk& a, const ManifestChunk& b) {
                  return a.global_offset < b.global_offset;
                });
      uint64_t covered = 0;
      for (const ManifestChunk& c : t.chunks) {
        if (c.global_offset != covered) break;
        covered += c.length;
      }
      if (t.chunks.empty() || covered != t.bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("CommitCheckpoint: the ranks' chunks of tensor '", t.name,
                         "' do not tile its ", t.bytes, " bytes"));
      }
    }
    return SerializeManifest(m);
  };
  absl::StatusOr<std::string> text = assemble();
  absl::Status s = text.status();
  if (s.ok()) {
    absl::StatusOr<WritableFile> file = WritableFile::Create(JoinPath(tmp_dir, kManifestFileName));
    s = file.status();
    if (s.ok()) s = file->Append(text->data(), text->size());
    if (s.ok() && options.fsync) s = file->Sync();
    if (s.ok()) s = file->Close();
  }
  if (s.ok() && options.fsync) s = SyncDir(tmp_dir);
  if (s.ok()) s = RenameNoReplace(tmp_dir, final_dir);
  if (!s.ok()) return CleanUpAfter(s, tmp_dir);
  FERRY_RETURN_IF_ERROR(AnnounceOrRollBack(root, name, options.fsync));

  if (options.keep_last > 0) {
    absl::Status r = ApplyRetention(root, step, options.keep_last, options.fsync);
    if (!r.ok()) {
      FERRY_LOG(WARNING) << "checkpoint " << final_dir
                         << " committed, but deleting older checkpoints (keep_last "
                         << options.keep_last << ") failed: " << r;
    }
  }
  return final_dir;
}

absl::Status AbortCheckpoint(const std::string& root, int64_t step) {
  const std::string tmp_dir = absl::StrCat(JoinPath(root, StepDirName(step)), kIncompleteSuffix);
  FERRY_ASSIGN_OR_RETURN(bool exists, PathExists(tmp_dir));
  return exists ? RemoveTree(tmp_dir) : absl::OkStatus();
}

absl::StatusOr<std::string> WriteShardedCheckpoint(
    const std::string& root, int64_t step, absl::Span<const TensorRecord> tensors, int world_size,
    absl::Span<const SkipRecord> skipped, const std::map<std::string, std::string>& metadata,
    const CheckpointWriteOptions& options) {
  FERRY_ASSIGN_OR_RETURN(
      CheckpointShards shards,
      PrepareWrite(root, step, tensors, world_size, skipped, metadata, options));
  FERRY_ASSIGN_OR_RETURN(std::string tmp_dir, BeginCheckpoint(root, step, options));
  std::vector<RankChunks> ranks;
  ranks.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    absl::StatusOr<RankChunks> chunks =
        WriteRankFile(tmp_dir, tensors, shards, r, metadata, options);
    if (!chunks.ok()) return CleanUpAfter(chunks.status(), tmp_dir);
    ranks.push_back(*std::move(chunks));
  }
  return CommitCheckpoint(root, step, tensors, skipped, metadata, world_size, ranks, options);
}

absl::StatusOr<std::string> WriteCheckpoint(const std::string& root, int64_t step,
                                            absl::Span<const TensorRecord> tensors,
                                            absl::Span<const SkipRecord> skipped,
                                            const std::map<std::string, std::string>& metadata,
                                            const CheckpointWriteOptions& options) {
  return WriteShardedCheckpoint(root, step, tensors, 1, skipped, metadata, options);
}

// ---- CheckpointReader ---------------------------------------------------------------------------

namespace {

std::string DescribeChunk(const TensorEntry& e, const ManifestChunk& c) {
  const uint64_t es = DTypeSize(e.dtype);
  return absl::StrCat("bytes [", c.file_offset, ", ", c.file_offset + c.length, ") of ", c.file,
                      ", elements [", c.global_offset / es, ", ", (c.global_offset + c.length) / es,
                      ") of the tensor");
}

}  // namespace

CheckpointReader::~CheckpointReader() = default;

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(std::string dir, ResolveCheckpointDir(path));
  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  absl::StatusOr<std::string> text = ReadFileToString(manifest_path, kMaxManifestBytes);
  if (!text.ok()) {
    return Annotate(text.status(), absl::StrCat(" (reading the manifest of checkpoint ", dir, ")"));
  }
  FERRY_ASSIGN_OR_RETURN(Manifest manifest, ParseManifest(*text, manifest_path));
  std::optional<int64_t> dir_step = ParseStepDirName(BaseName(dir));
  if (dir_step.has_value() && *dir_step != manifest.step) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": step ", manifest.step,
                                            " disagrees with the directory name ", BaseName(dir)));
  }

  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->dir_ = dir;
  reader->step_ = manifest.step;
  reader->metadata_ = manifest.metadata;
  reader->skipped_ = std::move(manifest.skipped);
  // file name -> (tensor index, chunk index)
  std::map<std::string, std::vector<std::pair<size_t, size_t>>> by_file;
  for (ManifestTensor& t : manifest.tensors) {
    const uint64_t es = DTypeSize(t.dtype);
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      const ManifestChunk& c = t.chunks[k];
      const std::string where =
          absl::StrCat(manifest_path, ": tensor '", t.name, "' chunks[", k, "]");
      if (c.file != RankFileName(c.rank)) {
        return absl::DataLossError(absl::StrCat(where, ": a chunk of rank ", c.rank,
                                                " must be in ", RankFileName(c.rank), ", not ",
                                                c.file));
      }
      if (c.global_offset % es != 0 || c.length % es != 0) {
        return absl::DataLossError(absl::StrCat(where, ": offset ", c.global_offset,
                                                " and length ", c.length,
                                                " must be whole elements of ", es, " bytes"));
      }
      by_file[c.file].emplace_back(reader->tensors_.size(), k);
    }
    const ManifestChunk& first = t.chunks[0];
    reader->index_.emplace(t.name, reader->tensors_.size());
    reader->tensors_.push_back({.name = std::move(t.name),
                                .kind = std::move(t.kind),
                                .group = std::move(t.group),
                                .dtype = t.dtype,
                                .shape = std::move(t.shape),
                                .bytes = t.bytes,
                                .checksum = first.checksum,
                                .file = first.file,
                                .file_offset = first.file_offset,
                                .chunks = std::move(t.chunks)});
  }

  for (auto& [file_name, refs] : by_file) {
    const std::string file_path = JoinPath(dir, file_name);
    auto chunk_of = [&](const std::pair<size_t, size_t>& ref) -> const ManifestChunk& {
      return reader->tensors_[ref.first].chunks[ref.second];
    };
    std::sort(refs.begin(), refs.end(), [&](const auto& a, const auto& b) {
      return chunk_of(a).file_offset < chunk_of(b).file_offset;
    });
    absl::StatusOr<ReadOnlyFile> file = ReadOnlyFile::Open(file_path);
    if (!file.ok()) {
      return Annotate(file.status(),
                      absl::StrCat(" (", manifest_path, " places tensor '",
                                   reader->tensors_[refs[0].first].name, "' there)"));
    }
    // Truncation first: it names the first tensor that does not fit, even when the header is gone
    // too.
    for (const auto& ref : refs) {
      const ManifestChunk& c = chunk_of(ref);
      if (c.file_offset + c.length > file->size()) {
        const TensorEntry& e = reader->tensors_[ref.first];
        return absl::DataLossError(absl::StrCat(file_path, " is truncated: it has ", file->size(),
                                                " bytes, but tensor '", e.name, "' occupies ",
                                                DescribeChunk(e, c)));
      }
    }
    FERRY_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(*file));
    absl::flat_hash_map<absl::string_view, const SafetensorsEntry*> in_header;
    for (const SafetensorsEntry& h : header.entries) in_header.emplace(h.name, &h);
    for (const auto& ref : refs) {
      const TensorEntry& e = reader->tensors_[ref.first];
      const ManifestChunk& c = chunk_of(ref);
      const std::string entry_name =
          ChunkEntryName(e.name, e.dtype, e.bytes, c.global_offset, c.length);
      auto it = in_header.find(entry_name);
      if (it == in_header.end()) {
        return absl::DataLossError(absl::StrCat(file_path, ": '", entry_name, "' (tensor '",
                                                e.name, "' of ", manifest_path,
                                                ") is missing from the safetensors header"));
      }
      const SafetensorsEntry& h = *it->second;
      const bool whole = c.length == e.bytes;
      const std::vector<int64_t> shape =
          whole ? e.shape
                : std::vector<int64_t>{static_cast<int64_t>(c.length / DTypeSize(e.dtype))};
      if (h.dtype != e.dtype || h.shape != shape ||
          header.data_start + h.begin != c.file_offset) {
        return absl::DataLossError(absl::StrCat(
            file_path, ": the safetensors header disagrees with ", manifest_path, " on tensor '",
            e.name, "' ('", entry_name, "'): header says ", ToAbsl(DTypeSafetensorsName(h.dtype)),
            " ", ShapeString(h.shape), " at file offset ", header.data_start + h.begin,
            ", manifest says ", ToAbsl(DTypeSafetensorsName(e.dtype)), " ", ShapeString(shape),
            " at ", c.file_offset));
      }
      in_header.erase(it);
    }
    if (!in_header.empty()) {
      return absl::DataLossError(absl::StrCat(file_path, ": the safetensors header lists tensor '",
                                              in_header.begin()->first, "' that ", manifest_path,
                                              " does not place in this file"));
    }
    if (header.metadata != reader->metadata_) {
      return absl::DataLossError(
          absl::StrCat(file_path, ": the safetensors __metadata__ (", header.metadata.size(),
                       " entries) differs from the "
                       "metadata in ",
                       manifest_path, " (", reader->metadata_.size(), " entries)"));
    }
    reader->files_.emplace(file_name, std::make_unique<ReadOnlyFile>(*std::move(file)));
  }
  return reader;
}

const TensorEntry* CheckpointReader::Find(std::string_view name) const {
  auto it = index_.find(ToAbsl(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status CheckpointReader::ReadChunk(const TensorEntry& entry, const ManifestChunk& c,
                                         uint64_t offset, char* dst, uint64_t n) const {
  auto file_it = files_.find(c.file);
  FERRY_CHECK(file_it != files_.end()) << "Open() opened every file of the manifest";
  const ReadOnlyFile& file = *file_it->second;
  FERRY_ASSIGN_OR_RETURN(Xxh3State hash, NewXxh3State());
  ResetXxh3(hash.get());
  // The part of the chunk the caller wants, in global bytes: [lo, hi).
  const uint64_t chunk_end = c.global_offset + c.length;
  const uint64_t lo = dst == nullptr ? 0 : std::max(offset, c.global_offset);
  const uint64_t hi = dst == nullptr ? 0 : std::min(offset + n, chunk_end);
  // A chunk wanted whole is read straight into dst; anything else goes through a bounded scratch
  // buffer, since the checksum covers the whole chunk.
  const bool direct = dst != nullptr && lo == c.global_offset && hi == chunk_end;
  std::vector<char> scratch;
  if (!direct) scratch.resize(static_cast<size_t>(std::min<uint64_t>(kIoChunkBytes, c.length)));
  for (uint64_t done = 0; done < c.length;) {
    const size_t m = static_cast<size_t>(std::min<uint64_t>(kIoChunkBytes, c.length - done));
    char* piece = direct ? dst + (c.global_offset - offset) + done : scratch.data();
    absl::Status s = file.ReadAt(c.file_offset + done, piece, m);
    if (!s.ok()) return Annotate(s, absl::StrCat(" (reading tensor '", entry.name, "')"));
    XXH3_64bits_update(hash.get(), piece, m);
    if (!direct && lo < hi) {
      const uint64_t begin = std::max(lo, c.global_offset + done);
      const uint64_t end = std::min(hi, c.global_offset + done + m);
      if (begin < end) {
        std::memcpy(dst + (begin - offset), piece + (begin - c.global_offset - done),
                    static_cast<size_t>(end - begin));
      }
    }
    done += m;
  }
  const uint64_t found = XXH3_64bits_digest(hash.get());
  if (found != c.checksum) {
    return absl::DataLossError(absl::StrCat("checksum mismatch in ", file.path(), " for tensor '",
                                            entry.name, "' (", DescribeChunk(entry, c),
                                            "): expected ", FormatChecksum(c.checksum),
                                            ", found ", FormatChecksum(found)));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadRange(std::string_view std_name, uint64_t offset, void* dst,
                                         size_t n) const {
  const absl::string_view name = ToAbsl(std_name);
  const TensorEntry* entry = Find(std_name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " has no tensor '", name, "'"));
  }
  if (offset > entry->bytes || n > entry->bytes - offset) {
    return absl::OutOfRangeError(absl::StrCat("ReadRange '", name, "': bytes [", offset, ", +", n,
                                              ") pass the end of the tensor's ", entry->bytes));
  }
  if (dst == nullptr && n > 0) {
    return absl::InvalidArgumentError(absl::StrCat("ReadRange '", name, "': null destination"));
  }
  char* out = static_cast<char*>(dst);
  for (const ManifestChunk& c : entry->chunks) {
    const bool overlaps = c.global_offset < offset + n && c.global_offset + c.length > offset;
    if (entry->bytes == 0) {
      FERRY_RETURN_IF_ERROR(ReadChunk(*entry, c, 0, nullptr, 0));  // checks the empty checksum
    } else if (overlaps) {
      FERRY_RETURN_IF_ERROR(ReadChunk(*entry, c, offset, out, n));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::ReadTensor(std::string_view std_name, void* dst,
                                          size_t dst_bytes) const {
  const absl::string_view name = ToAbsl(std_name);
  const TensorEntry* entry = Find(std_name);
  if (entry == nullptr) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " has no tensor '", name, "'"));
  }
  if (dst_bytes != entry->bytes) {
    return absl::InvalidArgumentError(absl::StrCat("ReadTensor '", name, "': destination has ",
                                                   dst_bytes, " bytes, the tensor ", entry->bytes));
  }
  return ReadRange(std_name, 0, dst, dst_bytes);
}

absl::Status CheckpointReader::VerifyAll() const {
  absl::Status first;
  size_t failed = 0, total = 0;
  for (const TensorEntry& e : tensors_) {
    for (const ManifestChunk& c : e.chunks) {
      ++total;
      absl::Status s = ReadChunk(e, c, 0, nullptr, 0);
      if (!s.ok()) {
        if (failed == 0) first = s;
        ++failed;
      }
    }
  }
  if (failed > 1) {
    return Annotate(first, absl::StrCat(" [", failed, " of ", total,
                                        " chunks failed verification in ", dir_, "]"));
  }
  return first;
}

absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& root) {
  FERRY_ASSIGN_OR_RETURN(auto steps, CommittedSteps(root));
  std::vector<std::string> dirs;
  dirs.reserve(steps.size());
  for (const auto& [step, name] : steps) dirs.push_back(JoinPath(root, name));
  return dirs;
}

}  // namespace ferry
