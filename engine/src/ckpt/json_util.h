// nlohmann::json without exceptions: parsing, dumping and typed field access that return Status.
// Internal to the ckpt layer (the ckpt library links nlohmann_json privately). All functions are
// pure and thread-safe.
#ifndef FERRY_CKPT_JSON_UTIL_H_
#define FERRY_CKPT_JSON_UTIL_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace ferry {

using Json = nlohmann::json;                 // parsed documents (keys sorted)
using OrderedJson = nlohmann::ordered_json;  // documents we write (keys in insertion order)

// Serializes `j` (indent < 0: compact). Invalid UTF-8 in a string is an InvalidArgument error that
// names `what`.
absl::StatusOr<std::string> DumpJson(const OrderedJson& j, int indent, absl::string_view what);

// Parses `text`; a syntax error is a DataLoss error naming `what` and the parser's position.
absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view what);

// Typed access to a member of object `obj`. `where` names the object in messages (e.g.
// "manifest.json tensors[2]"); a missing member or a wrong type is a DataLoss error saying which
// field, what was expected and what was found.
// REQUIRES: obj.is_object().
absl::StatusOr<const Json*> GetField(const Json& obj, absl::string_view key,
                                     absl::string_view where);
absl::StatusOr<std::string> GetStringField(const Json& obj, absl::string_view key,
                                           absl::string_view where);
absl::StatusOr<uint64_t> GetUintField(const Json& obj, absl::string_view key,
                                      absl::string_view where);
absl::StatusOr<int64_t> GetIntField(const Json& obj, absl::string_view key,
                                    absl::string_view where);

// `j` as a shape: an array of non-negative integers. DataLoss naming `where` otherwise.
absl::StatusOr<std::vector<int64_t>> JsonToShape(const Json& j, absl::string_view where);
// `j` as an object whose values are all strings. DataLoss naming `where` otherwise.
absl::StatusOr<std::map<std::string, std::string>> JsonToStringMap(const Json& j,
                                                                   absl::string_view where);

// A short description of `j`'s type and value for messages, e.g. "string \"F64\"" or "number -3".
std::string DescribeJson(const Json& j);

}  // namespace ferry

#endif  // FERRY_CKPT_JSON_UTIL_H_
