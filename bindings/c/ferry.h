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
  /* The rest of ferry::EngineOptions (engine/include/ferry/engine.h says what each does), appended after
   * the fields above; ferry_engine_options_init gives each the engine's default. */
  int bias_correction;                  /* 1: Adam's bias correction (the default); 0: none */
  int device_ordinal;                   /* the CUDA device, >= 0 (0) */
  size_t cpu_threads;                   /* CPU Adam's workers; 0: this rank's share of the host, less the trainer's */
  size_t trainer_threads;               /* CPUs of the share left to the trainer's threads (1) */
  size_t cpu_threads_max;               /* the most workers cpu_threads = 0 takes; 0: FERRY_CPU_THREADS_MAX,
                                         * else measured */
  double spare_state_fraction;          /* the early steps' spare state, a fraction in [0, 1] of the offloaded
                                         * state (1) */
  const char* state_later;              /* NULL or "": FERRY_STATE_LATER, else off; "off", "auto" or a fraction
                                         * in (0, 1] */
  int local_rank, local_world_size;     /* this process among the ranks on its host; -1, -1: the launcher's
                                         * environment */
  int pin_cpu_threads;                  /* workers held to the rank's CPUs: -1 the engine's rule, 0 never, 1 always */
  int pin_trainer_threads;              /* the process's other threads held to them: -1, 0 or 1, as above */
  const char* numa;                     /* NULL or "": the engine's choice; "interleave", "bind", "preferred",
                                         * "local" */
  const char* trace_path;               /* NULL or "": FERRY_TRACE, else no trace */
} ferry_engine_options;

enum { FERRY_COMM_SINGLE = 0, FERRY_COMM_MPI = 1, FERRY_COMM_CALLBACKS = 2 };

/* Fills `options` with the defaults of ferry::EngineOptions. */
void ferry_engine_options_init(ferry_engine_options* options);
/* sizeof(ferry_engine_options) in this library. Its fields are only ever appended, never reordered or
 * removed. Code that may meet a newer library than its header (a binary built once, bindings that
 * mirror the struct: ctypes, LuaJIT's FFI) passes the size of its own struct to the _sized calls: the
 * library reads and writes that many bytes (the fields the caller knows) and gives every later field its
 * default. init_sized zeroes what it has no field for; create_sized refuses a struct larger than the
 * library's (fields it does not know would be ignored) and one shorter than the fields up to
 * checkpoint_timeout_s. */
size_t ferry_engine_options_size(void);
void ferry_engine_options_init_sized(void* options, size_t options_size);

/* The library's version, e.g. "0.1.0" (FERRY_VERSION_STRING of <ferry/version.h> when it was built).
 * Static storage; never NULL. */
const char* ferry_version(void);

/* The last error message of the calling thread ("" when none). Valid until the next ferry_ call. */
const char* ferry_last_error(void);

ferry_status ferry_engine_create(const ferry_engine_options* options, ferry_engine** out);
ferry_status ferry_engine_create_sized(const void* options, size_t options_size, ferry_engine** out);
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

/* ---- per-group optimizer settings (ferry::Engine::AddGroup) ----------------------------------------
 * Gives group `group` its own settings, by name: `num_options` pairs of keys[i] (one of "lr_scale",
 * "weight_decay", "beta1", "beta2", "eps", "adamw" (0 or 1)) and values[i]; unset ones take the
 * engine's (ferry_engine_options). Before ferry_finalize; its params may be added before or after.
 * An unknown key, a value out of range (negative weight decay or lr_scale, betas outside [0, 1), eps
 * not > 0) or a group given twice: an error, and nothing changed. */
ferry_status ferry_add_group(ferry_engine* engine, const char* group, const char* const* keys, const double* values,
                             size_t num_options);

