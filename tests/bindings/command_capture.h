// Runs a `ferry` verb (lua/commands.h) as a function, its output and errors captured in memory; the
// helpers the verbs' tests share (a temporary directory, a table row's words).
#ifndef FERRY_TESTS_BINDINGS_COMMAND_CAPTURE_H_
#define FERRY_TESTS_BINDINGS_COMMAND_CAPTURE_H_

#include <stdlib.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "temp_dir.h"

namespace ferry::cli {

struct Result {
  int status = -1;
  std::string out, err;
};

template <typename Verb>
Result RunVerb(Verb verb, const std::vector<std::string>& args) {
  Result r;
  char* out_buf = nullptr;
  char* err_buf = nullptr;
  size_t out_len = 0, err_len = 0;
  std::FILE* out = open_memstream(&out_buf, &out_len);
  std::FILE* err = open_memstream(&err_buf, &err_len);
  r.status = verb(args, out, err);
  std::fclose(out);
  std::fclose(err);
  r.out.assign(out_buf, out_len);
  r.err.assign(err_buf, err_len);
  free(out_buf);
  free(err_buf);
  return r;
}

// A directory of its own under the system's temporary one, removed with everything in it.
using testing_util::TempDir;

// The whitespace-separated words of the first line of `text` that starts with `prefix`.
inline std::vector<std::string> Row(const std::string& text, const std::string& prefix) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, prefix)) {
      return absl::StrSplit(line, ' ', absl::SkipEmpty());
    }
  }
  return {"<no line starting with '" + prefix + "'>"};
}

}  // namespace ferry::cli

#endif  // FERRY_TESTS_BINDINGS_COMMAND_CAPTURE_H_
