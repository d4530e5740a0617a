/* A C11 trainer through the whole C ABI (bindings/c/ferry.h), on the host backend: per-group settings
 * (ferry_add_group) checked against a float64 Adam on fresh random data, bad settings refused, step
 * options (schedule, loss scale, clipping, the finite check), stats (skipped steps, last grad norm),
 * the placement listing, policy reload, checkpoints (poll/wait, load options with fall back, the
 * settings' differences reported on load), the device and the version; a model in one group announced
 * in buckets of params (ferry_grads_ready_params, ferry_wait_params_of) bit-identical to steps alone,
 * the spare state they allocated (ferry_stats.spare_state_bytes), and the misuses of both.
 * Usage: c_api_check DIR SOURCE_DIR (a scratch directory; the project's sources, for its policies).
 * Exit status 0 on success. */
#define _POSIX_C_SOURCE 200809L /* truncate */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define C_CHECK_NAME "c_api_check"
#include "c_check.h"

enum { NPARAMS = 3 };
static const char* const kNames[NPARAMS] = {"w", "b", "norm"};
static const char* const kGroups[NPARAMS] = {"weights", "bias", "norm"};
static const int64_t kNumel[NPARAMS] = {1000, 7, 33};

/* The settings each param's group steps with (the engine's defaults: lr 0.01, weight decay 0.1). */
typedef struct {
  double lr_scale, weight_decay, beta1, beta2, eps;
  int adamw;
} settings;
static const settings kSettings[NPARAMS] = {
    {1.0, 0.1, 0.9, 0.999, 1e-8, 1},  /* weights: the defaults */
    {0.5, 0.0, 0.9, 0.999, 1e-8, 1},  /* bias: no decay, half the lr */
    {1.0, 0.1, 0.8, 0.95, 1e-3, 0},   /* norm: Adam with L2, other betas and eps */
};

typedef struct {
  float* param[NPARAMS];
  float* grad[NPARAMS];
  double* ref_p[NPARAMS];
  double* ref_m[NPARAMS];
  double* ref_v[NPARAMS];
} model;

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
/* Normal-ish values (sum of uniforms), never zero in bulk. */
static float random_value(void) {
  double sum = 0.0;
  for (int i = 0; i < 4; ++i) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    sum += (double)(rng_state >> 11) / 9007199254740992.0 - 0.5;
  }
  return (float)sum;
}

static void new_model(model* m) {
  for (int i = 0; i < NPARAMS; ++i) {
    const size_t n = (size_t)kNumel[i];
    m->param[i] = malloc(n * sizeof(float));
    m->grad[i] = malloc(n * sizeof(float));
    m->ref_p[i] = calloc(n, sizeof(double));
    m->ref_m[i] = calloc(n, sizeof(double));
    m->ref_v[i] = calloc(n, sizeof(double));
    for (size_t k = 0; k < n; ++k) m->ref_p[i][k] = m->param[i][k] = random_value();
  }
}

static void free_model(model* m) {
  for (int i = 0; i < NPARAMS; ++i) {
    free(m->param[i]);
    free(m->grad[i]);
    free(m->ref_p[i]);
    free(m->ref_m[i]);
    free(m->ref_v[i]);
  }
}

/* Fresh grads, times `scale` (a power of two: exact); returns the unscaled grads' L2 norm. */
static double set_grads(model* m, float scale) {
  double sum_sq = 0.0;
  for (int i = 0; i < NPARAMS; ++i) {
    for (int64_t k = 0; k < kNumel[i]; ++k) {
      const float g = random_value();
      sum_sq += (double)g * g;
      m->grad[i][k] = g * scale;
    }
  }
  return sqrt(sum_sq);
}