/* ---- stepping with options (ferry::StepOptions) -------------------------------------------------- */
typedef struct {
  int has_lr;          /* 1: `lr` is this step's learning rate; 0: the configured one */
  float lr;            /* the global schedule; every group's lr_scale multiplies it */
  float loss_scale;    /* the grads carry this loss scale (> 0, finite); default 1 */
  float max_grad_norm; /* > 0: clip the global L2 norm of the unscaled grads to this; default 0 (off) */
  int check_finite;    /* 1 (default): a NaN/Inf grad skips the whole step (see ferry_stats) */
  int wait_for_params; /* 1 (default): the stream waits in the step for every new param; 0: call
                          ferry_wait_params before each group's params are used */
  /* This step's own values of some groups (ferry::StepOptions::group_lr, group_betas,
   * group_weight_decay), for schedulers: the `num_groups` groups named in `group_names`, and for
   * group_names[i] entry i of each array that is not NULL; a NaN entry (or a NULL array) keeps that
   * value as configured. group_lr replaces the global lr times the group's lr_scale; a group given
   * one beta keeps its other one. Errors (nothing stepped): an unknown or repeated group, a value
   * out of its range (as ferry_add_group's). Default: none. */
  const char* const* group_names;
  size_t num_groups;
  const float* group_lr;
  const float* group_beta1;
  const float* group_beta2;
  const float* group_weight_decay;
} ferry_step_options;

/* Fills `options` with the defaults of ferry::StepOptions. */
void ferry_step_options_init(ferry_step_options* options);
/* One step with `options` (NULL: the defaults). stream: a cudaStream_t or NULL. */
ferry_status ferry_step_with(ferry_engine* engine, const ferry_step_options* options, void* stream);

/* ---- starting the step during backward (ferry::Engine::GradsReady, WaitParams) ------------------
 * ferry_grads_ready: the grads of the `num_groups` groups named in `groups` are final on `stream`
 * (and the backward no longer reads their params); `options` (NULL: the defaults) are the coming
 * step's. Their step starts at once in the background; the next ferry_step / ferry_step_with keeps
 * or recomputes it so that the result is bit-identical to a step without this call. Errors (nothing
 * started): an unknown group, a group announced twice in one step, no groups. Between this call and
 * the step, saves, loads, syncs, policy reloads and ferry_verify_masters are refused.
 * ferry_wait_params: after a step with wait_for_params = 0, makes `stream` wait for the new params
 * of the named groups (all when num_groups is 0). */
ferry_status ferry_grads_ready(ferry_engine* engine, const char* const* groups, size_t num_groups,
                               const ferry_step_options* options, void* stream);
ferry_status ferry_wait_params(ferry_engine* engine, const char* const* groups, size_t num_groups, void* stream);

/* ---- the same per param: buckets (ferry::Engine::GradsReadyParams, WaitParamsOf) ----------------
 * ferry_grads_ready_params: ferry_grads_ready for the `num_params` params named in `params` (of any
 * groups): their grads are final on `stream`, and their part of the offloaded update starts at once,
 * as a group's would. So a trainer with one group (or two: decay and no decay) still overlaps the
 * update with its backward, announcing buckets of params as the backward finishes them: a few to
 * tens of MiB of grads each, since every announcement costs an event and at least one pipeline chunk.
 * A group is announced once all its params are; at the step, the rest of a group announced in part
 * starts too. Bit-identical to a step without this call, with the same contract (the announced grads
 * stay unchanged until the step) and the same errors: an unknown param (FERRY_NOT_FOUND), a param
 * announced twice in one step or no params (FERRY_INVALID_ARGUMENT); nothing started then.
 * ferry_wait_params_of: after a step with wait_for_params = 0, makes `stream` wait for the new values
 * of the named params only: the part of the update holding each (its announcement, or the rest of
 * its group that the step started), not its whole group, so the first layers' forward can start while
 * the last ones still update. num_params 0 waits for nothing (ferry_wait_params with no groups waits
 * for all). Errors: an unknown param (FERRY_NOT_FOUND), a call between an announcement and its step
 * (FERRY_FAILED_PRECONDITION). */
