#include "ckpt/manifest.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/absl_compat.h"
#include "ckpt/json_util.h"
#include "ckpt/safetensors.h"
#include "ferry/status.h"

namespace ferry {
namespace {

constexpr absl::string_view kChecksumPrefix = "xxh3:";
constexpr size_t kChecksumHexDigits = 16;
constexpr int kManifestIndent = 2;

bool IsPlainFileName(absl::string_view name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == absl::string_view::npos && name.find('\0') == absl::string_view::npos;
}

absl::StatusOr<ManifestChunk> ParseChunk(const Json& j, int64_t world_size,
                                         absl::string_view where) {
  if (!j.is_object()) {
    return absl::DataLossError(absl::StrCat(where, " must be an object, found ", DescribeJson(j)));
  }
  ManifestChunk c;
  FERRY_ASSIGN_OR_RETURN(c.rank, GetIntField(j, "rank", where));
  if (c.rank < 0 || c.rank >= world_size) {
    return absl::DataLossError(
        absl::StrCat(where, ": rank ", c.rank, " is outside [0, world_size ", world_size, ")"));
  }
  FERRY_ASSIGN_OR_RETURN(c.file, GetStringField(j, "file", where));
  if (!IsPlainFileName(c.file)) {
    return absl::DataLossError(absl::StrCat(
        where, ": file '", c.file, "' must be a plain file name in the checkpoint directory"));
  }
  FERRY_ASSIGN_OR_RETURN(c.global_offset, GetUintField(j, "global_offset", where));
  FERRY_ASSIGN_OR_RETURN(c.length, GetUintField(j, "length", where));
  FERRY_ASSIGN_OR_RETURN(c.file_offset, GetUintField(j, "file_offset", where));
  if (c.file_offset + c.length < c.file_offset) {
    return absl::DataLossError(absl::StrCat(where, ": file_offset + length overflows"));
  }
  FERRY_ASSIGN_OR_RETURN(std::string checksum, GetStringField(j, "checksum", where));
  absl::StatusOr<uint64_t> parsed = ParseChecksum(checksum);
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat(where, ": ", parsed.status().message()));
  }
  c.checksum = *parsed;
  return c;
}

absl::StatusOr<ManifestTensor> ParseTensor(const Json& j, int64_t world_size,
                                           absl::string_view where) {
  if (!j.is_object()) {
    return absl::DataLossError(absl::StrCat(where, " must be an object, found ", DescribeJson(j)));
  }
  ManifestTensor t;
  FERRY_ASSIGN_OR_RETURN(t.name, GetStringField(j, "name", where));
  if (t.name.empty()) return absl::DataLossError(absl::StrCat(where, ": empty tensor name"));
  const std::string at = absl::StrCat(where, " ('", t.name, "')");
  FERRY_ASSIGN_OR_RETURN(t.kind, GetStringField(j, "kind", at));
  FERRY_ASSIGN_OR_RETURN(t.group, GetStringField(j, "group", at));
  FERRY_ASSIGN_OR_RETURN(std::string dtype, GetStringField(j, "dtype", at));
  absl::StatusOr<DType> parsed = ParseDType(dtype);
  if (!parsed.ok()) return absl::DataLossError(absl::StrCat(at, ": ", parsed.status().message()));
  t.dtype = *parsed;
  FERRY_ASSIGN_OR_RETURN(const Json* shape, GetField(j, "shape", at));
  FERRY_ASSIGN_OR_RETURN(t.shape, JsonToShape(*shape, at));
  FERRY_ASSIGN_OR_RETURN(t.bytes, GetUintField(j, "bytes", at));
  absl::StatusOr<uint64_t> expected = ShapeBytes(t.dtype, t.shape);
  if (!expected.ok()) {
    return absl::DataLossError(absl::StrCat(at, ": ", expected.status().message()));
  }
  if (*expected != t.bytes) {
    return absl::DataLossError(absl::StrCat(at, ": bytes is ", t.bytes, " but ", dtype, " ",
                                            ShapeString(t.shape), " needs ", *expected));
  }
  FERRY_ASSIGN_OR_RETURN(const Json* chunks, GetField(j, "chunks", at));
  if (!chunks->is_array() || chunks->empty()) {
    return absl::DataLossError(
        absl::StrCat(at, ": chunks must be a non-empty array, found ", DescribeJson(*chunks)));
  }
  uint64_t covered = 0;
  for (size_t i = 0; i < chunks->size(); ++i) {
    const std::string cwhere = absl::StrCat(at, " chunks[", i, "]");
    FERRY_ASSIGN_OR_RETURN(ManifestChunk c, ParseChunk((*chunks)[i], world_size, cwhere));
    if (c.global_offset != covered) {
      return absl::DataLossError(absl::StrCat(cwhere, ": global_offset ", c.global_offset,
                                              ", expected ", covered,
                                              " (chunks must tile the tensor)"));
    }
    covered += c.length;
    if (covered < c.length || covered > t.bytes) {
      return absl::DataLossError(
          absl::StrCat(cwhere, ": chunk ends past the tensor's ", t.bytes, " bytes"));
    }
    t.chunks.push_back(std::move(c));
  }
  if (covered != t.bytes) {
    return absl::DataLossError(
        absl::StrCat(at, ": chunks cover ", covered, " of the tensor's ", t.bytes, " bytes"));
  }
  return t;
}

}  // namespace

