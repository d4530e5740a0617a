#include "memory/format.h"

#include "absl/strings/str_format.h"

namespace ferry::memory_internal {

std::string FormatBytes(size_t bytes) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  constexpr double kMiB = 1024.0 * 1024.0;
  if (bytes >= (size_t{1} << 30)) return absl::StrFormat("%u bytes (%.2f GiB)", bytes, bytes / kGiB);
  if (bytes >= (size_t{1} << 20)) return absl::StrFormat("%u bytes (%.2f MiB)", bytes, bytes / kMiB);
  return absl::StrFormat("%u bytes", bytes);
}

}  // namespace ferry::memory_internal
