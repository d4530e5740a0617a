// manifest.json: what a checkpoint directory holds. Version 1:
//
//   {"format": "ferry-checkpoint", "format_version": 1, "step": N, "world_size": W,
//    "metadata": {str: str}, "skipped": [{"what": str, "reason": str}],
//    "tensors": [{"name", "kind", "group", "dtype", "shape", "bytes",
//                 "chunks": [{"rank", "file", "global_offset", "length", "file_offset",
//                             "checksum": "xxh3:<16 hex digits>"}]}]}
//
// A tensor's chunks tile its bytes [0, bytes) in global_offset order; each chunk lives in one
// rank's safetensors file at file_offset (absolute). Serialized and parsed field by field. All
// functions are pure and thread-safe.
#ifndef FERRY_CKPT_MANIFEST_H_
#define FERRY_CKPT_MANIFEST_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ferry/dtype.h"

namespace ferry {

inline constexpr absl::string_view kManifestFormat = "ferry-checkpoint";
inline constexpr int64_t kManifestFormatVersion = 1;
inline constexpr absl::string_view kManifestFileName = "manifest.json";

// Something a checkpoint deliberately does not contain, and why (e.g. {"optimizer", "policy
// skip_optimizer_on_save"}).
struct SkipRecord {
  std::string what;
  std::string reason;
};

struct ManifestChunk {
  int64_t rank = 0;
  std::string file;            // a plain file name inside the checkpoint directory
  uint64_t global_offset = 0;  // byte offset of this chunk inside the whole tensor
  uint64_t length = 0;         // bytes
  uint64_t file_offset = 0;    // absolute byte offset inside `file`
  uint64_t checksum = 0;       // XXH3-64 of the chunk's bytes
};

struct ManifestTensor {
  std::string name;
  std::string kind;   // "model", "master", "exp_avg", "exp_avg_sq", ...
  std::string group;  // may be empty
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // the global shape; [] is a scalar
  uint64_t bytes = 0;
  std::vector<ManifestChunk> chunks;
};

struct Manifest {
  int64_t step = 0;
  int64_t world_size = 1;
  std::map<std::string, std::string> metadata;
  std::vector<SkipRecord> skipped;
  std::vector<ManifestTensor> tensors;
};

// "xxh3:" followed by 16 lowercase hex digits.
std::string FormatChecksum(uint64_t checksum);
// Inverse of FormatChecksum (hex digits in either case). InvalidArgument otherwise.
absl::StatusOr<uint64_t> ParseChecksum(absl::string_view text);

// The manifest as indented JSON followed by a newline. InvalidArgument if a string is not valid
// UTF-8.
absl::StatusOr<std::string> SerializeManifest(const Manifest& manifest);

// Parses and validates a manifest; `where` (usually its path) names it in messages. Checks the
// format name and version (FailedPrecondition for another format or version), every required field
// and its type, unique tensor names, bytes == shape x dtype size, chunks that tile [0, bytes) with
// ranks in [0, world_size) and plain file names (DataLoss naming the tensor and field otherwise).
absl::StatusOr<Manifest> ParseManifest(absl::string_view text, absl::string_view where);

}  // namespace ferry

#endif  // FERRY_CKPT_MANIFEST_H_