/* One float64 Adam step of every param with its group's settings, from the unscaled grads. */
static void reference_step(model* m, double lr, int t, float scale) {
  for (int i = 0; i < NPARAMS; ++i) {
    const settings* s = &kSettings[i];
    const double bc1 = 1.0 - pow(s->beta1, t), bc2 = 1.0 - pow(s->beta2, t), glr = lr * s->lr_scale;
    for (int64_t k = 0; k < kNumel[i]; ++k) {
      double g = (double)m->grad[i][k] / scale;
      double* p = &m->ref_p[i][k];
      if (!s->adamw) g += s->weight_decay * *p;
      m->ref_m[i][k] = s->beta1 * m->ref_m[i][k] + (1.0 - s->beta1) * g;
      m->ref_v[i][k] = s->beta2 * m->ref_v[i][k] + (1.0 - s->beta2) * g * g;
      double update = (m->ref_m[i][k] / bc1) / (sqrt(m->ref_v[i][k]) / sqrt(bc2) + s->eps);
      if (s->adamw) update += s->weight_decay * *p;
      *p -= glr * update;
    }
  }
}

static void expect_reference(const model* m) {
  for (int i = 0; i < NPARAMS; ++i) {
    for (int64_t k = 0; k < kNumel[i]; ++k) {
      const double want = m->ref_p[i][k], got = m->param[i][k];
      if (fabs(got - want) > 2e-6 * (1.0 + fabs(want))) {
        fprintf(stderr, "c_api_check: %s[%lld] is %.9g, the float64 reference %.9g\n", kNames[i], (long long)k, got, want);
        exit(1);
      }
    }
  }
}

static ferry_engine* make_engine(model* m, double bias_weight_decay) {
  ferry_engine_options o;
  ferry_engine_options_init(&o);
  o.device = "host";
  o.lr = 0.01f;
  o.weight_decay = 0.1f;
  o.transfer_chunk_bytes = 1024;
  ferry_engine* e = NULL;
  CHECK(ferry_engine_create(&o, &e));
  /* Bad settings: refused, nothing recorded. */
  const char* typo[] = {"weight_decay_typo"};
  const double zero[] = {0.0};
  EXPECT_ERROR(ferry_add_group(e, "bias", typo, zero, 1), FERRY_INVALID_ARGUMENT,
               "unknown group option 'weight_decay_typo' (known: lr_scale, weight_decay, beta1, beta2, eps, adamw)");
  const char* wd[] = {"weight_decay"};
  const double negative[] = {-0.1};
  EXPECT_ERROR(ferry_add_group(e, "bias", wd, negative, 1), FERRY_INVALID_ARGUMENT, "weight_decay is -0.1");
  const char* b2[] = {"beta2"};
  const double one[] = {1.0};
  EXPECT_ERROR(ferry_add_group(e, "norm", b2, one, 1), FERRY_INVALID_ARGUMENT, "beta2 is 1; it must be in [0, 1)");
  /* The groups' settings (bias before its param, norm after). */
  const char* bias_keys[] = {"weight_decay", "lr_scale"};
  const double bias_values[] = {bias_weight_decay, 0.5};
  CHECK(ferry_add_group(e, "bias", bias_keys, bias_values, 2));
  EXPECT_ERROR(ferry_add_group(e, "bias", bias_keys, bias_values, 2), FERRY_ALREADY_EXISTS, "already given");
  for (int i = 0; i < NPARAMS; ++i) {
    CHECK(ferry_add_param(e, kNames[i], kGroups[i], &kNumel[i], 1, FERRY_F32, m->param[i], m->grad[i]));
  }
  const char* norm_keys[] = {"beta1", "beta2", "eps", "adamw"};
  const double norm_values[] = {0.8, 0.95, 1e-3, 0};
  CHECK(ferry_add_group(e, "norm", norm_keys, norm_values, 4));
  CHECK(ferry_finalize(e));
  return e;
}

/* ---- a step's own values of some groups (schedulers): group_lr, group_beta1/2, group_weight_decay */
/* Six steps, with the groups "weights" given their own lr and beta1 and "bias" its own weight decay
 * at every step (cycling, as schedulers do; NaN entries keep the rest), against the float64 reference
 * of each group's settings with those values; bad values refused with nothing stepped. */
