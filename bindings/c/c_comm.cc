#include "c/c_comm.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

constexpr size_t kErrLen = 1024;

// The Status of a C callback's result: OK for 0; else the code (a ferry_status / absl::StatusCode
// value, anything else Unknown) with the message the callback wrote (or a note that it wrote none).
absl::Status FromC(const char* fn, int rc, const char* err) {
  if (rc == 0) return absl::OkStatus();
  absl::StatusCode code = absl::StatusCode::kUnknown;
  if (rc > 0 && rc <= static_cast<int>(absl::StatusCode::kUnauthenticated)) code = static_cast<absl::StatusCode>(rc);
  std::string msg = err[0] != '\0' ? std::string(err) : absl::StrCat("(", fn, " wrote no message)");
  return absl::Status(code, absl::StrCat(msg, " [", fn, " returned ", rc, "]"));
}

// Calls `fn` with a fresh error buffer appended to `args` and converts the result.
template <typename Fn, typename... Args>
absl::Status CallC(const char* name, Fn fn, Args... args) {
  char err[kErrLen] = {};
  int rc = fn(args..., err, kErrLen);
  err[kErrLen - 1] = '\0';
  return FromC(name, rc, err);
}

CommCallbacks ToCallbacks(const ferry_comm_callbacks& c) {
  CommCallbacks cb;
  cb.rank = c.rank;
  cb.world_size = c.world_size;
  if (c.all_reduce != nullptr) {
    cb.all_reduce = [c](double* values, size_t n, ReduceOp op, double timeout_s) {
      int c_op = op == ReduceOp::kSum ? FERRY_REDUCE_SUM : op == ReduceOp::kMax ? FERRY_REDUCE_MAX : FERRY_REDUCE_MIN;
      return CallC("all_reduce", c.all_reduce, c.user, values, n, c_op, timeout_s);
    };
  }
  if (c.all_gather != nullptr) {
    cb.all_gather = [c](const void* mine, size_t bytes, void* out, double timeout_s) {
      return CallC("all_gather", c.all_gather, c.user, mine, bytes, out, timeout_s);
    };
  }
  if (c.barrier != nullptr) {
    cb.barrier = [c](double timeout_s) { return CallC("barrier", c.barrier, c.user, timeout_s); };
  }
  if (c.broadcast != nullptr) {
    cb.broadcast = [c](void* data, size_t bytes, int root, double timeout_s) {
      return CallC("broadcast", c.broadcast, c.user, data, bytes, root, timeout_s);
    };
  }
  if (c.duplicate != nullptr) {
    cb.duplicate = [c](double timeout_s) -> absl::StatusOr<CommCallbacks> {
      ferry_comm_callbacks out = {};
      absl::Status s = CallC("duplicate", c.duplicate, c.user, timeout_s, &out);
      if (!s.ok()) return s;
      if (out.all_reduce == nullptr || out.all_gather == nullptr) {
        return absl::InvalidArgumentError("duplicate filled callbacks without all_reduce or all_gather");
      }
      return ToCallbacks(out);
    };
  }
  return cb;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Comm>> CommFromCallbacks(const ferry_comm_callbacks& c) {
  return MakeCallbackComm(ToCallbacks(c));
}

}  // namespace ferry
