#include "ckpt/checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <utility>

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
constexpr absl::string_view kRankFileName = "rank-00000.safetensors";
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
                             const CheckpointWriteOptions& options) {
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
    if (t.data == nullptr && t.bytes > 0) {
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
// padding is not an option.
std::vector<size_t> FileOrder(absl::Span<const TensorRecord> tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return DTypeSize(tensors[a].dtype) > DTypeSize(tensors[b].dtype);
  });
  return order;
}

// What a write puts on disk, computed from the request alone: the file order, the safetensors
// header and the manifest (checksums still 0). Building it checks every string (UTF-8) before the
// disk is touched.
struct WritePlan {
  std::vector<size_t> order;  // tensor indices in file order
  std::string header;         // length prefix + padded JSON
  Manifest manifest;          // tensors in the caller's order
};

absl::StatusOr<WritePlan> PlanWrite(int64_t step, absl::Span<const TensorRecord> tensors,
                                    absl::Span<const SkipRecord> skipped,
                                    const std::map<std::string, std::string>& metadata) {
  WritePlan plan;
  plan.order = FileOrder(tensors);
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  uint64_t offset = 0;
  for (size_t i : plan.order) {
    const TensorRecord& t = tensors[i];
    entries.push_back({.name = t.name,
                       .dtype = t.dtype,
                       .shape = t.shape,
                       .begin = offset,
                       .end = offset + t.bytes});
    offset += t.bytes;
  }
  FERRY_ASSIGN_OR_RETURN(plan.header, EncodeSafetensorsHeader(metadata, entries));

  Manifest& manifest = plan.manifest;
  manifest.step = step;
  manifest.world_size = 1;
  manifest.metadata = metadata;
  manifest.skipped.assign(skipped.begin(), skipped.end());
  manifest.tensors.resize(tensors.size());
  for (size_t k = 0; k < plan.order.size(); ++k) {
    const TensorRecord& t = tensors[plan.order[k]];
    ManifestTensor& m = manifest.tensors[plan.order[k]];
    m.name = t.name;
    m.kind = t.kind;
    m.group = t.group;
    m.dtype = t.dtype;
    m.shape = t.shape;
    m.bytes = t.bytes;
    m.chunks.push_back({.rank = 0,
                        .file = std::string(kRankFileName),
                        .global_offset = 0,
                        .length = t.bytes,
                        .file_offset = plan.header.size() + entries[k].begin,
                        .checksum = 0});
  }
  FERRY_RETURN_IF_ERROR(SerializeManifest(manifest).status());
  return plan;
}

// Writes the safetensors file and then manifest.json into `dir`, each synced (if `sync`) and
// closed. Fills in the manifest's checksums, hashing each piece of a tensor as it is written.
absl::Status WriteStepFiles(const std::string& dir, absl::Span<const TensorRecord> tensors,
                            WritePlan& plan, XXH3_state_t* hash, bool sync) {
  {
    FERRY_ASSIGN_OR_RETURN(WritableFile file, WritableFile::Create(JoinPath(dir, kRankFileName)));
    FERRY_RETURN_IF_ERROR(file.Append(plan.header.data(), plan.header.size()));
    for (size_t i : plan.order) {
      const TensorRecord& t = tensors[i];
      ResetXxh3(hash);
      const char* p = static_cast<const char*>(t.data);
      for (size_t done = 0; done < t.bytes;) {
        const size_t n = std::min(kIoChunkBytes, t.bytes - done);
        absl::Status s = file.Append(p + done, n);
        if (!s.ok()) return Annotate(s, absl::StrCat(" (writing tensor '", t.name, "')"));
        XXH3_64bits_update(hash, p + done, n);
        done += n;
      }
      plan.manifest.tensors[i].chunks[0].checksum = XXH3_64bits_digest(hash);
    }
    if (sync) FERRY_RETURN_IF_ERROR(file.Sync());
    FERRY_RETURN_IF_ERROR(file.Close());
  }
  FERRY_ASSIGN_OR_RETURN(std::string text, SerializeManifest(plan.manifest));
  FERRY_ASSIGN_OR_RETURN(WritableFile file, WritableFile::Create(JoinPath(dir, kManifestFileName)));
  FERRY_RETURN_IF_ERROR(file.Append(text.data(), text.size()));
  if (sync) FERRY_RETURN_IF_ERROR(file.Sync());
  return file.Close();
}

