/* bindings/c/ferry.h compiles as C11 (built as an object of tests/CMakeLists.txt; never run). */
#include "c/ferry.h"

static int all_reduce(void* user, double* values, size_t n, int op, double timeout_s, char* err, size_t err_len) {
  (void)user, (void)values, (void)n, (void)op, (void)timeout_s, (void)err, (void)err_len;
  return FERRY_OK;
}

ferry_comm_callbacks ferry_h_check_callbacks(void) {
  ferry_comm_callbacks c = {0};
  c.world_size = 1;
  c.all_reduce = all_reduce;
  return c;
}
