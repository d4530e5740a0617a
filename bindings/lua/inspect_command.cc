// `ferry inspect`: what a checkpoint holds, and with --verify whether every byte of it is intact.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/absl_compat.h"
#include "ckpt/checkpoint.h"
#include "ckpt/manifest.h"
#include "lua/commands.h"
#include "lua/verb_flags.h"

ABSL_FLAG(bool, ferry_inspect_verify, false,
          "read every tensor and check its checksum against the manifest");
ABSL_FLAG(std::string, ferry_inspect_progress, "auto",
          "progress while verifying, on stderr: auto (a bar when stderr is a terminal and the "
          "checkpoint holds at least 64 MiB), on, off");
ABSL_FLAG(bool, ferry_inspect_tensors, true, "list every tensor (--notensors: the summary only)");

namespace ferry::cli {
namespace {

constexpr int64_t kProgressAutoBytes = int64_t{64} << 20;

const std::vector<VerbFlag>& InspectFlags() {
  static const auto* flags = new std::vector<VerbFlag>{
      {"verify", "ferry_inspect_verify"},
      {"progress", "ferry_inspect_progress", "auto|on|off"},
      {"tensors", "ferry_inspect_tensors"},
  };
  return *flags;
}

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

// Progress of --verify on `err`: a bar redrawn in place on a terminal, else a line per tenth.
class Progress final {
 public:
  Progress(std::FILE* err, bool enabled, int64_t total_bytes, size_t total_tensors)
      : err_(err),
        enabled_(enabled),
        tty_(isatty(fileno(err)) != 0),
        total_bytes_(total_bytes),
        total_tensors_(total_tensors) {}

  void Update(int64_t done_bytes, size_t done_tensors) {
    if (!enabled_) return;
    const double fraction =
        total_bytes_ > 0 ? static_cast<double>(done_bytes) / static_cast<double>(total_bytes_)
                         : static_cast<double>(done_tensors) / static_cast<double>(std::max<size_t>(total_tensors_, 1));
    const int percent = static_cast<int>(fraction * 100.0);
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(fraction * kWidth);
      absl::FPrintF(err_, "\rverify [%s%s] %3d%%  %s / %s  %d/%d tensors", std::string(filled, '#'),
                    std::string(kWidth - filled, '.'), percent, HumanBytes(done_bytes),
                    HumanBytes(total_bytes_), done_tensors, total_tensors_);
      if (done_tensors == total_tensors_) absl::FPrintF(err_, "\n");
      std::fflush(err_);
      return;
    }
    const int tenth = percent / 10;
    if (tenth > last_tenth_) {
      last_tenth_ = tenth;
      absl::FPrintF(err_, "verify: %d%% (%d/%d tensors, %s of %s)\n", tenth * 10, done_tensors,
                    total_tensors_, HumanBytes(done_bytes), HumanBytes(total_bytes_));
    }
  }

 private:
  std::FILE* err_;
  bool enabled_;
  bool tty_;
  int64_t total_bytes_;
  size_t total_tensors_;
  int last_tenth_ = 0;
};

// Whether `path` is a checkpoint root (no manifest.json of its own) rather than a step directory.
bool IsRoot(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) &&
         !std::filesystem::exists(std::filesystem::path(path) / std::string(kManifestFileName), ec);
}

// For a root: the leftovers of crashed saves, and which the next save would remove (nothing is
// changed here; see ckpt/checkpoint_gc.h).
void PrintLeftovers(const std::string& root, std::FILE* out, std::FILE* err) {
  absl::StatusOr<std::vector<StaleCheckpointDir>> found = FindStaleCheckpoints(root);
  if (!found.ok()) {
    absl::FPrintF(err, "warning: looking for leftovers of crashed saves in %s: %s\n", root, found.status().message());
    return;
  }
  uint64_t removable_bytes = 0;
  size_t removable = 0;
  for (const StaleCheckpointDir& d : *found) {
    if (!d.removable) continue;
    ++removable;
    removable_bytes += d.bytes;
  }
  absl::FPrintF(out, "leftovers of crashed saves:%s\n", found->empty() ? " none" : "");
  for (const StaleCheckpointDir& d : *found) {
    absl::FPrintF(out, "  %s: %d bytes (%s), %s: %s\n", d.name, d.bytes, HumanBytes(static_cast<int64_t>(d.bytes)),
                  d.removable ? "the next save removes it" : "kept", d.reason);
  }
  if (!found->empty()) {
    absl::FPrintF(out, "  the next save removes %d of %d (%s)\n", removable, found->size(),
                  HumanBytes(static_cast<int64_t>(removable_bytes)));
  }
}

