// Minimal logging and invariant checks. Debian 12's and Ubuntu 24.04's Abseil (20220623) predates
// absl/log, so Ferry carries these two macros itself.
//
//   FERRY_LOG(ERROR) << "pending work failed: " << status;   // one line to stderr, with file:line
//   FERRY_CHECK(offset <= size) << "offset " << offset;       // aborts: only for invariants whose
//                                                             // violation would corrupt state, never
//                                                             // for IO, user input or script errors
#ifndef FERRY_BASE_LOGGING_H_
#define FERRY_BASE_LOGGING_H_

#include <sstream>

namespace ferry::logging_internal {

class LogMessage {
 public:
  LogMessage(const char* severity, const char* file, int line, bool fatal);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
  bool fatal_;
};

// Makes `cond ? (void)0 : LogMessage(...).stream() << ...` well-typed.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace ferry::logging_internal

#define FERRY_LOG(severity) \
  ::ferry::logging_internal::LogMessage(#severity, __FILE__, __LINE__, false).stream()

#define FERRY_CHECK(cond)                                                                         \
  (cond) ? (void)0                                                                                \
         : ::ferry::logging_internal::Voidify() &                                                 \
               ::ferry::logging_internal::LogMessage("FATAL", __FILE__, __LINE__, true).stream()  \
                   << "Check failed: " #cond " "

#endif  // FERRY_BASE_LOGGING_H_
