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
  FERRY_INVALID_ARGUMENT = 3,
  FERRY_NOT_FOUND = 5,
  FERRY_ALREADY_EXISTS = 6,
  FERRY_RESOURCE_EXHAUSTED = 8,
  FERRY_FAILED_PRECONDITION = 9,
  FERRY_INTERNAL = 13,
  FERRY_DATA_LOSS = 15
  /* any other absl::StatusCode value may also be returned */
} ferry_status;

typedef enum { FERRY_F32 = 0, FERRY_BF16 = 1, FERRY_F16 = 2 } ferry_dtype;

typedef struct ferry_engine ferry_engine;

typedef struct {
  const char* policy_path;              /* NULL or "": every group on the GPU */
  const char* const* policy_arg_keys;   /* num_policy_args strings */
  const char* const* policy_arg_values; /* num_policy_args strings */
  size_t num_policy_args;
  float lr, beta1, beta2, eps, weight_decay;
  int adamw;                            /* 1: decoupled decay (AdamW); 0: Adam with L2 */
  const char* device;                   /* NULL, "host" or "cuda" */
  size_t transfer_chunk_bytes;
} ferry_engine_options;

/* Fills `options` with the defaults of ferry::EngineOptions. */
void ferry_engine_options_init(ferry_engine_options* options);

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
