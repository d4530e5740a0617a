/* A C11 trainer with several ranks through the C ABI: 3 threads, each a rank with its own engine whose
 * collectives are ferry_comm_callbacks implemented here over shared memory (as a C trainer would
 * plug in its own communication library). Each rank registers uneven shards of two params; after 6
 * steps every rank's shard equals the same elements of a one-rank engine trained on the same global
 * grads, bit for bit, and a checkpoint saved by the 3 ranks loads into the one-rank engine.
 * Usage: c_ranks_check DIR (a scratch directory). Exit status 0 on success. */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c/ferry.h"

#define WORLD 3
#define MAX_DOUBLES 64
#define MAX_BLOB (1 << 16)
#define STEPS 6

enum { W_NUMEL = 1001, B_NUMEL = 7 };

/* ---- the trainer's collectives: shared memory and a barrier ---- */
struct group {
  pthread_barrier_t barrier;
  double values[WORLD][MAX_DOUBLES];
  unsigned char blobs[WORLD][MAX_BLOB];
};

struct member {
  struct group* group;
  int rank;
};

static int all_reduce(void* user, double* values, size_t n, int op, double timeout_s, char* err, size_t err_len) {
  struct member* m = user;
  (void)timeout_s;
  if (n > MAX_DOUBLES) {
    snprintf(err, err_len, "all_reduce of %zu values: this test supports %d", n, MAX_DOUBLES);
    return FERRY_INVALID_ARGUMENT;
  }
  memcpy(m->group->values[m->rank], values, n * sizeof(double));
  pthread_barrier_wait(&m->group->barrier);
  for (size_t i = 0; i < n; ++i) {
    double acc = m->group->values[0][i];
    for (int r = 1; r < WORLD; ++r) {
      const double v = m->group->values[r][i];
      if (op == FERRY_REDUCE_SUM) acc += v;
      else if (op == FERRY_REDUCE_MAX) acc = v > acc ? v : acc;
      else acc = v < acc ? v : acc;
    }
    values[i] = acc;
  }
  pthread_barrier_wait(&m->group->barrier);
  return 0;
}

static int all_gather(void* user, const void* mine, size_t bytes, void* out, double timeout_s, char* err,
                      size_t err_len) {
  struct member* m = user;
  (void)timeout_s;
  if (bytes > MAX_BLOB) {
    snprintf(err, err_len, "all_gather of %zu bytes: this test supports %d", bytes, MAX_BLOB);
    return FERRY_INVALID_ARGUMENT;
  }
  if (bytes > 0) memcpy(m->group->blobs[m->rank], mine, bytes);
  pthread_barrier_wait(&m->group->barrier);
  for (int r = 0; r < WORLD; ++r) {
    if (bytes > 0) memcpy((unsigned char*)out + (size_t)r * bytes, m->group->blobs[r], bytes);
  }
  pthread_barrier_wait(&m->group->barrier);
  return 0;
}

/* ---- the global model: values a pure function of (seed, param, element) ---- */
static float value(uint64_t seed, int param, int64_t e) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)param << 40) ^ (uint64_t)e;
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  return (float)((double)(x >> 40) / (double)(1ull << 24) - 0.5);
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even; finite inputs only */
  return (uint16_t)(u >> 16);
}

struct shard {
  int64_t begin[2], end[2];
  uint16_t* w;  /* bf16 */
  uint16_t* gw;
  float* b;     /* f32 */
  float* gb;
};

static void fill(struct shard* s, int params, uint64_t seed) {
  for (int64_t e = s->begin[0]; e < s->end[0]; ++e) {
    uint16_t v = to_bf16(value(seed, 0, e));
    if (params) s->w[e - s->begin[0]] = v; else s->gw[e - s->begin[0]] = v;
  }
  for (int64_t e = s->begin[1]; e < s->end[1]; ++e) {
    float v = value(seed, 1, e);
    if (params) s->b[e - s->begin[1]] = v; else s->gb[e - s->begin[1]] = v;
  }
}

static void alloc_shard(struct shard* s) {
  const int64_t nw = s->end[0] - s->begin[0] > 0 ? s->end[0] - s->begin[0] : 1;
  const int64_t nb = s->end[1] - s->begin[1] > 0 ? s->end[1] - s->begin[1] : 1;
  s->w = calloc((size_t)nw, 2);
  s->gw = calloc((size_t)nw, 2);
  s->b = calloc((size_t)nb, 4);
  s->gb = calloc((size_t)nb, 4);
}

static void free_shard(struct shard* s) {
  free(s->w);
  free(s->gw);
  free(s->b);
  free(s->gb);
}