std::string FormatChecksum(uint64_t checksum) {
  return absl::StrFormat("%s%016x", kChecksumPrefix, checksum);
}

absl::StatusOr<uint64_t> ParseChecksum(absl::string_view text) {
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("checksum '", text, "' is not of the form xxh3:<16 hex digits>"));
  };
  if (text.size() != kChecksumPrefix.size() + kChecksumHexDigits ||
      text.substr(0, kChecksumPrefix.size()) != kChecksumPrefix) {
    return bad();
  }
  uint64_t v = 0;
  for (char c : text.substr(kChecksumPrefix.size())) {
    uint64_t digit;
    if (c >= '0' && c <= '9') {
      digit = static_cast<uint64_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      digit = static_cast<uint64_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      digit = static_cast<uint64_t>(c - 'A' + 10);
    } else {
      return bad();
    }
    v = (v << 4) | digit;
  }
  return v;
}

absl::StatusOr<std::string> SerializeManifest(const Manifest& manifest) {
  OrderedJson j = OrderedJson::object();
  j["format"] = std::string(kManifestFormat);
  j["format_version"] = kManifestFormatVersion;
  j["step"] = manifest.step;
  j["world_size"] = manifest.world_size;
  OrderedJson metadata = OrderedJson::object();
  for (const auto& [key, value] : manifest.metadata) metadata[key] = value;
  j["metadata"] = std::move(metadata);
  OrderedJson skipped = OrderedJson::array();
  for (const SkipRecord& s : manifest.skipped) {
    OrderedJson r = OrderedJson::object();
    r["what"] = s.what;
    r["reason"] = s.reason;
    skipped.push_back(std::move(r));
  }
  j["skipped"] = std::move(skipped);
  OrderedJson tensors = OrderedJson::array();
  for (const ManifestTensor& t : manifest.tensors) {
    OrderedJson r = OrderedJson::object();
    r["name"] = t.name;
    r["kind"] = t.kind;
    r["group"] = t.group;
    r["dtype"] = std::string(DTypeSafetensorsName(t.dtype));
    OrderedJson shape = OrderedJson::array();
    for (int64_t d : t.shape) shape.push_back(d);
    r["shape"] = std::move(shape);
    r["bytes"] = t.bytes;
    OrderedJson chunks = OrderedJson::array();
    for (const ManifestChunk& c : t.chunks) {
      OrderedJson cj = OrderedJson::object();
      cj["rank"] = c.rank;
      cj["file"] = c.file;
      cj["global_offset"] = c.global_offset;
      cj["length"] = c.length;
      cj["file_offset"] = c.file_offset;
      cj["checksum"] = FormatChecksum(c.checksum);
      chunks.push_back(std::move(cj));
    }
    r["chunks"] = std::move(chunks);
    tensors.push_back(std::move(r));
  }
  j["tensors"] = std::move(tensors);
  FERRY_ASSIGN_OR_RETURN(std::string text, DumpJson(j, kManifestIndent, kManifestFileName));
  text += '\n';
  return text;
}

