/* A C11 trainer on Ferry's C ABI (libferry, <ferry.h>), built through pkg-config:
 *
 *   cc -std=c11 c_trainer.c $(pkg-config --cflags --libs ferry) -o c_trainer
 *   ./c_trainer "$(pkg-config --variable=policydir ferry)"
 *
 * It fits w to a known target (the gradient of 0.5 * ||w - target||^2 is w - target) with two fp32
 * parameter groups, one offloaded to pinned host memory by offload_fraction.lua, on Ferry's host
 * backend (device memory is host memory, so plain arrays are the tensors), then checkpoints and
 * verifies the fp32 masters. Exit 0 when w came within 0.05 of the target. */
#define _POSIX_C_SOURCE 200809L  /* getpid */

#include <ferry.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N 256

static int Fail(const char* what, ferry_status s) {
  fprintf(stderr, "c_trainer: %s failed (status %d): %s\n", what, (int)s, ferry_last_error());
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: c_trainer POLICY_DIR\n");
    return 2;
  }
  char policy[4096];
  snprintf(policy, sizeof policy, "%s/offload_fraction.lua", argv[1]);
  const char* keys[] = {"fraction"};
  const char* values[] = {"0.5"};

  ferry_engine_options options;
  ferry_engine_options_init(&options);
  options.policy_path = policy;
  options.policy_arg_keys = keys;
  options.policy_arg_values = values;
  options.num_policy_args = 1;
  options.device = "host";
  options.lr = 0.05f;
  printf("libferry %s\n", ferry_version());

  static float w[2][N], g[2][N], target[2][N];
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < N; ++i) {
      w[k][i] = 0.0f;
      target[k][i] = (float)sin(0.1 * (i + N * k));
    }
  }
  ferry_engine* engine = NULL;
  ferry_status s = ferry_engine_create(&options, &engine);
  if (s != FERRY_OK) return Fail("ferry_engine_create", s);
  const int64_t shape[1] = {N};
  if ((s = ferry_add_param(engine, "a.weight", "a", shape, 1, FERRY_F32, w[0], g[0])) != FERRY_OK ||
      (s = ferry_add_param(engine, "b.weight", "b", shape, 1, FERRY_F32, w[1], g[1])) != FERRY_OK) {
    return Fail("ferry_add_param", s);
  }
  if ((s = ferry_finalize(engine)) != FERRY_OK) return Fail("ferry_finalize", s);
  int offloaded_a = -1, offloaded_b = -1;
  if ((s = ferry_group_offloaded(engine, "a", &offloaded_a)) != FERRY_OK ||
      (s = ferry_group_offloaded(engine, "b", &offloaded_b)) != FERRY_OK) {
    return Fail("ferry_group_offloaded", s);
  }
  printf("group a: %s, group b: %s\n", offloaded_a ? "cpu" : "gpu", offloaded_b ? "cpu" : "gpu");

  double err = 0.0;
  for (int step = 1; step <= 200; ++step) {
    err = 0.0;
    for (int k = 0; k < 2; ++k) {
      for (int i = 0; i < N; ++i) {
        g[k][i] = w[k][i] - target[k][i];
        if (fabs(g[k][i]) > err) err = fabs(g[k][i]);
      }
    }
    if (step == 1 || step % 50 == 0) printf("step %3d  max |w - target| %.5f\n", step, err);
    if ((s = ferry_step(engine, -1.0f, NULL)) != FERRY_OK) return Fail("ferry_step", s);
  }
  char root[256], dir[4096];
  snprintf(root, sizeof root, "/tmp/ferry-c-trainer-%ld", (long)getpid());
  if ((s = ferry_save_checkpoint(engine, root, 200, dir, sizeof dir)) != FERRY_OK) {
    return Fail("ferry_save_checkpoint", s);
  }
  printf("saved %s\n", dir);
  if ((s = ferry_verify_masters(engine)) != FERRY_OK) return Fail("ferry_verify_masters", s);
  ferry_engine_destroy(engine);
  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  if (system(cmd) != 0) fprintf(stderr, "c_trainer: could not remove %s\n", root);
  if (offloaded_a + offloaded_b != 1 || !(err < 0.05)) {
    fprintf(stderr, "c_trainer: expected one offloaded group and w within 0.05 of the target (got %g)\n", err);
    return 1;
  }
  return 0;
}
