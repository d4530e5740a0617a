#include "ckpt/checkpoint_root.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ckpt/manifest.h"
#include "ckpt/posix_file.h"
#include "ferry/status.h"

namespace ferry {
namespace {

constexpr absl::string_view kStepPrefix = "step-";
constexpr uint64_t kMaxLatestBytes = 4096;
constexpr size_t kMaxStepDigits = 19;  // int64_t; SimpleAtoi refuses overflow

}  // namespace

std::string CheckpointDirName(int64_t step) { return absl::StrFormat("%s%08d", kStepPrefix, step); }

std::string IncompleteDirPath(const std::string& root, int64_t step) {
  return absl::StrCat(JoinPath(root, CheckpointDirName(step)), kCheckpointIncompleteSuffix);
}

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

absl::string_view PathBaseName(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

std::optional<int64_t> ParseStepDirNameWithSuffix(absl::string_view name, absl::string_view suffix) {
  if (suffix.empty() || !absl::ConsumeSuffix(&name, suffix)) return std::nullopt;
  return ParseStepDirName(name);
}

absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> CommittedSteps(const std::string& root) {
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


absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& root) {
  FERRY_ASSIGN_OR_RETURN(auto steps, CommittedSteps(root));
  std::vector<std::string> dirs;
  dirs.reserve(steps.size());
  for (const auto& [step, name] : steps) dirs.push_back(JoinPath(root, name));
  return dirs;
}

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
  const std::string latest_path = JoinPath(path, kCheckpointLatestFileName);
  FERRY_ASSIGN_OR_RETURN(bool has_latest, PathExists(latest_path));
  if (!has_latest) {
    return absl::NotFoundError(absl::StrCat(path, " is neither a checkpoint directory (no ",
                                            kManifestFileName, ") nor a checkpoint root (no ",
                                            kCheckpointLatestFileName, ")"));
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


}  // namespace ferry
