// System errors become a Status in one place each; a Status copied for another thread.
#ifndef FERRY_BASE_ERRORS_H_
#define FERRY_BASE_ERRORS_H_

#include <string_view>

#include "absl/status/status.h"

namespace ferry {

// A Status for a failed POSIX call: "<context>: <strerror(err)>", with a code chosen from errno
// (ENOENT -> NotFound, EACCES/EPERM -> PermissionDenied, ENOSPC/ENOMEM -> ResourceExhausted, ...).
absl::Status PosixError(std::string_view context, int err);

// A copy of `status` that shares nothing with it (message and payloads copied), for handing an error
// kept under a lock to another thread. A plain copy shares a reference count that lives in Debian's
// Abseil, which ThreadSanitizer does not see, so two threads dropping their copies read to it as a
// race on the freed message. Safe either way; this keeps TSan's reports for real races.
absl::Status UnsharedCopy(const absl::Status& status);

}  // namespace ferry

#endif  // FERRY_BASE_ERRORS_H_
