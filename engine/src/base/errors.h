// System errors become a Status in one place each.
#ifndef FERRY_BASE_ERRORS_H_
#define FERRY_BASE_ERRORS_H_

#include <string_view>

#include "absl/status/status.h"

namespace ferry {

// A Status for a failed POSIX call: "<context>: <strerror(err)>", with a code chosen from errno
// (ENOENT -> NotFound, EACCES/EPERM -> PermissionDenied, ENOSPC/ENOMEM -> ResourceExhausted, ...).
absl::Status PosixError(std::string_view context, int err);

}  // namespace ferry

#endif  // FERRY_BASE_ERRORS_H_