ferry_status ferry_grads_ready_params(ferry_engine* engine, const char* const* params, size_t num_params,
                                      const ferry_step_options* options, void* stream);
ferry_status ferry_wait_params_of(ferry_engine* engine, const char* const* params, size_t num_params, void* stream);

/* ---- stats (ferry::EngineStats) ------------------------------------------------------------------
 * Fields are only ever appended, never reordered or removed; ferry_stats_size() is sizeof(ferry_stats)
 * in this library. ferry_get_stats fills a ferry_stats of this header's size. Code that may meet a
 * newer library than its header (a binary built once, bindings that mirror the struct: ctypes,
 * LuaJIT's FFI) calls ferry_get_stats_sized with the size of its own struct: the library writes that
 * many bytes (the fields the caller knows) and no more, and zeroes what it has no field for. */
typedef struct {
  int64_t step;                 /* optimizer steps taken */
  int64_t skipped_steps;        /* steps skipped because a grad was NaN/Inf */
  int last_step_skipped;        /* 1 when the last step was skipped */
  double last_grad_norm;        /* global L2 norm of the unscaled grads at the last checked step */
  uint64_t host_registrations;
  uint64_t pinned_host_calls;
  uint64_t pinned_bytes;        /* pinned host memory reserved */
  uint64_t gpu_state_bytes;     /* device memory held for GPU groups' state (master, m, v) */
  uint64_t checkpoint_copied_aside_bytes;
  int64_t early_groups_kept;       /* ferry_grads_ready: early group updates the step kept */
  int64_t early_groups_recomputed; /* ... and recomputed (clipping triggered, other options) */
  int64_t deferred_steps;          /* steps that returned before their offloaded update finished */
  /* pinned bytes of the early steps' spare state (ferry::EngineStats::spare_state_bytes): allocated at
   * the first ferry_grads_ready / ferry_grads_ready_params that needs it; 0 before */
  uint64_t spare_state_bytes;
  /* the offloaded update's CPU Adam over all steps (ferry::EngineStats::cpu_adam_busy_seconds): the
   * wall time its rounds ran, and the bytes they read and wrote */
  double cpu_adam_busy_seconds;
  uint64_t cpu_adam_bytes;
  /* of pinned_bytes, those huge pages back (ferry::EngineStats::pinned_huge_bytes) */
  uint64_t pinned_huge_bytes;
  /* of cpu_adam_bytes, those of early steps' speculative updates into the spare state (out of place;
   * ferry::EngineStats::cpu_adam_spare_bytes) */
  uint64_t cpu_adam_spare_bytes;
  /* of cpu_adam_bytes, those of the rounds that wrote the state after its params (the state later;
   * ferry::EngineStats::cpu_adam_later_bytes) */
  uint64_t cpu_adam_later_bytes;
  /* the state later's kept grads' buffer (host memory) and the bytes of it a cycle may stage now
   * ("auto": the limit measured so far); 0 when it is off
   * (ferry::EngineStats::state_later_kept_bytes, state_later_limit_bytes) */
  uint64_t state_later_kept_bytes;
  uint64_t state_later_limit_bytes;
  /* this rank's share of its host (ferry::EngineStats, engine/EMBEDDING.md "Big hosts and ranks that
   * share a host"): its place among the local ranks, CPU Adam's workers, the pipeline's chunk, the
   * process's pinned budget, and the NUMA node of the offloaded state's pages (-1: not bound) */
  int32_t local_rank;
  int32_t local_world_size;
  uint64_t cpu_threads;
  uint64_t transfer_chunk_bytes;
  uint64_t pinned_limit_bytes;
  int32_t numa_node;
} ferry_stats;

ferry_status ferry_get_stats(ferry_engine* engine, ferry_stats* out);
ferry_status ferry_get_stats_sized(ferry_engine* engine, void* out, size_t out_size);
size_t ferry_stats_size(void);

