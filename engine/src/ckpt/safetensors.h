// The safetensors container, as the standard Python `safetensors` library reads it:
//
//   [8 bytes: N, little-endian u64] [N bytes: JSON header, padded with spaces to a multiple of 8]
//   [data section: the tensors' bytes, contiguous, no gaps]
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the data section) and "__metadata__" to an object of strings. All functions are pure
// (or read only the given file) and thread-safe.
#ifndef FERRY_CKPT_SAFETENSORS_H_
#define FERRY_CKPT_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "ckpt/posix_file.h"
#include "ferry/dtype.h"

namespace ferry {

inline constexpr absl::string_view kSafetensorsMetadataKey = "__metadata__";
// The largest header either side accepts (the Python library's own limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsEntry> entries;  // ordered by begin offset
  uint64_t data_start = 0;                // absolute file offset of the data section
};

// Bytes of a tensor of `dtype` and `shape` (1 element for the scalar shape []). InvalidArgument for
// a negative dimension or a size that overflows 64 bits.
absl::StatusOr<uint64_t> ShapeBytes(DType dtype, absl::Span<const int64_t> shape);
// "[2, 3]"; "[]" for a scalar.
std::string ShapeString(absl::Span<const int64_t> shape);

// The bytes that start a safetensors file: the 8-byte length and the padded JSON header, serialized
// field by field. The entries are written in the given order and must be laid out contiguously from
// offset 0 with end - begin matching dtype and shape (InvalidArgument otherwise, or for names and
// metadata that are not valid UTF-8, or a tensor named "__metadata__").
absl::StatusOr<std::string> EncodeSafetensorsHeader(
    const std::map<std::string, std::string>& metadata, absl::Span<const SafetensorsEntry> entries);

// Reads and validates the header of `file`: the length fits in the file and the limit, the JSON
// parses, every entry has a supported dtype (F32, BF16, F16), a shape and offsets that match it,
// and the entries tile the data section exactly to the end of the file. Errors are DataLoss and
// name the file (and the tensor or field at fault).
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const ReadOnlyFile& file);

// The same checks on the header JSON `text` of a file of `file_size` bytes (`path` names it).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeaderText(const std::string& path,
                                                             uint64_t file_size,
                                                             absl::string_view text);

// The same checks on a whole file image in memory (for tools and the fuzz target).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsFile(absl::string_view bytes,
                                                       const std::string& path);

}  // namespace ferry

#endif  // FERRY_CKPT_SAFETENSORS_H_