struct GroupSummary {
  size_t tensors = 0;
  int64_t bytes = 0;
  std::vector<std::string> kinds;
};

}  // namespace

std::string InspectUsage() {
  return absl::StrCat(
      "usage: ferry inspect CHECKPOINT [--verify] [flags]\n"
      "\n"
      "Describes a checkpoint written by Engine::SaveCheckpoint: CHECKPOINT is a step directory\n"
      "(holding manifest.json) or a checkpoint root, whose `latest` names the directory. Prints\n"
      "the step, the metadata, the files (one safetensors shard per rank), the parameter groups\n"
      "(placement and optimizer step when saved), every tensor (name, kind, group, dtype, shape,\n"
      "bytes, file, offset, checksum), the bytes per kind, and what the checkpoint skipped and why.\n"
      "For a root it also lists the leftovers of crashed saves (step-N.incomplete, step-N.deleting)\n"
      "with their sizes, and which of them the next save will remove (those no live save holds);\n"
      "inspect itself changes nothing.\n"
      "The manifest and the files' headers are checked on opening; --verify also reads every\n"
      "tensor and checks its XXH3 checksum, reporting each one that fails. The exit status is 0\n"
      "when all is well, 1 when the checkpoint cannot be read or a checksum fails, 2 for a usage\n"
      "error.\n"
      "\n"
      "flags:\n",
      FlagsHelp(InspectFlags()));
}

