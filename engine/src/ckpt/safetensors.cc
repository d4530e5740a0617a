#include "ckpt/safetensors.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/absl_compat.h"
#include "ckpt/json_util.h"
#include "ferry/status.h"

namespace ferry {
namespace {

constexpr size_t kLengthPrefixBytes = 8;
constexpr size_t kHeaderAlignment = 8;

// Only the exact safetensors spellings; ParseDType's aliases are not part of the format.
absl::StatusOr<DType> ParseSafetensorsDType(absl::string_view name) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    if (name == ToAbsl(DTypeSafetensorsName(t))) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", name, "' (expected F32, BF16 or F16)"));
}

void PutLittleEndian64(uint64_t v, char* out) {
  for (size_t i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
}

uint64_t GetLittleEndian64(const unsigned char* in) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

}  // namespace

absl::StatusOr<uint64_t> ShapeBytes(DType dtype, absl::Span<const int64_t> shape) {
  uint64_t bytes = DTypeSize(dtype);
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has a negative dimension"));
    }
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " overflows 64-bit byte counts"));
    }
  }
  return bytes;
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<std::string> EncodeSafetensorsHeader(
    const std::map<std::string, std::string>& metadata,
    absl::Span<const SafetensorsEntry> entries) {
  // The top-level object is assembled member by member (ordered_json would search its members
  // linearly on every insertion, quadratic in the number of tensors); each member is dumped by
  // nlohmann, which also escapes names and refuses invalid UTF-8.
  OrderedJson meta = OrderedJson::object();
  for (const auto& [key, value] : metadata) meta[key] = value;
  FERRY_ASSIGN_OR_RETURN(std::string meta_json, DumpJson(meta, -1, "safetensors __metadata__"));
  std::string json = absl::StrCat("{\"", kSafetensorsMetadataKey, "\":", meta_json);
  absl::flat_hash_set<absl::string_view> names;
  uint64_t expected_begin = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.name == kSafetensorsMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name '", kSafetensorsMetadataKey, "' is reserved by safetensors"));
    }
    if (!names.insert(e.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", e.name, "'"));
    }
    FERRY_ASSIGN_OR_RETURN(uint64_t bytes, ShapeBytes(e.dtype, e.shape));
    if (e.begin != expected_begin || e.end < e.begin || e.end - e.begin != bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
                       "] do not continue the layout at ", expected_begin, " with the ", bytes,
                       " bytes of ", ToAbsl(DTypeName(e.dtype)), " ", ShapeString(e.shape)));
    }
    expected_begin = e.end;
    OrderedJson t = OrderedJson::object();
    t["dtype"] = std::string(DTypeSafetensorsName(e.dtype));
    OrderedJson shape = OrderedJson::array();
    for (int64_t d : e.shape) shape.push_back(d);
    t["shape"] = std::move(shape);
    t["data_offsets"] = OrderedJson::array({e.begin, e.end});
    const std::string what = absl::StrCat("safetensors header entry for tensor '", e.name, "'");
    FERRY_ASSIGN_OR_RETURN(std::string key_json, DumpJson(OrderedJson(e.name), -1, what));
    FERRY_ASSIGN_OR_RETURN(std::string value_json, DumpJson(t, -1, what));
    absl::StrAppend(&json, ",", key_json, ":", value_json);
  }
  json += "}";
  const size_t padded = (json.size() + kHeaderAlignment - 1) / kHeaderAlignment * kHeaderAlignment;
  json.resize(padded, ' ');
  std::string out(kLengthPrefixBytes, '\0');
  PutLittleEndian64(padded, out.data());
  out += json;
  return out;
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const ReadOnlyFile& file) {
  const std::string& path = file.path();
  if (file.size() < kLengthPrefixBytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", file.size(), " bytes, too short for a safetensors header"));
  }
  unsigned char prefix[kLengthPrefixBytes];
  FERRY_RETURN_IF_ERROR(file.ReadAt(0, prefix, sizeof(prefix)));
  const uint64_t n = GetLittleEndian64(prefix);
  if (n > kMaxSafetensorsHeaderBytes || n > file.size() - kLengthPrefixBytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": safetensors header length ", n, " does not fit in the file (",
                     file.size(), " bytes) or exceeds the limit of ", kMaxSafetensorsHeaderBytes));
  }
  std::string text(static_cast<size_t>(n), '\0');
  FERRY_RETURN_IF_ERROR(file.ReadAt(kLengthPrefixBytes, text.data(), text.size()));
  return ParseSafetensorsHeaderText(path, file.size(), text);
}

