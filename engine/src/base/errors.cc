#include "base/errors.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry {

absl::Status PosixError(std::string_view context, int err) {
  std::string msg = absl::StrCat(context, ": ", std::strerror(err), " (errno ", err, ")");
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
