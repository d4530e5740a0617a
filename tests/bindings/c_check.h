/* The checks of the C11 test programs (c_api_check.c, c_options_check.c): a failure prints the program
 * (C_CHECK_NAME, defined before this header), the line, what failed and ferry_last_error(), and exits 1. */
#ifndef FERRY_TESTS_BINDINGS_C_CHECK_H_
#define FERRY_TESTS_BINDINGS_C_CHECK_H_

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c/ferry.h"

/* `call` returns FERRY_OK. */
#define CHECK(call)                                                                                     \
  do {                                                                                                  \
    ferry_status st_ = (call);                                                                          \
    if (st_ != FERRY_OK) {                                                                              \
      fprintf(stderr, "%s:%d: %s failed (%d): %s\n", C_CHECK_NAME, __LINE__, #call, (int)st_,           \
              ferry_last_error());                                                                      \
      exit(1);                                                                                          \
    }                                                                                                   \
  } while (0)

#define EXPECT(cond)                                                               \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      fprintf(stderr, "%s:%d: expected %s\n", C_CHECK_NAME, __LINE__, #cond);      \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

/* `call` returns `code` with `text` in ferry_last_error(). */
#define EXPECT_ERROR(call, code, text)                                                                  \
  do {                                                                                                  \
    ferry_status st_ = (call);                                                                          \
    if (st_ != (code) || strstr(ferry_last_error(), (text)) == NULL) {                                  \
      fprintf(stderr, "%s:%d: %s returned %d (%s); expected %d with \"%s\"\n", C_CHECK_NAME, __LINE__,  \
              #call, (int)st_, ferry_last_error(), (int)(code), (text));                                \
      exit(1);                                                                                          \
    }                                                                                                   \
  } while (0)

#endif /* FERRY_TESTS_BINDINGS_C_CHECK_H_ */
