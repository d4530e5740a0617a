/* Ferry's C ABI: opaque handles and status codes, for C trainers, LuaJIT's ffi and Python's ctypes.
 *
 * Every function returns a ferry_status (0 = OK; otherwise an absl::StatusCode value). The message of
 * the last failure on the calling thread is ferry_last_error(). Handles are used by one thread at a
 * time. Pointers to params and grads are device memory owned by the caller (see ferry/engine.h). */
#ifndef FERRY_C_FERRY_H_
#define FERRY_C_FERRY_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  FERRY_OK = 0,
  FERRY_UNKNOWN = 2,
  FERRY_INVALID_ARGUMENT = 3,
  FERRY_DEADLINE_EXCEEDED = 4,
  FERRY_NOT_FOUND = 5,
  FERRY_ALREADY_EXISTS = 6,
  FERRY_RESOURCE_EXHAUSTED = 8,
  FERRY_FAILED_PRECONDITION = 9,
  FERRY_UNIMPLEMENTED = 12,
  FERRY_INTERNAL = 13,
  FERRY_UNAVAILABLE = 14,
  FERRY_DATA_LOSS = 15
  /* any other absl::StatusCode value may also be returned */
} ferry_status;

typedef enum { FERRY_F32 = 0, FERRY_BF16 = 1, FERRY_F16 = 2 } ferry_dtype;

typedef struct ferry_engine ferry_engine;

/* ---- the trainer's collectives (ferry::CommCallbacks in ferry/comm.h) -----------------------------
 * A C trainer hands Ferry its own collectives (NCCL, gloo, MPI, ...) as functions. Every function
 * gets `user` back, the timeout in seconds (which it should honour), and a buffer `err` of `err_len`
 * bytes for a NUL-terminated message. It returns 0 on success; on failure a nonzero value (a
 * ferry_status code such as FERRY_DEADLINE_EXCEEDED or FERRY_UNAVAILABLE keeps its meaning; any other
 * nonzero value reads as FERRY_UNKNOWN) with a message naming what failed written to `err`.
 * Ferry calls the functions of one ferry_comm_callbacks from one thread at a time; `user` and the
 * functions must stay valid as long as the engine that uses them. */
typedef enum { FERRY_REDUCE_SUM = 0, FERRY_REDUCE_MAX = 1, FERRY_REDUCE_MIN = 2 } ferry_reduce_op;

typedef struct ferry_comm_callbacks ferry_comm_callbacks;
struct ferry_comm_callbacks {
  void* user;     /* passed back to every function */
  int rank;       /* this process's rank, in [0, world_size) */
  int world_size; /* >= 1 */
  /* Required. values[0..n) reduced element-wise across ranks, in place; op is a ferry_reduce_op. */
  int (*all_reduce)(void* user, double* values, size_t n, int op, double timeout_s, char* err, size_t err_len);
  /* Required. Every rank contributes `bytes` bytes (the same count on every rank); `out` receives
   * world_size * bytes, rank r's at out + r * bytes. */
  int (*all_gather)(void* user, const void* mine, size_t bytes, void* out, double timeout_s, char* err,
                    size_t err_len);
  /* Optional (NULL: built from all_reduce). */
  int (*barrier)(void* user, double timeout_s, char* err, size_t err_len);
  /* Optional (NULL: built from all_gather). The root's data[0..bytes) replaces every other rank's;
   * every rank passes the same `bytes`. */
  int (*broadcast)(void* user, void* data, size_t bytes, int root, double timeout_s, char* err, size_t err_len);
  /* Optional (NULL: Ferry cannot run collectives from a second thread). Collective: fills `out` with
   * callbacks over a new communicator of the same ranks, independent of this one's (for example
   * ncclCommSplit or MPI_Comm_dup), with the same rank and world_size. */
  int (*duplicate)(void* user, double timeout_s, ferry_comm_callbacks* out, char* err, size_t err_len);
};

