/* ferry_engine_options from C11 (bindings/c/ferry.h), on the host backend: every field appended after
 * checkpoint_timeout_s reaches the engine (a bad value refused naming it; a good one seen in the engine's
 * stats, its steps or its trace), and the sized calls a caller of an older or newer header makes: an older
 * struct read and written no further than its size, the rest at its defaults; a larger one refused.
 * Usage: c_options_check DIR (a scratch directory). Exit status 0 on success. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define C_CHECK_NAME "c_options_check"
#include "c_check.h"

/* `options` refused with FERRY_INVALID_ARGUMENT and `text` in the message, no engine made. */
static void expect_refused(int line, const ferry_engine_options* options, const char* text) {
  ferry_engine* e = (ferry_engine*)&e; /* not NULL: a refusal must clear it */
  const ferry_status st = ferry_engine_create(options, &e);
  if (st != FERRY_INVALID_ARGUMENT || strstr(ferry_last_error(), text) == NULL || e != NULL) {
    fprintf(stderr, "c_options_check:%d: ferry_engine_create returned %d (%s); expected %d with \"%s\"\n", line,
            (int)st, ferry_last_error(), (int)FERRY_INVALID_ARGUMENT, text);
    exit(1);
  }
}

static ferry_engine_options host_options(void) {
  ferry_engine_options o;
  ferry_engine_options_init(&o);
  o.device = "host";
  return o;
}

/* One Adam step of one element (param 1, grad g) by an engine made from `o`; the param after it. */
static float one_step(ferry_engine_options o, float g) {
  float p = 1.0f;
  const int64_t shape[1] = {1};
  ferry_engine* e = NULL;
  CHECK(ferry_engine_create(&o, &e));
  CHECK(ferry_add_param(e, "p", "g", shape, 1, FERRY_F32, &p, &g));
  CHECK(ferry_finalize(e));
  CHECK(ferry_step(e, -1.0f, NULL));
  ferry_engine_destroy(e);
  return p;
}

/* The first AdamW step in float64, without weight decay, with or without bias correction. */
static double first_step(double lr, double beta1, double beta2, double eps, double g, int bias_correction) {
  double m = (1.0 - beta1) * g, v = (1.0 - beta2) * g * g;
  if (bias_correction) m /= 1.0 - beta1, v /= 1.0 - beta2;
  return 1.0 - lr * m / (sqrt(v) + eps);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: c_options_check DIR\n");
    return 2;
  }
  const ferry_engine_options d = host_options();
  EXPECT(d.bias_correction == 1 && d.device_ordinal == 0 && d.cpu_threads == 0 && d.trainer_threads == 1);
  EXPECT(d.cpu_threads_max == 0 && d.spare_state_fraction == 1.0 && d.state_later == NULL);
  EXPECT(d.local_rank == -1 && d.local_world_size == -1 && d.pin_cpu_threads == -1 && d.pin_trainer_threads == -1);
  EXPECT(d.numa == NULL && d.trace_path == NULL && ferry_engine_options_size() == sizeof(ferry_engine_options));

  /* Each appended field reaches the engine's checks, which name it: `d` with `field` set to `value`. */
#define EXPECT_REFUSED(field, value, text)          \
  do {                                              \
    ferry_engine_options o_ = d;                    \
    o_.field = (value);                             \
    expect_refused(__LINE__, &o_, (text));          \
  } while (0)
  EXPECT_REFUSED(spare_state_fraction, 1.5, "EngineOptions::spare_state_fraction is 1.5");
  EXPECT_REFUSED(state_later, "half", "EngineOptions::state_later is 'half'");
  EXPECT_REFUSED(local_rank, 1, "EngineOptions::local_rank is 1 and local_world_size is -1");
  EXPECT_REFUSED(pin_cpu_threads, 2, "EngineOptions::pin_cpu_threads is 2");
  EXPECT_REFUSED(pin_trainer_threads, 5, "EngineOptions::pin_trainer_threads is 5");
  EXPECT_REFUSED(numa, "nearest", "EngineOptions::numa: unknown NUMA policy 'nearest'");
  EXPECT_REFUSED(device_ordinal, -1, "EngineOptions::device_ordinal is -1");
  EXPECT_REFUSED(collective_timeout_s, -1.0, "ferry_engine_options.collective_timeout_s is -1; it must be >= 0");
  EXPECT_REFUSED(checkpoint_timeout_s, NAN, "ferry_engine_options.checkpoint_timeout_s is nan");
