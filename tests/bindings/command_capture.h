// Runs a `ferry` verb (lua/commands.h) as a function, its output and errors captured in memory.
#ifndef FERRY_TESTS_BINDINGS_COMMAND_CAPTURE_H_
#define FERRY_TESTS_BINDINGS_COMMAND_CAPTURE_H_

#include <stdlib.h>

#include <cstdio>
#include <string>
#include <vector>

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

}  // namespace ferry::cli

#endif  // FERRY_TESTS_BINDINGS_COMMAND_CAPTURE_H_
