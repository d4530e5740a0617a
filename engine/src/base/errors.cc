#include "base/errors.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry {

absl::Status PosixError(std::string_view context, int err) {
  // absl::string_view is not std::string_view in Debian's Abseil: convert explicitly.
  std::string msg = absl::StrCat(absl::string_view(context.data(), context.size()), ": ",
                                 std::strerror(err), " (errno ", err, ")");
  switch (err) {
    case ENOENT: return absl::NotFoundError(msg);
    case EEXIST: return absl::AlreadyExistsError(msg);
    case EACCES:
    case EPERM: return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case ENOMEM:
    case EDQUOT: return absl::ResourceExhaustedError(msg);
    case EINVAL: return absl::InvalidArgumentError(msg);
    default: return absl::InternalError(msg);
  }
}

}  // namespace ferry