int InspectCommand(const std::vector<std::string>& args, std::FILE* out, std::FILE* err) {
  if (WantsHelp(args)) {
    std::fputs(InspectUsage().c_str(), out);
    return 0;
  }
  auto usage_error = [&](absl::string_view message) {
    absl::FPrintF(err, "%s\n(ferry inspect --help for usage)\n", message);
    return 2;
  };
  absl::StatusOr<std::vector<std::string>> positional =
      ParseVerbFlags("inspect", args, InspectFlags());
  if (!positional.ok()) return usage_error(positional.status().message());
  if (positional->size() != 1) {
    return usage_error(absl::StrCat("ferry inspect: expected one CHECKPOINT, got ",
                                    positional->size(), " arguments"));
  }
  const std::string progress_mode = absl::GetFlag(FLAGS_ferry_inspect_progress);
  if (progress_mode != "auto" && progress_mode != "on" && progress_mode != "off") {
    return usage_error(absl::StrCat("ferry inspect: --progress must be auto, on or off, got \"",
                                    progress_mode, "\""));
  }
  const std::string& path = (*positional)[0];
  const bool root = IsRoot(path);
  absl::StatusOr<std::unique_ptr<CheckpointReader>> opened = CheckpointReader::Open(path);
  if (!opened.ok()) {
    if (root) PrintLeftovers(path, out, err);
    absl::FPrintF(err, "error: %s\n", opened.status().message());
    return 1;
  }
  const CheckpointReader& reader = **opened;
  const std::vector<TensorEntry>& tensors = reader.tensors();

  absl::FPrintF(out, "checkpoint: %s\n", reader.dir());
  absl::FPrintF(out, "step: %d\n", reader.step());
  auto world = reader.metadata().find("ferry.world_size");
  absl::FPrintF(out, "format: %s version %d, world size %s\n", kManifestFormat,
                kManifestFormatVersion, world == reader.metadata().end() ? "1" : world->second);

  absl::FPrintF(out, "metadata:\n");
  for (const auto& [key, value] : reader.metadata()) {
    absl::FPrintF(out, "  %s = %s\n", key, value);
  }

  absl::FPrintF(out, "skipped:%s\n", reader.skipped().empty() ? " nothing" : "");
  for (const SkipRecord& s : reader.skipped()) {
    absl::FPrintF(out, "  %s (%s)\n", s.what, s.reason);
  }

  // Files (the shards: one per rank).
  std::map<std::string, std::pair<size_t, int64_t>> files;  // name -> tensors, bytes
  for (const TensorEntry& t : tensors) {
    auto& f = files[t.file];
    f.first += 1;
    f.second += static_cast<int64_t>(t.bytes);
  }
  absl::FPrintF(out, "files:\n");
  for (const auto& [name, f] : files) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(std::filesystem::path(reader.dir()) / name, ec);
    absl::FPrintF(out, "  %s: %d tensors, %d bytes of tensor data, file size %s\n", name, f.first,
                  f.second, ec ? std::string("unknown") : absl::StrCat(size, " bytes"));
  }

  // Groups, from the tensors and the engine's metadata.
  std::map<std::string, GroupSummary> groups;
  std::vector<std::string> group_order;
  for (const TensorEntry& t : tensors) {
    if (!groups.contains(t.group)) group_order.push_back(t.group);
    GroupSummary& g = groups[t.group];
    g.tensors += 1;
    g.bytes += static_cast<int64_t>(t.bytes);
    if (std::find(g.kinds.begin(), g.kinds.end(), t.kind) == g.kinds.end()) g.kinds.push_back(t.kind);
  }
  absl::FPrintF(out, "groups:\n");
  for (const std::string& name : group_order) {
    const GroupSummary& g = groups[name];
    auto meta = [&](const char* field) {
      auto it = reader.metadata().find(absl::StrCat("ferry.group.", name, ".", field));
      return it == reader.metadata().end() ? std::string("?") : it->second;
    };
    absl::FPrintF(out, "  %s: placement %s, step %s, %d tensors (%s), %d bytes\n",
                  name.empty() ? "(no group)" : name, meta("placement"), meta("step"), g.tensors,
                  absl::StrJoin(g.kinds, ", "), g.bytes);
  }

  std::map<std::string, std::pair<size_t, int64_t>> kinds;
  int64_t total_bytes = 0;
  for (const TensorEntry& t : tensors) {
    kinds[t.kind].first += 1;
    kinds[t.kind].second += static_cast<int64_t>(t.bytes);
    total_bytes += static_cast<int64_t>(t.bytes);
  }
  absl::FPrintF(out, "tensors: %d, %d bytes (%s)\n", tensors.size(), total_bytes,
                HumanBytes(total_bytes));
  for (const auto& [kind, k] : kinds) {
    absl::FPrintF(out, "  %s: %d tensors, %d bytes\n", kind, k.first, k.second);
  }
  if (absl::GetFlag(FLAGS_ferry_inspect_tensors) && !tensors.empty()) {
    size_t width = 4;
    for (const TensorEntry& t : tensors) width = std::max(width, t.name.size());
    const int w = static_cast<int>(width);
    absl::FPrintF(out, "  %-*s %-10s %-12s %-5s %-14s %12s  %s\n", w, "name", "kind", "group",
                  "dtype", "shape", "bytes", "file@offset checksum");
    for (const TensorEntry& t : tensors) {
      absl::FPrintF(out, "  %-*s %-10s %-12s %-5s %-14s %12d  %s@%d %s\n", w, t.name, t.kind,
                    t.group, ToAbsl(DTypeName(t.dtype)), Shape(t.shape), t.bytes, t.file,
                    t.file_offset, FormatChecksum(t.checksum));
    }
  }

  if (root) PrintLeftovers(path, out, err);

  if (!absl::GetFlag(FLAGS_ferry_inspect_verify)) return 0;

  // --verify: every tensor through one buffer (as large as the largest tensor), with progress.
  const bool show = progress_mode == "on" ||
                    (progress_mode == "auto" && isatty(fileno(err)) != 0 &&
                     total_bytes >= kProgressAutoBytes);
  Progress progress(err, show, total_bytes, tensors.size());
  size_t largest = 0;
  for (const TensorEntry& t : tensors) largest = std::max(largest, t.bytes);
  std::vector<char> buffer(largest);
  int64_t done_bytes = 0;
  std::vector<std::string> failed;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorEntry& t = tensors[i];
    absl::Status s = reader.ReadTensor(t.name, buffer.data(), t.bytes);
    if (!s.ok()) {
      if (show && isatty(fileno(err)) != 0) absl::FPrintF(err, "\n");
      absl::FPrintF(err, "error: %s\n", s.message());
      failed.push_back(t.name);
    }
    done_bytes += static_cast<int64_t>(t.bytes);
    progress.Update(done_bytes, i + 1);
  }
  if (failed.empty()) {
    absl::FPrintF(out, "verify: all %d checksums match (%d bytes read)\n", tensors.size(),
                  total_bytes);
    return 0;
  }
  absl::FPrintF(out, "verify: %d of %d tensors FAILED: %s\n", failed.size(), tensors.size(),
                absl::StrJoin(failed, ", "));
  return 1;
}

}  // namespace ferry::cli
