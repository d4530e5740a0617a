#include "ferry/dtype.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace ferry {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "invalid";
}

std::string_view DTypeSafetensorsName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
  }
  return "invalid";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  // Debian's Abseil (20220623) has its own absl::string_view, not an alias of std::string_view, so
  // std::string_view arguments are converted explicitly.
  std::string n = absl::AsciiStrToLower(absl::string_view(name.data(), name.size()));
  if (n == "f32" || n == "float32" || n == "fp32") return DType::kF32;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  if (n == "f16" || n == "float16" || n == "fp16" || n == "half") return DType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", absl::string_view(name.data(), name.size()),
                   "' (expected f32, bf16 or f16)"));
}

}  // namespace ferry