/* ---- placement listing (ferry::Engine::Placement) ------------------------------------------------ */
typedef struct {
  const char* group;     /* valid as long as the engine */
  int offloaded;         /* 1: master and moments in pinned host memory; 0: on the GPU */
  int64_t numel;         /* elements this rank holds */
  int64_t num_params;
  int64_t global_numel;
  /* the group's optimizer settings (ferry_add_group's, else the engine's) */
  float lr_scale, weight_decay, beta1, beta2, eps;
  int adamw;
  /* the precision of its state, as the policy's place() chose (FERRY_F32 or FERRY_BF16) */
  ferry_dtype master_dtype;
  ferry_dtype moments_dtype;
  int stochastic_rounding;      /* 1: bf16 state rounded stochastically (deterministic); 0: nearest even */
  uint64_t host_state_bytes;    /* bytes of its state in pinned host memory (offloaded), else 0 */
  uint64_t device_state_bytes;  /* bytes of its state in device memory (on the GPU), else 0 */
} ferry_group_info;

/* The number of parameter groups, in order of first appearance. */
ferry_status ferry_num_groups(ferry_engine* engine, size_t* num_groups);
/* Group `index` (< ferry_num_groups). */
ferry_status ferry_group_info_at(ferry_engine* engine, size_t index, ferry_group_info* out);

/* ---- asynchronous checkpoints (ferry::Engine::WaitCheckpoint, PollCheckpoint) --------------------
 * ferry_wait_checkpoint blocks until the save in flight (if any) committed and returns the error of a
 * finished save not yet reported (once). ferry_poll_checkpoint does not block: *done = 0 (and OK)
 * while a save is in flight; else *done = 1 and it returns what ferry_wait_checkpoint would. */
ferry_status ferry_wait_checkpoint(ferry_engine* engine);
ferry_status ferry_poll_checkpoint(ferry_engine* engine, int* done);

/* ---- loading with options (ferry::LoadOptions, ferry::LoadReport) -------------------------------- */
typedef struct {
  int fall_back_to_previous; /* 1: a corrupt or incomplete checkpoint loads the newest older one that verifies */
} ferry_load_options;

void ferry_load_options_init(ferry_load_options* options);
/* Loads `path` with `options` (NULL: the defaults); writes the directory loaded into dir_out
 * (dir_out_size bytes, NUL-terminated) when not NULL. */
ferry_status ferry_load_checkpoint_with(ferry_engine* engine, const char* path, const ferry_load_options* options,
                                        char* dir_out, size_t dir_out_size);
/* The optimizer settings the last successful load found recorded differently from the engine's, one
 * line each ("group 'bias': weight_decay 0 in the checkpoint, 0.01 in this engine"), joined by '\n'
 * into out (out_size bytes, NUL-terminated; "" when none). *count (when not NULL) gets the number of
 * lines. FERRY_INVALID_ARGUMENT when out is too small. */
ferry_status ferry_load_differences(ferry_engine* engine, char* out, size_t out_size, size_t* count);

/* ---- the device ---------------------------------------------------------------------------------- */
/* The device in words into name_out (NUL-terminated) when not NULL; *on_gpu (when not NULL) = 1 on the
 * CUDA backend, 0 on the host backend. */
ferry_status ferry_device_info(ferry_engine* engine, char* name_out, size_t name_out_size, int* on_gpu);
/* This rank's share of its host in words (ferry::EngineStats::cpu_list and host_share), each
 * NUL-terminated when its buffer is not NULL: the CPUs CPU Adam's workers are held to ("0-15,32-47";
 * "" when they are not held), and how the share and the worker count were chosen. The numbers are in
 * ferry_stats. FERRY_INVALID_ARGUMENT when a buffer is too small. */
ferry_status ferry_host_share(ferry_engine* engine, char* cpus_out, size_t cpus_out_size, char* reason_out,
                              size_t reason_out_size);

#ifdef __cplusplus
}
#endif

#endif /* FERRY_C_FERRY_H_ */