// Removes `tmp_dir` after `failure`; a failure to clean up is added to the message.
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

std::string DescribeChecksumRange(const TensorEntry& e) {
  return absl::StrCat("bytes [", e.file_offset, ", ", e.file_offset + e.bytes, ")");
}

}  // namespace

absl::StatusOr<std::string> WriteCheckpoint(const std::string& root, int64_t step,
                                            absl::Span<const TensorRecord> tensors,
                                            absl::Span<const SkipRecord> skipped,
                                            const std::map<std::string, std::string>& metadata,
                                            const CheckpointWriteOptions& options) {
  FERRY_RETURN_IF_ERROR(ValidateRequest(root, step, tensors, skipped, options));
  absl::StatusOr<WritePlan> plan = PlanWrite(step, tensors, skipped, metadata);
  if (!plan.ok()) return Annotate(plan.status(), " (WriteCheckpoint)");
  FERRY_ASSIGN_OR_RETURN(Xxh3State hash, NewXxh3State());

  const std::string name = StepDirName(step);
  const std::string final_dir = JoinPath(root, name);
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

  absl::Status s = WriteStepFiles(tmp_dir, tensors, *plan, hash.get(), options.fsync);
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

// ---- CheckpointReader ---------------------------------------------------------------------------

CheckpointReader::~CheckpointReader() = default;

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(std::string dir, ResolveCheckpointDir(path));
  const std::string manifest_path = JoinPath(dir, kManifestFileName);
  absl::StatusOr<std::string> text = ReadFileToString(manifest_path, kMaxManifestBytes);
  if (!text.ok()) {
    return Annotate(text.status(), absl::StrCat(" (reading the manifest of checkpoint ", dir, ")"));
  }
  FERRY_ASSIGN_OR_RETURN(Manifest manifest, ParseManifest(*text, manifest_path));
  if (manifest.world_size != 1) {
    return absl::UnimplementedError(
        absl::StrCat(manifest_path, ": world_size ", manifest.world_size,
                     "; this reader loads single-rank checkpoints only"));
  }
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
  std::map<std::string, std::vector<size_t>> by_file;  // file name -> tensor indices
  for (ManifestTensor& t : manifest.tensors) {
    if (t.chunks.size() != 1) {
      return absl::UnimplementedError(
          absl::StrCat(manifest_path, ": tensor '", t.name, "' has ", t.chunks.size(),
                       " chunks; this reader loads one chunk per tensor"));
    }
    ManifestChunk& c = t.chunks[0];
    by_file[c.file].push_back(reader->tensors_.size());
    reader->index_.emplace(t.name, reader->tensors_.size());
    reader->tensors_.push_back({.name = std::move(t.name),
                                .kind = std::move(t.kind),
                                .group = std::move(t.group),
                                .dtype = t.dtype,
                                .shape = std::move(t.shape),
                                .bytes = t.bytes,
                                .checksum = c.checksum,
                                .file = std::move(c.file),
                                .file_offset = c.file_offset});
  }

  for (auto& [file_name, indices] : by_file) {
    const std::string file_path = JoinPath(dir, file_name);
    std::sort(indices.begin(), indices.end(), [&](size_t a, size_t b) {
      return reader->tensors_[a].file_offset < reader->tensors_[b].file_offset;
    });
    absl::StatusOr<ReadOnlyFile> file = ReadOnlyFile::Open(file_path);
    if (!file.ok()) {
      return Annotate(file.status(), absl::StrCat(" (", manifest_path, " places tensor '",
                                                  reader->tensors_[indices[0]].name, "' there)"));
    }
    // Truncation first: it names the first tensor that does not fit, even when the header is gone
    // too.
    for (size_t i : indices) {
      const TensorEntry& e = reader->tensors_[i];
      if (e.file_offset + e.bytes > file->size()) {
        return absl::DataLossError(absl::StrCat(file_path, " is truncated: it has ", file->size(),
                                                " bytes, but tensor '", e.name, "' occupies ",
                                                DescribeChecksumRange(e)));
      }
    }
    FERRY_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(*file));
    absl::flat_hash_map<absl::string_view, const SafetensorsEntry*> in_header;
    for (const SafetensorsEntry& h : header.entries) in_header.emplace(h.name, &h);
    for (size_t i : indices) {
      const TensorEntry& e = reader->tensors_[i];
      auto it = in_header.find(e.name);
      if (it == in_header.end()) {
        return absl::DataLossError(absl::StrCat(file_path, ": tensor '", e.name, "' of ",
                                                manifest_path,
                                                " is missing from the safetensors header"));
      }
      const SafetensorsEntry& h = *it->second;
      if (h.dtype != e.dtype || h.shape != e.shape ||
          header.data_start + h.begin != e.file_offset) {
        return absl::DataLossError(absl::StrCat(
            file_path, ": the safetensors header disagrees with ", manifest_path, " on tensor '",
            e.name, "': header says ", ToAbsl(DTypeSafetensorsName(h.dtype)), " ",
            ShapeString(h.shape), " at file offset ", header.data_start + h.begin,
            ", manifest says ", ToAbsl(DTypeSafetensorsName(e.dtype)), " ", ShapeString(e.shape),
            " at ", e.file_offset));
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

absl::Status CheckpointReader::ReadAndVerify(const TensorEntry& entry, void* dst) const {
  auto file_it = files_.find(entry.file);
  FERRY_CHECK(file_it != files_.end()) << "Open() opened every file of the manifest";
  const ReadOnlyFile& file = *file_it->second;
  FERRY_ASSIGN_OR_RETURN(Xxh3State hash, NewXxh3State());
  ResetXxh3(hash.get());
  // With dst == nullptr (VerifyAll) the bytes go through a bounded scratch buffer.
  std::vector<char> scratch;
  if (dst == nullptr) scratch.resize(std::min(kIoChunkBytes, entry.bytes));
  char* out = static_cast<char*>(dst);
  for (size_t done = 0; done < entry.bytes;) {
    const size_t n = std::min(kIoChunkBytes, entry.bytes - done);
    char* piece = out != nullptr ? out + done : scratch.data();
    absl::Status s = file.ReadAt(entry.file_offset + done, piece, n);
    if (!s.ok()) return Annotate(s, absl::StrCat(" (reading tensor '", entry.name, "')"));
    XXH3_64bits_update(hash.get(), piece, n);
    done += n;
  }
  const uint64_t found = XXH3_64bits_digest(hash.get());
  if (found != entry.checksum) {
    return absl::DataLossError(absl::StrCat("checksum mismatch in ", file.path(), " for tensor '",
                                            entry.name, "' (", DescribeChecksumRange(entry),
                                            "): expected ", FormatChecksum(entry.checksum),
                                            ", found ", FormatChecksum(found)));
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
  if (dst == nullptr && dst_bytes > 0) {
    return absl::InvalidArgumentError(absl::StrCat("ReadTensor '", name, "': null destination"));
  }
  if (entry->bytes == 0) return ReadAndVerify(*entry, nullptr);  // still checks the empty checksum
  return ReadAndVerify(*entry, dst);
}

absl::Status CheckpointReader::VerifyAll() const {
  absl::Status first;
  size_t failed = 0;
  for (const TensorEntry& e : tensors_) {
    absl::Status s = ReadAndVerify(e, nullptr);
    if (!s.ok()) {
      if (failed == 0) first = s;
      ++failed;
    }
  }
  if (failed > 1) {
    return Annotate(first, absl::StrCat(" [", failed, " of ", tensors_.size(),
                                        " tensors failed verification in ", dir_, "]"));
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
