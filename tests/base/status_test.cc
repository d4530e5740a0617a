// Tests of ferry/status.h (FERRY_RETURN_IF_ERROR, FERRY_ASSIGN_OR_RETURN) and base/errors.h
// (PosixError, UnsharedCopy).
#include "ferry/status.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "base/errors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// ---- FERRY_RETURN_IF_ERROR ------------------------------------------------------------------------

absl::Status FailWith(absl::StatusCode code, int* calls) {
  ++*calls;
  return code == absl::StatusCode::kOk ? absl::OkStatus() : absl::Status(code, "inner failure 42");
}

// Runs two checks; records how far it got.
absl::Status TwoChecks(absl::StatusCode first, absl::StatusCode second, int* calls, int* reached) {
  FERRY_RETURN_IF_ERROR(FailWith(first, calls));
  *reached = 1;
  FERRY_RETURN_IF_ERROR(FailWith(second, calls));
  *reached = 2;
  return absl::OkStatus();
}

TEST(ReturnIfError, OkContinues) {
  int calls = 0, reached = 0;
  EXPECT_TRUE(TwoChecks(absl::StatusCode::kOk, absl::StatusCode::kOk, &calls, &reached).ok());
  EXPECT_EQ(calls, 2);  // each expression evaluated exactly once
  EXPECT_EQ(reached, 2);
}

TEST(ReturnIfError, ErrorReturnsItUnchanged) {
  int calls = 0, reached = 0;
  absl::Status s = TwoChecks(absl::StatusCode::kNotFound, absl::StatusCode::kOk, &calls, &reached);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Message(s), "inner failure 42");
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(reached, 0);

  calls = reached = 0;
  s = TwoChecks(absl::StatusCode::kOk, absl::StatusCode::kDataLoss, &calls, &reached);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(reached, 1);
}

// In a function returning StatusOr<T>, the error becomes the StatusOr's status.
absl::StatusOr<int> ValueAfterCheck(absl::StatusCode code) {
  int calls = 0;
  FERRY_RETURN_IF_ERROR(FailWith(code, &calls));
  return 7;
}

TEST(ReturnIfError, WorksInStatusOrFunctions) {
  EXPECT_EQ(ValueAfterCheck(absl::StatusCode::kOk).value_or(0), 7);
  absl::StatusOr<int> r = ValueAfterCheck(absl::StatusCode::kUnavailable);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Message(r.status()), "inner failure 42");
}

// ---- FERRY_ASSIGN_OR_RETURN -----------------------------------------------------------------------

absl::StatusOr<int> MaybeInt(bool ok, int value) {
  if (!ok) return absl::InvalidArgumentError("no int for you");
  return value;
}

// Two assignments in one function (distinct temporaries), a declaration and an existing variable.
absl::StatusOr<int> Sum(bool ok_a, bool ok_b, int* existing) {
  FERRY_ASSIGN_OR_RETURN(int a, MaybeInt(ok_a, 40));
  FERRY_ASSIGN_OR_RETURN(*existing, MaybeInt(ok_b, 2));
  return a + *existing;
}

TEST(AssignOrReturn, PropagatesValuesAndErrors) {
  int existing = -1;
  EXPECT_EQ(Sum(true, true, &existing).value_or(0), 42);
  EXPECT_EQ(existing, 2);

  existing = -1;
  absl::StatusOr<int> r = Sum(false, true, &existing);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Message(r.status()), "no int for you");
  EXPECT_EQ(existing, -1);  // not reached

  r = Sum(true, false, &existing);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(existing, -1);  // left as it was on error
}

struct Base {
  virtual ~Base() = default;
  virtual int Get() const = 0;
};
struct Derived final : Base {
  explicit Derived(int v) : v_(v) {}
  int Get() const override { return v_; }
  int v_;
};

absl::StatusOr<std::unique_ptr<Derived>> MakeDerived(bool ok, int v) {
  if (!ok) return absl::ResourceExhaustedError("no memory for Derived");
  return std::make_unique<Derived>(v);
}

// Move-only values, and a conversion from unique_ptr<Derived> to unique_ptr<Base>.
absl::StatusOr<std::unique_ptr<Base>> Wrap(bool ok, int v) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Base> b, MakeDerived(ok, v));
  return b;
}

