// The names inside a checkpoint root, and finding things in it (checkpoint.h shows the layout):
//   step-<%08d N>             a committed checkpoint (complete: nothing else has this name)
//   step-<N>.incomplete       a save in flight, or the leftover of a crashed one (checkpoint_gc.h)
//   step-<N>.deleting         a checkpoint being deleted for keep_last, or the leftover of a crash
//   latest                    "step-<N>\n": the checkpoint committed last
// Anything else in a root is never read, listed or touched.
#ifndef FERRY_CKPT_CHECKPOINT_ROOT_H_
#define FERRY_CKPT_CHECKPOINT_ROOT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry {

inline constexpr absl::string_view kCheckpointIncompleteSuffix = ".incomplete";
inline constexpr absl::string_view kCheckpointDeletingSuffix = ".deleting";
inline constexpr absl::string_view kCheckpointLatestFileName = "latest";

// "step-00000100": the directory name of checkpoint `step` under its root.
std::string CheckpointDirName(int64_t step);

// <root>/step-<N>.incomplete: where every rank writes its file of checkpoint `step`.
std::string IncompleteDirPath(const std::string& root, int64_t step);

// The step of a committed directory name "step-<digits>" (at most 19 digits); nullopt for
// anything else (including step-<N>.incomplete).
std::optional<int64_t> ParseStepDirName(absl::string_view name);

// The step of "step-<digits><suffix>" for exactly that suffix; nullopt for anything else.
std::optional<int64_t> ParseStepDirNameWithSuffix(absl::string_view name, absl::string_view suffix);

// The last component of `path` (trailing slashes ignored).
absl::string_view PathBaseName(absl::string_view path);

// The committed checkpoints under root as (step, name), ascending by step: entries named
// step-<digits> that are directories. Errors: NotFound if root does not exist; other I/O errors
// with the path.
absl::StatusOr<std::vector<std::pair<int64_t, std::string>>> CommittedSteps(const std::string& root);

// The committed step directories under `root` (full paths), oldest (smallest step) first: entries
// named step-<digits> that are directories. *.incomplete, `latest` and anything else are ignored.
// Errors: NotFound if root does not exist; other I/O errors with the path.
absl::StatusOr<std::vector<std::string>> ListCheckpoints(const std::string& root);

// `path` itself if it holds manifest.json, else the directory its `latest` names. NotFound,
// FailedPrecondition (not a directory) or DataLoss (a `latest` that names no directory of the
// root), each naming the path.
absl::StatusOr<std::string> ResolveCheckpointDir(const std::string& path);

}  // namespace ferry

#endif  // FERRY_CKPT_CHECKPOINT_ROOT_H_
