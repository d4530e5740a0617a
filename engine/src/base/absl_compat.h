// Debian's Abseil (20220623) has its own absl::string_view, not an alias of std::string_view, and
// absl::StrCat and friends take only the former. Layers use absl::string_view internally
// and converts at the edges (public API, ferry/dtype.h) with ToAbsl.
#ifndef FERRY_BASE_ABSL_COMPAT_H_
#define FERRY_BASE_ABSL_COMPAT_H_

#include <string_view>

#include "absl/strings/string_view.h"

namespace ferry {

inline absl::string_view ToAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

}  // namespace ferry

#endif  // FERRY_BASE_ABSL_COMPAT_H_