#undef EXPECT_REFUSED

  /* bias_correction: the first step against float64 Adam with and without it (they differ ~3x here). */
  {
    ferry_engine_options o = d;
    o.lr = 0.01f;
    o.weight_decay = 0.0f;
    const float g = 0.37f;
    for (int bc = 0; bc <= 1; ++bc) {
      o.bias_correction = bc;
      const double want = first_step(o.lr, o.beta1, o.beta2, o.eps, g, bc);
      const float got = one_step(o, g);
      if (fabs(got - want) > 1e-6) {
        fprintf(stderr, "c_options_check: bias_correction %d: param %.9g, float64 Adam %.9g\n", bc, got, want);
        return 1;
      }
    }
  }

  /* The share, the workers and the trace: seen in the stats and on disk. */
  {
    char trace[4096];
    snprintf(trace, sizeof(trace), "%s/c_options.json", argv[1]);
    ferry_engine_options o = d;
    o.cpu_threads = 1;
    o.transfer_chunk_bytes = 4096;
    o.state_later = "0.5";
    o.spare_state_fraction = 0.25;
    o.trace_path = trace;
    ferry_engine* e = NULL;
    CHECK(ferry_engine_create(&o, &e));
    float p[256], g[256];
    for (int i = 0; i < 256; ++i) p[i] = 0.01f * (float)i, g[i] = 0.5f - 0.003f * (float)i;
    const int64_t shape[1] = {256};
    CHECK(ferry_add_param(e, "p", "g", shape, 1, FERRY_F32, p, g));
    CHECK(ferry_finalize(e));
    CHECK(ferry_step(e, -1.0f, NULL));
    ferry_stats s;
    CHECK(ferry_get_stats(e, &s));
    EXPECT(s.cpu_threads == 1 && s.transfer_chunk_bytes == 4096);
    EXPECT(s.local_rank == 0 && s.local_world_size >= 1 && s.pinned_limit_bytes > 0 && s.numa_node >= -1);
    char cpus[256], tiny[2];
    CHECK(ferry_host_share(e, NULL, 0, NULL, 0));
    EXPECT(ferry_host_share(e, cpus, sizeof(cpus), tiny, sizeof(tiny)) == FERRY_INVALID_ARGUMENT);
    EXPECT(strstr(ferry_last_error(), "ferry_host_share (reason_out)") != NULL);
    EXPECT(ferry_host_share(NULL, NULL, 0, NULL, 0) == FERRY_INVALID_ARGUMENT);
    ferry_engine_destroy(e);
    FILE* f = fopen(trace, "r");
    EXPECT(f != NULL); /* written at destruction */
    fclose(f);
  }

  /* A caller of an older header: its struct ends at checkpoint_timeout_s. init_sized writes no further;
   * create_sized reads no further (the bytes past it are garbage that would be refused or crash if read). */
  {
    enum { kOld = offsetof(ferry_engine_options, bias_correction) };
    union {
      ferry_engine_options o;
      unsigned char bytes[sizeof(ferry_engine_options) + 16];
    } older;
    memset(&older, 0xAB, sizeof(older));
    ferry_engine_options_init_sized(&older, kOld);
    EXPECT(memcmp(&older.o, &d, offsetof(ferry_engine_options, device)) == 0); /* the defaults, up to device */
    for (size_t i = kOld; i < sizeof(older.bytes); ++i) EXPECT(older.bytes[i] == 0xAB);
    older.o.device = "host";
    ferry_engine* e = NULL;
    CHECK(ferry_engine_create_sized(&older, kOld, &e));
    ferry_stats s;
    CHECK(ferry_get_stats(e, &s));
    EXPECT(s.local_rank == 0 && s.cpu_threads >= 1);
    ferry_engine_destroy(e);

    /* A newer header's (larger) struct: init_sized zeroes what it has no field for; create refuses it. */
    memset(&older, 0xAB, sizeof(older));
    ferry_engine_options_init_sized(&older, sizeof(older));
    for (size_t i = sizeof(ferry_engine_options); i < sizeof(older.bytes); ++i) EXPECT(older.bytes[i] == 0);
    older.o.device = "host";
    e = (ferry_engine*)&e;
    EXPECT(ferry_engine_create_sized(&older, sizeof(older), &e) == FERRY_INVALID_ARGUMENT && e == NULL);
    EXPECT(strstr(ferry_last_error(), "a larger one is from a newer header") != NULL);
    EXPECT(ferry_engine_create_sized(&older, kOld - 8, &e) == FERRY_INVALID_ARGUMENT);
    EXPECT(strstr(ferry_last_error(), "options_size is") != NULL);
    EXPECT(ferry_engine_create_sized(NULL, kOld, &e) == FERRY_INVALID_ARGUMENT);
  }

  /* A local rank's share, last (it divides this process's pinned budget for the engines after it). */
  {
    ferry_engine_options o = d;
    o.local_rank = 1;
    o.local_world_size = 2;
    o.pin_cpu_threads = 1;     /* the workers held to the rank's slice */
    o.pin_trainer_threads = 0; /* this process's other threads left free */
    ferry_engine* e = NULL;
    CHECK(ferry_engine_create(&o, &e));
    ferry_stats s;
    CHECK(ferry_get_stats(e, &s));
    EXPECT(s.local_rank == 1 && s.local_world_size == 2);
    char cpus[256], reason[1024];
    CHECK(ferry_host_share(e, cpus, sizeof(cpus), reason, sizeof(reason)));
    EXPECT(strstr(reason, "local rank 1 of 2 (options)") != NULL && strlen(cpus) > 0);
    ferry_engine_destroy(e);
  }
  printf("c_options_check: OK\n");
  return 0;
}