static void check_group_values(void) {
  model m;
  new_model(&m);
  ferry_engine* e = make_engine(&m, 0.0);
  const char* named[] = {"weights", "bias"};
  ferry_step_options so;
  ferry_step_options_init(&so);
  EXPECT(so.group_names == NULL && so.num_groups == 0 && so.group_lr == NULL && so.group_beta1 == NULL &&
         so.group_beta2 == NULL && so.group_weight_decay == NULL);
  so.group_names = named;
  so.num_groups = 2;
  float lr[2], beta1[2], decay[2];
  so.group_lr = lr;
  so.group_beta1 = beta1;
  so.group_weight_decay = decay;
  /* Refused, nothing stepped: a beta1 of 1, a negative decay, an unknown group, NULL names. */
  set_grads(&m, 1.0f);
  lr[0] = 0.02f; lr[1] = NAN;
  beta1[0] = 1.0f; beta1[1] = NAN;
  decay[0] = NAN; decay[1] = 0.1f;
  EXPECT_ERROR(ferry_step_with(e, &so, NULL), FERRY_INVALID_ARGUMENT, "the betas of group 'weights'");
  beta1[0] = 0.85f; decay[1] = -1.0f;
  EXPECT_ERROR(ferry_step_with(e, &so, NULL), FERRY_INVALID_ARGUMENT, "the weight decay of group 'bias'");
  const char* unknown[] = {"weights", "nope"};
  so.group_names = unknown;
  decay[1] = 0.1f;
  EXPECT_ERROR(ferry_step_with(e, &so, NULL), FERRY_INVALID_ARGUMENT, "no parameter group 'nope'");
  so.group_names = NULL;
  EXPECT_ERROR(ferry_step_with(e, &so, NULL), FERRY_INVALID_ARGUMENT, "ferry_step_with: group_names is NULL");
  so.group_names = named;
  for (int i = 0; i < NPARAMS; ++i) {
    for (int64_t k = 0; k < kNumel[i]; ++k) EXPECT(m.param[i][k] == (float)m.ref_p[i][k]);  /* not stepped */
  }
  for (int t = 1; t <= 6; ++t) {
    set_grads(&m, 1.0f);
    lr[0] = 0.02f / (float)t;
    beta1[0] = 0.95f - 0.03f * (float)(t % 3);
    decay[1] = 0.05f * (float)t;
    so.has_lr = 1;
    so.lr = 0.01f;
    CHECK(ferry_step_with(e, &so, NULL));
    CHECK(ferry_synchronize(e));
    /* The reference: weights with lr[0] and beta1[0] (beta2 its own), bias with its lr_scale and decay[1]. */
    for (int i = 0; i < NPARAMS; ++i) {
      const settings* s = &kSettings[i];
      const double b1 = i == 0 ? beta1[0] : s->beta1, b2 = s->beta2;
      const double glr = i == 0 ? lr[0] : 0.01f * s->lr_scale, wd = i == 1 ? decay[1] : s->weight_decay;
      const double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
      for (int64_t k = 0; k < kNumel[i]; ++k) {
        double g = m.grad[i][k];
        double* p = &m.ref_p[i][k];
        if (!s->adamw) g += wd * *p;
        m.ref_m[i][k] = b1 * m.ref_m[i][k] + (1.0 - b1) * g;
        m.ref_v[i][k] = b2 * m.ref_v[i][k] + (1.0 - b2) * g * g;
        double update = (m.ref_m[i][k] / bc1) / (sqrt(m.ref_v[i][k]) / sqrt(bc2) + s->eps);
        if (s->adamw) update += wd * *p;
        *p -= glr * update;
      }
    }
    expect_reference(&m);
  }
  ferry_engine_destroy(e);
  free_model(&m);
}

/* ---- one group announced in buckets (ferry_grads_ready_params, ferry_wait_params_of) ------------ */
enum { NBUCKET = 6 };
static const char* const kBucketNames[NBUCKET] = {"p0", "p1", "p2", "p3", "p4", "p5"};
static const int64_t kBucketNumel[NBUCKET] = {1000, 7, 4099, 65, 3, 2000};

typedef struct {
  float* param[NBUCKET];
  float* grad[NBUCKET];
} bucket_model;

/* Both models get the same random params; grads are set per step by the caller. */
static void new_bucket_models(bucket_model* a, bucket_model* b) {
  for (int i = 0; i < NBUCKET; ++i) {
    const size_t n = (size_t)kBucketNumel[i];
    a->param[i] = malloc(n * sizeof(float));
    a->grad[i] = malloc(n * sizeof(float));
    b->param[i] = malloc(n * sizeof(float));
    b->grad[i] = malloc(n * sizeof(float));
    for (size_t k = 0; k < n; ++k) a->param[i][k] = b->param[i][k] = random_value();
  }
}

