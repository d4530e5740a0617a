#include "base/logging.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ferry::logging_internal {

LogMessage::LogMessage(const char* severity, const char* file, int line, bool fatal) : fatal_(fatal) {
  const char* base = std::strrchr(file, '/');
  stream_ << "ferry " << severity << " " << (base != nullptr ? base + 1 : file) << ":" << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  std::fputs(stream_.str().c_str(), stderr);
  if (fatal_) std::abort();
}

}  // namespace ferry::logging_internal