typedef struct {
  const char* policy_path;              /* NULL or "": every group on the GPU */
  const char* const* policy_arg_keys;   /* num_policy_args strings */
  const char* const* policy_arg_values; /* num_policy_args strings */
  size_t num_policy_args;
  float lr, beta1, beta2, eps, weight_decay;
  int adamw;                            /* 1: decoupled decay (AdamW); 0: Adam with L2 */
  const char* device;                   /* NULL, "host" or "cuda" */
  size_t transfer_chunk_bytes;
  /* Several ranks (ferry::EngineOptions::comm): FERRY_COMM_SINGLE (the default), FERRY_COMM_MPI
   * (MPI_COMM_WORLD; rank and world_size are taken from it) or FERRY_COMM_CALLBACKS (the trainer's
   * collectives in comm_callbacks, copied at create; their functions and user must outlive the
   * engine). */
  int comm_kind;
  const ferry_comm_callbacks* comm_callbacks;
  double collective_timeout_s;          /* 0: the default (300 s) */
  double checkpoint_timeout_s;          /* 0: the default (3600 s) */
} ferry_engine_options;

enum { FERRY_COMM_SINGLE = 0, FERRY_COMM_MPI = 1, FERRY_COMM_CALLBACKS = 2 };

/* Fills `options` with the defaults of ferry::EngineOptions. */
void ferry_engine_options_init(ferry_engine_options* options);
/* sizeof(ferry_engine_options) in this library: bindings that mirror the struct (ctypes, LuaJIT's
 * FFI) check theirs against it. */
size_t ferry_engine_options_size(void);

/* The library's version, e.g. "0.1.0" (FERRY_VERSION_STRING of <ferry/version.h> when it was built).
 * Static storage; never NULL. */
const char* ferry_version(void);

/* The last error message of the calling thread ("" when none). Valid until the next ferry_ call. */
const char* ferry_last_error(void);

ferry_status ferry_engine_create(const ferry_engine_options* options, ferry_engine** out);
void ferry_engine_destroy(ferry_engine* engine); /* NULL is allowed */

/* `group` NULL or "" = the param's own name. */
ferry_status ferry_add_param(ferry_engine* engine, const char* name, const char* group, const int64_t* shape,
                             size_t ndim, ferry_dtype dtype, void* param, void* grad);
/* A local shard (several ranks): `shape` is the global shape, and this rank holds elements
 * [shard_begin, shard_end) of the flattened global tensor, which `param` and `grad` point to (NULL
 * allowed for an empty range). ferry_add_param is the whole tensor. */
ferry_status ferry_add_param_shard(ferry_engine* engine, const char* name, const char* group, const int64_t* shape,
                                   size_t ndim, ferry_dtype dtype, void* param, void* grad, int64_t shard_begin,
                                   int64_t shard_end);
/* Several ranks: this engine's rank and world size. */
ferry_status ferry_rank(ferry_engine* engine, int* rank, int* world_size);
ferry_status ferry_finalize(ferry_engine* engine);
/* lr < 0: the configured learning rate. stream: a cudaStream_t or NULL. */
ferry_status ferry_step(ferry_engine* engine, float lr, void* stream);
ferry_status ferry_synchronize(ferry_engine* engine);
/* Writes the committed directory into dir_out (dir_out_size bytes, NUL-terminated) when not NULL. */
ferry_status ferry_save_checkpoint(ferry_engine* engine, const char* root, int64_t step, char* dir_out,
                                   size_t dir_out_size);
ferry_status ferry_load_checkpoint(ferry_engine* engine, const char* path);
ferry_status ferry_sync_from_model(ferry_engine* engine, const char* const* groups, size_t num_groups,
                                   int reset_optimizer);
ferry_status ferry_verify_masters(ferry_engine* engine);
/* Hot reload between steps (ferry::Engine::ReloadPolicy): `num_args` key/value pairs; on error the
 * old policy and placement stay in force. */
ferry_status ferry_reload_policy(ferry_engine* engine, const char* path, const char* const* arg_keys,
                                 const char* const* arg_values, size_t num_args);
/* 1 when the group's optimizer state is offloaded to pinned host memory, 0 when on the GPU. */
ferry_status ferry_group_offloaded(ferry_engine* engine, const char* group, int* offloaded);

#ifdef __cplusplus
}
#endif

#endif /* FERRY_C_FERRY_H_ */