absl::StatusOr<int> Unwrap(bool ok, int v) {
  FERRY_ASSIGN_OR_RETURN(auto p, MakeDerived(ok, v));
  static_assert(std::is_same_v<decltype(p), std::unique_ptr<Derived>>);
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Base> q, Wrap(ok, v + 1));
  return p->Get() * 100 + q->Get();
}

TEST(AssignOrReturn, MoveOnlyValues) {
  absl::StatusOr<std::unique_ptr<Base>> w = Wrap(true, 5);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_NE(*w, nullptr);
  EXPECT_EQ((*w)->Get(), 5);
  EXPECT_EQ(Unwrap(true, 3).value_or(0), 304);

  absl::StatusOr<int> r = Unwrap(false, 3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Message(r.status()), "no memory for Derived");
}

// The macro evaluates its expression once and works in a function returning plain Status.
absl::Status CountCalls(int* calls, std::string* out) {
  FERRY_ASSIGN_OR_RETURN(*out, ([calls]() -> absl::StatusOr<std::string> {
                           ++*calls;
                           return std::string("payload");
                         })());
  return absl::OkStatus();
}

TEST(AssignOrReturn, EvaluatesOnceInStatusFunctions) {
  int calls = 0;
  std::string out;
  EXPECT_TRUE(CountCalls(&calls, &out).ok());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(out, "payload");
}

// ---- PosixError -----------------------------------------------------------------------------------

TEST(PosixError, MapsErrnoToCodes) {
  const struct {
    int err;
    absl::StatusCode code;
  } cases[] = {
      {ENOENT, absl::StatusCode::kNotFound},
      {EEXIST, absl::StatusCode::kAlreadyExists},
      {EACCES, absl::StatusCode::kPermissionDenied},
      {EPERM, absl::StatusCode::kPermissionDenied},
      {ENOSPC, absl::StatusCode::kResourceExhausted},
      {ENOMEM, absl::StatusCode::kResourceExhausted},
      {EDQUOT, absl::StatusCode::kResourceExhausted},
      {EINVAL, absl::StatusCode::kInvalidArgument},
      {EIO, absl::StatusCode::kInternal},
      {EBADF, absl::StatusCode::kInternal},
  };
  for (const auto& c : cases) {
    const std::string context = "writing /ckpt/step-7/rank-00003.safetensors";
    absl::Status s = PosixError(context, c.err);
    EXPECT_EQ(s.code(), c.code) << "errno " << c.err;
    EXPECT_THAT(Message(s), HasSubstr(context));
    EXPECT_THAT(Message(s), HasSubstr(std::strerror(c.err)));
    EXPECT_THAT(Message(s), HasSubstr("errno " + std::to_string(c.err)));
    EXPECT_EQ(Message(s).rfind(context, 0), 0u) << "context first: " << Message(s);
  }
}

TEST(PosixError, FromARealFailedCall) {
  const std::string path = "/nonexistent-ferry-dir/surely/not/here.bin";
  errno = 0;
  const int fd = ::open(path.c_str(), O_RDONLY);
  const int err = errno;
  ASSERT_EQ(fd, -1);
  ASSERT_EQ(err, ENOENT);
  absl::Status s = PosixError("open " + path, err);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(s), HasSubstr(path));
  EXPECT_THAT(Message(s), HasSubstr(std::strerror(ENOENT)));
}

// ---- UnsharedCopy ----------------------------------------------------------------------------------

TEST(UnsharedCopy, EqualButSharingNoText) {
  EXPECT_TRUE(UnsharedCopy(absl::OkStatus()).ok());
  absl::Status original = absl::DeadlineExceededError("Barrier: timed out after 2s; had not arrived: 3");
  original.SetPayload("type.ferry/rank", absl::Cord("3"));
  const absl::Status copy = UnsharedCopy(original);
  EXPECT_EQ(copy, original);  // code, message and payloads
  EXPECT_NE(copy.message().data(), original.message().data());
  const absl::Status plain = original;  // what UnsharedCopy avoids: the same text, shared
  EXPECT_EQ(plain.message().data(), original.message().data());
  original = absl::OkStatus();  // the copy outlives the original intact
  EXPECT_EQ(copy.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(Message(copy), "Barrier: timed out after 2s; had not arrived: 3");
  EXPECT_EQ(copy.GetPayload("type.ferry/rank"), absl::Cord("3"));
}

}  // namespace
}  // namespace ferry