#define CHECK(call)                                                                        \
  do {                                                                                     \
    ferry_status st_ = (call);                                                             \
    if (st_ != FERRY_OK) {                                                                 \
      fprintf(stderr, "c_ranks_check: %s failed (%d): %s\n", #call, (int)st_, ferry_last_error()); \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

/* Creates an engine over `s`, trains STEPS steps; saves to `root` when not NULL. */
static int train(struct shard* s, const ferry_comm_callbacks* callbacks, const char* root, ferry_engine** out) {
  ferry_engine_options o;
  ferry_engine_options_init(&o);
  o.device = "host";
  o.lr = 0.01f;
  o.weight_decay = 0.01f;
  if (callbacks != NULL) {
    o.comm_kind = FERRY_COMM_CALLBACKS;
    o.comm_callbacks = callbacks;
  }
  ferry_engine* e = NULL;
  CHECK(ferry_engine_create(&o, &e));
  *out = e;
  const int64_t wshape[2] = {11, 91}, bshape[1] = {B_NUMEL};
  fill(s, 1, 1);
  CHECK(ferry_add_param_shard(e, "w", NULL, wshape, 2, FERRY_BF16, s->end[0] > s->begin[0] ? s->w : NULL,
                              s->end[0] > s->begin[0] ? s->gw : NULL, s->begin[0], s->end[0]));
  CHECK(ferry_add_param_shard(e, "b", NULL, bshape, 1, FERRY_F32, s->end[1] > s->begin[1] ? s->b : NULL,
                              s->end[1] > s->begin[1] ? s->gb : NULL, s->begin[1], s->end[1]));
  CHECK(ferry_finalize(e));
  for (int step = 1; step <= STEPS; ++step) {
    fill(s, 0, 100 + (uint64_t)step);
    CHECK(ferry_step(e, 0.01f / (float)step, NULL));
  }
  CHECK(ferry_synchronize(e));
  if (root != NULL) CHECK(ferry_save_checkpoint(e, root, STEPS, NULL, 0));
  return 0;
}

struct rank_args {
  struct member member;
  struct shard shard;
  const char* root;
  int result;
};

static void* rank_main(void* p) {
  struct rank_args* a = p;
  ferry_comm_callbacks c;
  memset(&c, 0, sizeof(c));
  c.user = &a->member;
  c.rank = a->member.rank;
  c.world_size = WORLD;
  c.all_reduce = all_reduce;
  c.all_gather = all_gather;
  ferry_engine* e = NULL;
  a->result = train(&a->shard, &c, a->root, &e);
  int rank = -1, world = -1;
  if (a->result == 0 && (ferry_rank(e, &rank, &world) != FERRY_OK || rank != a->member.rank || world != WORLD)) {
    fprintf(stderr, "c_ranks_check: ferry_rank says %d of %d\n", rank, world);
    a->result = 1;
  }
  ferry_engine_destroy(e);
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: c_ranks_check DIR\n");
    return 2;
  }
  char root[4096];
  snprintf(root, sizeof(root), "%s/c_ranks_ckpt", argv[1]);
  static struct group group;
  pthread_barrier_init(&group.barrier, NULL, WORLD);
  /* Uneven ranges; rank 1 holds none of "b". */
  const int64_t wcut[WORLD + 1] = {0, 400, 450, W_NUMEL}, bcut[WORLD + 1] = {0, 5, 5, B_NUMEL};
  struct rank_args ranks[WORLD];
  pthread_t threads[WORLD];
  for (int r = 0; r < WORLD; ++r) {
    memset(&ranks[r], 0, sizeof(ranks[r]));
    ranks[r].member.group = &group;
    ranks[r].member.rank = r;
    ranks[r].shard.begin[0] = wcut[r];
    ranks[r].shard.end[0] = wcut[r + 1];
    ranks[r].shard.begin[1] = bcut[r];
    ranks[r].shard.end[1] = bcut[r + 1];
    ranks[r].root = root;
    alloc_shard(&ranks[r].shard);
    pthread_create(&threads[r], NULL, rank_main, &ranks[r]);
  }
  for (int r = 0; r < WORLD; ++r) pthread_join(threads[r], NULL);
  int failed = 0;
  for (int r = 0; r < WORLD; ++r) failed |= ranks[r].result;
  if (failed) return 1;

  /* The one-rank reference on the same global grads. */
  struct shard whole = {{0, 0}, {W_NUMEL, B_NUMEL}, NULL, NULL, NULL, NULL};
  alloc_shard(&whole);
  ferry_engine* ref = NULL;
  if (train(&whole, NULL, NULL, &ref) != 0) return 1;
  int mismatches = 0;
  for (int r = 0; r < WORLD; ++r) {
    const struct shard* s = &ranks[r].shard;
    if (s->end[0] > s->begin[0] &&
        memcmp(s->w, whole.w + s->begin[0], (size_t)(s->end[0] - s->begin[0]) * 2) != 0) {
      fprintf(stderr, "c_ranks_check: rank %d's shard of 'w' differs from the one-rank run\n", r), ++mismatches;
    }
    if (s->end[1] > s->begin[1] &&
        memcmp(s->b, whole.b + s->begin[1], (size_t)(s->end[1] - s->begin[1]) * 4) != 0) {
      fprintf(stderr, "c_ranks_check: rank %d's shard of 'b' differs from the one-rank run\n", r), ++mismatches;
    }
  }
  /* The 3 ranks' checkpoint loads into the one-rank engine and gives back the same params. */
  uint16_t w_before[W_NUMEL];
  memcpy(w_before, whole.w, sizeof(w_before));
  memset(whole.w, 0, sizeof(w_before));
  CHECK(ferry_load_checkpoint(ref, root));
  if (memcmp(whole.w, w_before, sizeof(w_before)) != 0) {
    fprintf(stderr, "c_ranks_check: the 3-rank checkpoint loaded other params into one rank\n"), ++mismatches;
  }
  ferry_engine_destroy(ref);
  for (int r = 0; r < WORLD; ++r) free_shard(&ranks[r].shard);
  free_shard(&whole);
  pthread_barrier_destroy(&group.barrier);
  if (mismatches == 0) printf("c_ranks_check: 3 ranks over C callbacks equal one rank, and the checkpoint loads\n");
  return mismatches == 0 ? 0 : 1;
}