static void free_bucket_model(bucket_model* m) {
  for (int i = 0; i < NBUCKET; ++i) {
    free(m->param[i]);
    free(m->grad[i]);
  }
}

/* Every param in the one group "all", offloaded by `policy`; small chunks, so a bucket spans several.
 * `state_later`: ferry_engine_options.state_later, whatever FERRY_STATE_LATER says. */
static ferry_engine* make_bucket_engine(bucket_model* m, const char* policy, const char* state_later) {
  ferry_engine_options o;
  ferry_engine_options_init(&o);
  o.device = "host";
  o.state_later = state_later;
  o.policy_path = policy;
  o.lr = 0.01f;
  o.weight_decay = 0.1f;
  o.transfer_chunk_bytes = 1024;
  ferry_engine* e = NULL;
  CHECK(ferry_engine_create(&o, &e));
  for (int i = 0; i < NBUCKET; ++i) {
    CHECK(ferry_add_param(e, kBucketNames[i], "all", &kBucketNumel[i], 1, FERRY_F32, m->param[i], m->grad[i]));
  }
  CHECK(ferry_finalize(e));
  int offloaded = 0;
  CHECK(ferry_group_offloaded(e, "all", &offloaded));
  EXPECT(offloaded == 1);
  return e;
}

static void expect_same_param(const bucket_model* a, const bucket_model* b, int i, int step) {
  if (memcmp(a->param[i], b->param[i], (size_t)kBucketNumel[i] * sizeof(float)) != 0) {
    fprintf(stderr, "c_api_check: step %d: %s differs between buckets and the step alone\n", step, kBucketNames[i]);
    exit(1);
  }
}

/* Two engines on the same params and grads: `plain` only steps; `buckets` announces its one group in
 * buckets of params during a simulated backward (last param first, buckets of 1 to 3), steps
 * deferred every other step and then waits param by param in forward order, checking each param as
 * its wait returns (the host backend's NULL stream is the calling thread). Clipping triggers in some
 * steps (the early work is recomputed) and not in others (kept). */
