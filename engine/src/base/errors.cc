#include "base/errors.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/cord.h"
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

absl::Status UnsharedCopy(const absl::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status copy(status.code(), std::string(status.message()));
  status.ForEachPayload([&copy](absl::string_view type_url, const absl::Cord& payload) {
    copy.SetPayload(type_url, absl::Cord(std::string(payload)));
  });
  return copy;
}

}  // namespace ferry
