// Tests of base/logging.h: FERRY_LOG writes one line with severity and file:line to stderr;
// FERRY_CHECK is silent when its condition holds and aborts with the condition and context otherwise.
#include "base/logging.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ferry {
namespace {

using ::testing::HasSubstr;

TEST(Logging, LogWritesOneLineWithSeverityAndLocation) {
  ::testing::internal::CaptureStderr();
  const int line = __LINE__ + 1;
  FERRY_LOG(ERROR) << "pending work failed: " << 42 << " bytes";
  const std::string out = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(out, "ferry ERROR logging_test.cc:" + std::to_string(line) +
                     "] pending work failed: 42 bytes\n");
}

TEST(Logging, CheckThatHoldsIsSilentAndEvaluatesOnce) {
  int evaluations = 0;
  ::testing::internal::CaptureStderr();
  FERRY_CHECK(++evaluations == 1) << "never printed";
  // Usable as a statement in an unbraced if / else.
  if (evaluations == 1)
    FERRY_CHECK(evaluations > 0);
  else
    FERRY_CHECK(evaluations < 0);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(evaluations, 1);
}

void FailCheck(int offset, int size) {
  FERRY_CHECK(offset <= size) << "offset " << offset << " past size " << size;
}

TEST(LoggingDeathTest, FailedCheckAbortsWithConditionAndContext) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(FailCheck(9, 4),
               "ferry FATAL logging_test.cc:[0-9]+\\] Check failed: offset <= size offset 9 past "
               "size 4");
}

}  // namespace
}  // namespace ferry