absl::StatusOr<Manifest> ParseManifest(absl::string_view text, absl::string_view where) {
  FERRY_ASSIGN_OR_RETURN(Json j, ParseJson(text, where));
  if (!j.is_object()) {
    return absl::DataLossError(
        absl::StrCat(where, " must be a JSON object, found ", DescribeJson(j)));
  }
  FERRY_ASSIGN_OR_RETURN(std::string format, GetStringField(j, "format", where));
  if (format != kManifestFormat) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": format is '", format, "', expected '", kManifestFormat, "'"));
  }
  FERRY_ASSIGN_OR_RETURN(int64_t version, GetIntField(j, "format_version", where));
  if (version != kManifestFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": format_version ", version,
                     " is not supported (this build reads version ", kManifestFormatVersion, ")"));
  }
  Manifest m;
  FERRY_ASSIGN_OR_RETURN(m.step, GetIntField(j, "step", where));
  if (m.step < 0) return absl::DataLossError(absl::StrCat(where, ": negative step ", m.step));
  FERRY_ASSIGN_OR_RETURN(m.world_size, GetIntField(j, "world_size", where));
  if (m.world_size < 1) {
    return absl::DataLossError(absl::StrCat(where, ": world_size ", m.world_size, " must be >= 1"));
  }
  FERRY_ASSIGN_OR_RETURN(const Json* metadata, GetField(j, "metadata", where));
  FERRY_ASSIGN_OR_RETURN(m.metadata, JsonToStringMap(*metadata, absl::StrCat(where, " metadata")));

  FERRY_ASSIGN_OR_RETURN(const Json* skipped, GetField(j, "skipped", where));
  if (!skipped->is_array()) {
    return absl::DataLossError(
        absl::StrCat(where, ": skipped must be an array, found ", DescribeJson(*skipped)));
  }
  for (size_t i = 0; i < skipped->size(); ++i) {
    const std::string swhere = absl::StrCat(where, " skipped[", i, "]");
    const Json& s = (*skipped)[i];
    if (!s.is_object()) {
      return absl::DataLossError(
          absl::StrCat(swhere, " must be an object, found ", DescribeJson(s)));
    }
    SkipRecord r;
    FERRY_ASSIGN_OR_RETURN(r.what, GetStringField(s, "what", swhere));
    FERRY_ASSIGN_OR_RETURN(r.reason, GetStringField(s, "reason", swhere));
    m.skipped.push_back(std::move(r));
  }

  FERRY_ASSIGN_OR_RETURN(const Json* tensors, GetField(j, "tensors", where));
  if (!tensors->is_array()) {
    return absl::DataLossError(
        absl::StrCat(where, ": tensors must be an array, found ", DescribeJson(*tensors)));
  }
  absl::flat_hash_set<std::string> names;
  m.tensors.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    FERRY_ASSIGN_OR_RETURN(ManifestTensor t, ParseTensor((*tensors)[i], m.world_size,
                                                         absl::StrCat(where, " tensors[", i, "]")));
    if (!names.insert(t.name).second) {
      return absl::DataLossError(
          absl::StrCat(where, ": tensor name '", t.name, "' appears more than once"));
    }
    m.tensors.push_back(std::move(t));
  }
  return m;
}

}  // namespace ferry