static void check_buckets(const char* policy) {
  bucket_model pm, bm;
  new_bucket_models(&pm, &bm);
  ferry_engine* plain = make_bucket_engine(&pm, policy, "off");
  ferry_engine* buckets = make_bucket_engine(&bm, policy, "1"); /* the state later: the same bits */

  /* The misuses: nothing started by any of them. */
  ferry_step_options so;
  ferry_step_options_init(&so);
  const char* unknown[] = {"p1", "nope"};
  EXPECT_ERROR(ferry_grads_ready_params(buckets, unknown, 2, &so, NULL), FERRY_NOT_FOUND, "no param 'nope'");
  EXPECT_ERROR(ferry_grads_ready_params(buckets, kBucketNames, 0, &so, NULL), FERRY_INVALID_ARGUMENT,
               "name at least one param");
  EXPECT_ERROR(ferry_grads_ready_params(buckets, NULL, 1, &so, NULL), FERRY_INVALID_ARGUMENT,
               "ferry_grads_ready_params: params is NULL");
  const char* with_null[] = {"p0", NULL};
  EXPECT_ERROR(ferry_grads_ready_params(buckets, with_null, 2, &so, NULL), FERRY_INVALID_ARGUMENT,
               "ferry_grads_ready_params: params[1] is NULL");
  const char* twice[] = {"p1", "p1"};
  EXPECT_ERROR(ferry_grads_ready_params(buckets, twice, 2, &so, NULL), FERRY_INVALID_ARGUMENT, "'p1'");
  EXPECT_ERROR(ferry_grads_ready_params(NULL, kBucketNames, 1, &so, NULL), FERRY_INVALID_ARGUMENT,
               "ferry_grads_ready_params: engine handle is NULL");
  EXPECT_ERROR(ferry_wait_params_of(buckets, &unknown[1], 1, NULL), FERRY_NOT_FOUND, "no param 'nope'");
  EXPECT_ERROR(ferry_wait_params_of(buckets, NULL, 1, NULL), FERRY_INVALID_ARGUMENT,
               "ferry_wait_params_of: params is NULL");
  EXPECT_ERROR(ferry_wait_params_of(NULL, kBucketNames, 1, NULL), FERRY_INVALID_ARGUMENT,
               "ferry_wait_params_of: engine handle is NULL");
  CHECK(ferry_verify_masters(buckets)); /* no step in progress */

  ferry_stats stats;
  int deferred = 0;
  for (int step = 1; step <= 12; ++step) {
    /* Fresh grads, the same for both; a clip at a third of the norm in every third step. */
    double sum_sq = 0.0;
    for (int i = 0; i < NBUCKET; ++i) {
      for (int64_t k = 0; k < kBucketNumel[i]; ++k) {
        const float g = random_value();
        sum_sq += (double)g * g;
        pm.grad[i][k] = bm.grad[i][k] = g;
      }
    }
    ferry_step_options_init(&so);
    so.has_lr = 1;
    so.lr = 0.01f * (1.0f - 0.05f * (float)step);
    so.max_grad_norm = step % 3 == 0 ? (float)(sqrt(sum_sq) / 3.0) : (float)(2.0 * sqrt(sum_sq));
    /* The backward: buckets of 1 to 3 params from the last to the first. */
    int end = NBUCKET;
    int size = 1 + step % 3;
    while (end > 0) {
      const int begin = end - size > 0 ? end - size : 0;
      CHECK(ferry_grads_ready_params(buckets, &kBucketNames[begin], (size_t)(end - begin), &so, NULL));
      if (step == 1 && end == NBUCKET) {
        /* Announced twice in one step: refused, naming the param; a wait before the step too. */
        EXPECT_ERROR(ferry_grads_ready_params(buckets, &kBucketNames[NBUCKET - 1], 1, &so, NULL),
                     FERRY_INVALID_ARGUMENT, "already announced");
        EXPECT_ERROR(ferry_wait_params_of(buckets, kBucketNames, 1, NULL), FERRY_FAILED_PRECONDITION, "Step");
        EXPECT_ERROR(ferry_verify_masters(buckets), FERRY_FAILED_PRECONDITION, "call Step first");
      }
      end = begin;
      size = size % 3 + 1;
    }
    /* Every param announced: so is the group, and a group announcement of it is refused. */
    const char* group[] = {"all"};
    EXPECT_ERROR(ferry_grads_ready(buckets, group, 1, &so, NULL), FERRY_INVALID_ARGUMENT, "already announced");
    CHECK(ferry_step_with(plain, &so, NULL));
    CHECK(ferry_synchronize(plain));
    const int defer = step % 2 == 0;
    so.wait_for_params = defer ? 0 : 1;
    CHECK(ferry_step_with(buckets, &so, NULL));
    if (defer) {
      /* The next forward: each param waited for alone, in forward order, holds the step's values. */
      for (int i = 0; i < NBUCKET; ++i) {
        CHECK(ferry_wait_params_of(buckets, &kBucketNames[i], 1, NULL));
        expect_same_param(&bm, &pm, i, step);
      }
      CHECK(ferry_wait_params_of(buckets, kBucketNames, 0, NULL)); /* none: nothing to wait for */
      ++deferred;
    }
    CHECK(ferry_synchronize(buckets));
    for (int i = 0; i < NBUCKET; ++i) expect_same_param(&bm, &pm, i, step);
  }
  CHECK(ferry_get_stats(buckets, &stats));
  EXPECT(stats.step == 12 && stats.skipped_steps == 0);
  EXPECT(stats.early_groups_kept > 0 && stats.early_groups_recomputed > 0);
  EXPECT(stats.deferred_steps == deferred); /* every deferrable step, the clipped ones too */
  EXPECT(stats.cpu_adam_busy_seconds > 0.0 && stats.cpu_adam_bytes > 0);
  EXPECT(stats.pinned_huge_bytes <= stats.pinned_bytes);
  EXPECT(stats.cpu_adam_spare_bytes <= stats.cpu_adam_bytes);
  /* The state later ran (all the offloaded fp32 grads' bytes kept: 4 B per element, in whole lines). */
  {
    int64_t numel = 0;
    for (int i = 0; i < NBUCKET; ++i) numel += kBucketNumel[i];
    EXPECT(stats.cpu_adam_later_bytes > 0 && stats.cpu_adam_later_bytes < stats.cpu_adam_bytes);
    EXPECT(stats.state_later_kept_bytes >= (uint64_t)(4 * numel) - 64);
    EXPECT(stats.state_later_kept_bytes <= (uint64_t)(4 * numel));
  }
  /* The spare state the announcements allocated: the offloaded group's fp32 state again (12 B per
   * element, offload_all), in whole pages; none for the engine that never announced. */
  {
    int64_t numel = 0;
    for (int i = 0; i < NBUCKET; ++i) numel += kBucketNumel[i];
    EXPECT(stats.spare_state_bytes >= (uint64_t)(12 * numel));
    EXPECT(stats.spare_state_bytes < (uint64_t)(12 * numel) + 2u * 1024 * 1024);
  }
  /* A caller built against an older header (its struct ends before spare_state_bytes) gets its
   * fields and nothing written past them; a newer one (a field this library lacks) gets it zeroed. */
  {
    enum { kOld = offsetof(ferry_stats, spare_state_bytes) };
    unsigned char older[kOld + 16];
    memset(older, 0xAB, sizeof(older));
    CHECK(ferry_get_stats_sized(buckets, older, kOld));
    EXPECT(memcmp(older, &stats, kOld) == 0);
    for (size_t i = kOld; i < sizeof(older); ++i) EXPECT(older[i] == 0xAB);
    struct {
      ferry_stats known;
      uint64_t future;
    } newer;
    memset(&newer, 0xAB, sizeof(newer));
    CHECK(ferry_get_stats_sized(buckets, &newer, sizeof(newer)));
    EXPECT(memcmp(&newer.known, &stats, sizeof(stats)) == 0 && newer.future == 0);
    EXPECT_ERROR(ferry_get_stats_sized(buckets, older, 4), FERRY_INVALID_ARGUMENT, "out_size is 4 bytes");
  }
  ferry_stats plain_stats;
  CHECK(ferry_get_stats(plain, &plain_stats));
  EXPECT(plain_stats.spare_state_bytes == 0 && plain_stats.step == 12);
  EXPECT(plain_stats.cpu_adam_later_bytes == 0 && plain_stats.state_later_kept_bytes == 0); /* "off" */
  EXPECT(ferry_stats_size() == sizeof(ferry_stats));
  CHECK(ferry_verify_masters(buckets));
  ferry_engine_destroy(buckets);
  ferry_engine_destroy(plain);
  free_bucket_model(&bm);
  free_bucket_model(&pm);
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: c_api_check DIR SOURCE_DIR\n");
    return 2;
  }
  const char* dir = argv[1];
  char root[4096], policy[4096], saved[4096], older[4096], loaded[4096], text[4096];
  snprintf(root, sizeof(root), "%s/ck", dir);
  snprintf(policy, sizeof(policy), "%s/scripts/policies/offload_all.lua", argv[2]);

  EXPECT(strlen(ferry_version()) > 0);
  model m;
  new_model(&m);
  ferry_engine* e = make_engine(&m, 0.0);

  /* The device and the placement listing, with every group's settings. */
  int on_gpu = -1;
  CHECK(ferry_device_info(e, text, sizeof(text), &on_gpu));
  EXPECT(on_gpu == 0 && strlen(text) > 0);
  size_t num_groups = 0;
  CHECK(ferry_num_groups(e, &num_groups));
  EXPECT(num_groups == NPARAMS);
  for (size_t g = 0; g < num_groups; ++g) {
    ferry_group_info info;
    CHECK(ferry_group_info_at(e, g, &info));
    EXPECT(strcmp(info.group, kGroups[g]) == 0);
    EXPECT(info.offloaded == 0 && info.num_params == 1 && info.numel == kNumel[g] && info.global_numel == kNumel[g]);
    EXPECT(info.lr_scale == (float)kSettings[g].lr_scale && info.weight_decay == (float)kSettings[g].weight_decay);
    EXPECT(info.beta1 == (float)kSettings[g].beta1 && info.beta2 == (float)kSettings[g].beta2);
    EXPECT(info.eps == (float)kSettings[g].eps && info.adamw == kSettings[g].adamw);
    /* No policy: fp32 master and moments on the GPU, 12 bytes per element of device memory. */
    EXPECT(info.master_dtype == FERRY_F32 && info.moments_dtype == FERRY_F32 && info.stochastic_rounding == 0);
    EXPECT(info.host_state_bytes == 0 && info.device_state_bytes == (uint64_t)(12 * kNumel[g]));
  }
  ferry_group_info none;
  EXPECT(ferry_group_info_at(e, num_groups, &none) != FERRY_OK);

  /* Steps with options: a schedule and a loss scale; stats report the unscaled grads' norm. */
  ferry_step_options so;
  ferry_step_options_init(&so);
  EXPECT(so.has_lr == 0 && so.loss_scale == 1.0f && so.max_grad_norm == 0.0f && so.check_finite == 1 &&
         so.wait_for_params == 1);
  {
    const char* unknown[] = {"no_such_group"};
    EXPECT_ERROR(ferry_grads_ready(e, unknown, 1, &so, NULL), FERRY_NOT_FOUND, "no parameter group 'no_such_group'");
    EXPECT_ERROR(ferry_grads_ready(e, NULL, 1, &so, NULL), FERRY_INVALID_ARGUMENT, "groups is NULL");
    EXPECT_ERROR(ferry_wait_params(e, unknown, 1, NULL), FERRY_NOT_FOUND, "no_such_group");
  }
  int t = 0;
  for (int step = 1; step <= 5; ++step) {
    const float scale = step % 2 == 0 ? 8.0f : 1.0f;
    const double norm = set_grads(&m, scale);
    so.has_lr = 1;
    so.lr = 0.01f * (1.0f + 0.1f * (float)step);
    so.loss_scale = scale;
    if (step >= 3) {
      /* Announced during "backward", in reverse order and over two calls: the same result. */
      CHECK(ferry_grads_ready(e, &kGroups[NPARAMS - 1], 1, &so, NULL));
      CHECK(ferry_grads_ready(e, kGroups, NPARAMS - 1, &so, NULL));
      EXPECT_ERROR(ferry_grads_ready(e, kGroups, 1, &so, NULL), FERRY_INVALID_ARGUMENT, "already announced");
      EXPECT_ERROR(ferry_verify_masters(e), FERRY_FAILED_PRECONDITION, "call Step first");
    }
    CHECK(ferry_step_with(e, &so, NULL));
    CHECK(ferry_synchronize(e));
    reference_step(&m, so.lr, ++t, scale);
    ferry_stats stats;
    CHECK(ferry_get_stats(e, &stats));
    EXPECT(stats.step == step && stats.skipped_steps == 0 && stats.last_step_skipped == 0);
    EXPECT(fabs(stats.last_grad_norm - norm) <= 1e-9 * norm);
  }
  expect_reference(&m);

  /* A NaN grad skips the whole step, reported in the stats; nothing changes. */
  float before = m.param[0][3];
  set_grads(&m, 1.0f);
  m.grad[1][2] = NAN;
  ferry_step_options_init(&so);
  CHECK(ferry_step_with(e, &so, NULL));
  CHECK(ferry_synchronize(e));
  ferry_stats stats;
  CHECK(ferry_get_stats(e, &stats));
  EXPECT(stats.skipped_steps == 1 && stats.last_step_skipped == 1 && stats.step == 5);
  EXPECT(m.param[0][3] == before);
  /* Clipping needs the finite check. */
  so.max_grad_norm = 1.0f;
  so.check_finite = 0;
  EXPECT_ERROR(ferry_step_with(e, &so, NULL), FERRY_INVALID_ARGUMENT, "max_grad_norm needs check_finite");
  /* A clipped step: the grads are scaled by max_norm / norm before the update. */
  const double norm = set_grads(&m, 1.0f);
  ferry_step_options_init(&so);
  so.max_grad_norm = (float)(norm / 4.0);
  CHECK(ferry_step_with(e, &so, NULL));  /* the configured lr */
  CHECK(ferry_synchronize(e));
  {
    const double coef = (double)so.max_grad_norm / (norm + 1e-6);
    for (int i = 0; i < NPARAMS; ++i) {
      for (int64_t k = 0; k < kNumel[i]; ++k) m.grad[i][k] = (float)(m.grad[i][k] * coef);
    }
    reference_step(&m, 0.01f, ++t, 1.0f);
  }
  /* (the reference's clipped grads are rounded to float: a looser tolerance for this one step) */
  for (int i = 0; i < NPARAMS; ++i) {
    for (int64_t k = 0; k < kNumel[i]; ++k) EXPECT(fabs(m.param[i][k] - m.ref_p[i][k]) <= 1e-5 * (1.0 + fabs(m.ref_p[i][k])));
  }

  /* Checkpoints: save twice; nothing in flight, so poll says done; wait reports OK. */
  CHECK(ferry_save_checkpoint(e, root, 6, older, sizeof(older)));
  set_grads(&m, 1.0f);
  CHECK(ferry_step(e, -1.0f, NULL));  /* the original entry point still works */
  CHECK(ferry_save_checkpoint(e, root, 7, saved, sizeof(saved)));
  int done = 0;
  CHECK(ferry_poll_checkpoint(e, &done));
  EXPECT(done == 1);
  CHECK(ferry_wait_checkpoint(e));

  /* Another engine whose bias group decays: loading reports the difference, keeps its setting. */
  model m2;
  new_model(&m2);
  ferry_engine* e2 = make_engine(&m2, 0.01);
  ferry_load_options lo;
  ferry_load_options_init(&lo);
  EXPECT(lo.fall_back_to_previous == 0);
  CHECK(ferry_load_checkpoint_with(e2, root, &lo, loaded, sizeof(loaded)));
  EXPECT(strcmp(loaded, saved) == 0);
  size_t count = 0;
  CHECK(ferry_load_differences(e2, text, sizeof(text), &count));
  EXPECT(count == 1);
  EXPECT(strcmp(text, "group 'bias': weight_decay 0 in the checkpoint, 0.01 in this engine") == 0);
  EXPECT_ERROR(ferry_load_differences(e2, text, 4, &count), FERRY_INVALID_ARGUMENT, "too small");
  for (int i = 0; i < NPARAMS; ++i) EXPECT(memcmp(m.param[i], m2.param[i], (size_t)kNumel[i] * sizeof(float)) == 0);
  ferry_group_info bias;
  CHECK(ferry_group_info_at(e2, 1, &bias));
  EXPECT(bias.weight_decay == 0.01f);

  /* The newest checkpoint truncated: refused, or (with fall_back_to_previous) the older one loads. */
  char file[4200];
  snprintf(file, sizeof(file), "%s/rank-00000.safetensors", saved);
  FILE* f = fopen(file, "r+b");
  EXPECT(f != NULL);
  fseek(f, 0, SEEK_END);
  const long size = ftell(f);
  fclose(f);
  EXPECT(truncate(file, size / 2) == 0);
  EXPECT(ferry_load_checkpoint_with(e2, root, &lo, loaded, sizeof(loaded)) == FERRY_DATA_LOSS);
  lo.fall_back_to_previous = 1;
  CHECK(ferry_load_checkpoint_with(e2, root, &lo, loaded, sizeof(loaded)));
  EXPECT(strcmp(loaded, older) == 0);

  /* Policy reload: every group offloaded, values unchanged; steps go on. */
  CHECK(ferry_reload_policy(e2, policy, NULL, NULL, 0));
  for (size_t g = 0; g < NPARAMS; ++g) {
    ferry_group_info info;
    CHECK(ferry_group_info_at(e2, g, &info));
    EXPECT(info.offloaded == 1 && strcmp(info.group, kGroups[g]) == 0);
  }
  set_grads(&m2, 1.0f);
  CHECK(ferry_step_with(e2, NULL, NULL));
  CHECK(ferry_verify_masters(e2));

  ferry_engine_destroy(e2);
  ferry_engine_destroy(e);
  free_model(&m2);
  free_model(&m);

  check_buckets(policy);
  check_group_values();
  printf("c_api_check: OK\n");
  return 0;
}