namespace {

// Validates header JSON `text` of a file of `file_size` bytes whose length prefix said text.size().
absl::StatusOr<SafetensorsHeader> ParseHeaderJson(const std::string& path, uint64_t file_size,
                                                  absl::string_view text) {
  const uint64_t n = text.size();
  const std::string what = absl::StrCat(path, ": safetensors header");
  FERRY_ASSIGN_OR_RETURN(Json j, ParseJson(text, what));
  if (!j.is_object()) {
    return absl::DataLossError(
        absl::StrCat(what, " must be a JSON object, found ", DescribeJson(j)));
  }

  SafetensorsHeader header;
  header.data_start = kLengthPrefixBytes + n;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == kSafetensorsMetadataKey) {
      FERRY_ASSIGN_OR_RETURN(header.metadata,
                             JsonToStringMap(it.value(), absl::StrCat(what, " ", it.key())));
      continue;
    }
    const std::string where = absl::StrCat(what, " tensor '", it.key(), "'");
    const Json& t = it.value();
    if (!t.is_object()) {
      return absl::DataLossError(
          absl::StrCat(where, " must be an object, found ", DescribeJson(t)));
    }
    SafetensorsEntry e;
    e.name = it.key();
    FERRY_ASSIGN_OR_RETURN(std::string dtype, GetStringField(t, "dtype", where));
    absl::StatusOr<DType> parsed = ParseSafetensorsDType(dtype);
    if (!parsed.ok()) {
      return absl::DataLossError(absl::StrCat(where, ": ", parsed.status().message()));
    }
    e.dtype = *parsed;
    FERRY_ASSIGN_OR_RETURN(const Json* shape, GetField(t, "shape", where));
    FERRY_ASSIGN_OR_RETURN(e.shape, JsonToShape(*shape, where));
    FERRY_ASSIGN_OR_RETURN(const Json* offsets, GetField(t, "data_offsets", where));
    if (!offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned()) {
      return absl::DataLossError(absl::StrCat(where, ": data_offsets must be [begin, end], found ",
                                              DescribeJson(*offsets)));
    }
    e.begin = (*offsets)[0].get<uint64_t>();
    e.end = (*offsets)[1].get<uint64_t>();
    absl::StatusOr<uint64_t> bytes = ShapeBytes(e.dtype, e.shape);
    if (!bytes.ok()) {
      return absl::DataLossError(absl::StrCat(where, ": ", bytes.status().message()));
    }
    if (e.end < e.begin || e.end - e.begin != *bytes) {
      return absl::DataLossError(absl::StrCat(where, ": data_offsets [", e.begin, ", ", e.end,
                                              "] do not hold the ", *bytes, " bytes of ", dtype,
                                              " ", ShapeString(e.shape)));
    }
    header.entries.push_back(std::move(e));
  }

  // The entries must tile the data section: sorted by offset, no gaps, no overlaps, up to the end.
  std::sort(header.entries.begin(), header.entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t expected = 0;
  for (const SafetensorsEntry& e : header.entries) {
    if (e.begin != expected) {
      return absl::DataLossError(
          absl::StrCat(what, " tensor '", e.name, "': data_offsets begin at ", e.begin,
                       ", expected ", expected, " (tensors must be contiguous, without overlap)"));
    }
    expected = e.end;
  }
  const uint64_t data_bytes = file_size - header.data_start;
  if (expected != data_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": the header describes ", expected,
                                            " bytes of tensor data but the file holds ",
                                            data_bytes));
  }
  return header;
}


}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeaderText(const std::string& path,
                                                             uint64_t file_size,
                                                             absl::string_view text) {
  if (file_size < kLengthPrefixBytes || text.size() > file_size - kLengthPrefixBytes) {
    return absl::DataLossError(absl::StrCat(path, ": a safetensors header of ", text.size(),
                                            " bytes does not fit in a file of ", file_size));
  }
  return ParseHeaderJson(path, file_size, text);
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsFile(absl::string_view bytes,
                                                       const std::string& path) {
  if (bytes.size() < kLengthPrefixBytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", bytes.size(), " bytes, too short for a safetensors header"));
  }
  const uint64_t n = GetLittleEndian64(reinterpret_cast<const unsigned char*>(bytes.data()));
  if (n > kMaxSafetensorsHeaderBytes || n > bytes.size() - kLengthPrefixBytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": safetensors header length ", n, " does not fit in the file (",
                     bytes.size(), " bytes) or exceeds the limit of ", kMaxSafetensorsHeaderBytes));
  }
  return ParseHeaderJson(path, bytes.size(), bytes.substr(kLengthPrefixBytes, n));
}

}  // namespace ferry
