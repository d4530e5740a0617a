#include "ckpt/json_util.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "ferry/status.h"

namespace ferry {
namespace {

constexpr size_t kMaxDescribedChars = 60;

absl::Status WrongType(absl::string_view where, absl::string_view key, absl::string_view expected,
                       const Json& found) {
  return absl::DataLossError(absl::StrCat(where, ": field '", key, "' must be ", expected,
                                          ", found ", DescribeJson(found)));
}

}  // namespace

std::string DescribeJson(const Json& j) {
  // dump() cannot throw here: parsed documents hold valid UTF-8 only.
  std::string text = j.dump();
  if (text.size() > kMaxDescribedChars) {
    text = absl::StrCat(text.substr(0, kMaxDescribedChars), "...");
  }
  return absl::StrCat(j.type_name(), " ", text);
}

absl::StatusOr<std::string> DumpJson(const OrderedJson& j, int indent, absl::string_view what) {
  try {
    return j.dump(indent);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": cannot be written as JSON (strings must be valid UTF-8): ", e.what()));
  }
}

absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view what) {
  // nlohmann stops at a NUL byte as if the input ended there, so "{...}\0garbage" would parse.
  // Valid JSON never holds a raw NUL (inside strings it must be escaped): refuse it.
  if (size_t nul = text.find('\0'); nul != absl::string_view::npos) {
    return absl::DataLossError(absl::StrCat(what, " is not valid JSON: NUL byte at offset ", nul));
  }
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(what, " is not valid JSON: ", e.what()));
  }
}

absl::StatusOr<const Json*> GetField(const Json& obj, absl::string_view key,
                                     absl::string_view where) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    return absl::DataLossError(absl::StrCat(where, ": required field '", key, "' is missing"));
  }
  return &*it;
}

absl::StatusOr<std::string> GetStringField(const Json& obj, absl::string_view key,
                                           absl::string_view where) {
  FERRY_ASSIGN_OR_RETURN(const Json* v, GetField(obj, key, where));
  if (!v->is_string()) return WrongType(where, key, "a string", *v);
  return v->get_ref<const std::string&>();
}

absl::StatusOr<uint64_t> GetUintField(const Json& obj, absl::string_view key,
                                      absl::string_view where) {
  FERRY_ASSIGN_OR_RETURN(const Json* v, GetField(obj, key, where));
  if (!v->is_number_unsigned()) return WrongType(where, key, "a non-negative integer", *v);
  return v->get<uint64_t>();
}

absl::StatusOr<int64_t> GetIntField(const Json& obj, absl::string_view key,
                                    absl::string_view where) {
  FERRY_ASSIGN_OR_RETURN(const Json* v, GetField(obj, key, where));
  if (v->is_number_unsigned()) {
    uint64_t u = v->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return WrongType(where, key, "a 64-bit signed integer", *v);
    }
    return static_cast<int64_t>(u);
  }
  if (!v->is_number_integer()) return WrongType(where, key, "an integer", *v);
  return v->get<int64_t>();
}

absl::StatusOr<std::vector<int64_t>> JsonToShape(const Json& j, absl::string_view where) {
  if (!j.is_array()) {
    return absl::DataLossError(absl::StrCat(where,
                                            ": shape must be an array of non-negative "
                                            "integers, found ",
                                            DescribeJson(j)));
  }
  std::vector<int64_t> shape;
  shape.reserve(j.size());
  for (const Json& d : j) {
    if (!d.is_number_unsigned() ||
        d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::DataLossError(absl::StrCat(where,
                                              ": shape must be an array of non-negative "
                                              "integers, found ",
                                              DescribeJson(j)));
    }
    shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  return shape;
}

absl::StatusOr<std::map<std::string, std::string>> JsonToStringMap(const Json& j,
                                                                   absl::string_view where) {
  if (!j.is_object()) {
    return absl::DataLossError(
        absl::StrCat(where, " must be an object of strings, found ", DescribeJson(j)));
  }
  std::map<std::string, std::string> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it.value().is_string()) {
      return absl::DataLossError(absl::StrCat(
          where, ": value of '", it.key(), "' must be a string, found ", DescribeJson(it.value())));
    }
    out.emplace(it.key(), it.value().get_ref<const std::string&>());
  }
  return out;
}

}  // namespace ferry
