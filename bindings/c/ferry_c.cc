#include "c/ferry.h"
#include "c/c_comm.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ferry/engine.h"
#include "ferry/version.h"

struct ferry_engine {
  std::unique_ptr<ferry::Engine> engine;
  int rank = 0;
  int world_size = 1;
};

namespace {

thread_local std::string last_error;

ferry_status Report(const absl::Status& s) {
  last_error = s.ok() ? std::string() : std::string(s.message());
  return static_cast<ferry_status>(s.code());
}

ferry_status NullHandle(const char* fn) {
  last_error = std::string(fn) + ": engine handle is NULL";
  return FERRY_INVALID_ARGUMENT;
}

}  // namespace

extern "C" {

void ferry_engine_options_init(ferry_engine_options* o) {
  ferry::EngineOptions d;
  std::memset(o, 0, sizeof(*o));
  o->lr = d.optimizer.lr;
  o->beta1 = d.optimizer.beta1;
  o->beta2 = d.optimizer.beta2;
  o->eps = d.optimizer.eps;
  o->weight_decay = d.optimizer.weight_decay;
  o->adamw = d.optimizer.adamw ? 1 : 0;
  o->transfer_chunk_bytes = d.transfer_chunk_bytes;
}

const char* ferry_version(void) { return FERRY_VERSION_STRING; }

size_t ferry_engine_options_size(void) { return sizeof(ferry_engine_options); }

const char* ferry_last_error(void) { return last_error.c_str(); }

ferry_status ferry_engine_create(const ferry_engine_options* options, ferry_engine** out) {
  if (options == nullptr || out == nullptr) {
    return Report(absl::InvalidArgumentError("ferry_engine_create: options and out must not be NULL"));
  }
  *out = nullptr;
  ferry::EngineOptions o;
  if (options->policy_path != nullptr) o.policy_path = options->policy_path;
  for (size_t i = 0; i < options->num_policy_args; ++i) {
    if (options->policy_arg_keys == nullptr || options->policy_arg_values == nullptr ||
        options->policy_arg_keys[i] == nullptr || options->policy_arg_values[i] == nullptr) {
      return Report(absl::InvalidArgumentError("ferry_engine_create: policy argument " + std::to_string(i) + " is NULL"));
    }
    o.policy_args[options->policy_arg_keys[i]] = options->policy_arg_values[i];
  }
  o.optimizer.lr = options->lr;
  o.optimizer.beta1 = options->beta1;
  o.optimizer.beta2 = options->beta2;
  o.optimizer.eps = options->eps;
  o.optimizer.weight_decay = options->weight_decay;
  o.optimizer.adamw = options->adamw != 0;
  if (options->device != nullptr) o.device = options->device;
  if (options->transfer_chunk_bytes != 0) o.transfer_chunk_bytes = options->transfer_chunk_bytes;
  if (options->collective_timeout_s > 0) o.collective_timeout = absl::Seconds(options->collective_timeout_s);
  if (options->checkpoint_timeout_s > 0) o.checkpoint_timeout = absl::Seconds(options->checkpoint_timeout_s);
  switch (options->comm_kind) {
    case FERRY_COMM_SINGLE:
      break;
    case FERRY_COMM_MPI: {
      absl::StatusOr<std::unique_ptr<ferry::Comm>> comm = ferry::MakeMpiComm();
      if (!comm.ok()) return Report(comm.status());
      o.comm = std::move(*comm);
      break;
    }
    case FERRY_COMM_CALLBACKS: {
      if (options->comm_callbacks == nullptr) {
        return Report(absl::InvalidArgumentError("ferry_engine_create: comm_kind is FERRY_COMM_CALLBACKS but comm_callbacks is NULL"));
      }
      absl::StatusOr<std::unique_ptr<ferry::Comm>> comm = ferry::CommFromCallbacks(*options->comm_callbacks);
      if (!comm.ok()) return Report(comm.status());
      o.comm = std::move(*comm);
      break;
    }
    default:
      return Report(absl::InvalidArgumentError("ferry_engine_create: unknown comm_kind " +
                                               std::to_string(options->comm_kind)));
  }
  if (o.comm != nullptr) {
    o.rank = o.comm->rank();
    o.world_size = o.comm->world_size();
  }
  absl::StatusOr<std::unique_ptr<ferry::Engine>> e = ferry::Engine::Create(o);
  if (!e.ok()) return Report(e.status());
  *out = new ferry_engine{*std::move(e), o.rank, o.world_size};
  return Report(absl::OkStatus());
}

void ferry_engine_destroy(ferry_engine* engine) { delete engine; }

ferry_status ferry_add_param(ferry_engine* engine, const char* name, const char* group, const int64_t* shape,
                             size_t ndim, ferry_dtype dtype, void* param, void* grad) {
  return ferry_add_param_shard(engine, name, group, shape, ndim, dtype, param, grad, 0, -1);
}

ferry_status ferry_rank(ferry_engine* engine, int* rank, int* world_size) {
  if (engine == nullptr) return NullHandle("ferry_rank");
  if (rank == nullptr || world_size == nullptr) {
    return Report(absl::InvalidArgumentError("ferry_rank: rank and world_size must not be NULL"));
  }
  *rank = engine->rank;
  *world_size = engine->world_size;
  return Report(absl::OkStatus());
}

ferry_status ferry_add_param_shard(ferry_engine* engine, const char* name, const char* group, const int64_t* shape,
                                   size_t ndim, ferry_dtype dtype, void* param, void* grad, int64_t shard_begin,
                                   int64_t shard_end) {
  if (engine == nullptr) return NullHandle("ferry_add_param");
  if (name == nullptr || (shape == nullptr && ndim > 0)) {
    return Report(absl::InvalidArgumentError("ferry_add_param: name and shape must not be NULL"));
  }
  if (dtype != FERRY_F32 && dtype != FERRY_BF16 && dtype != FERRY_F16) {
    return Report(absl::InvalidArgumentError(std::string("ferry_add_param('") + name + "'): unknown dtype " +
                                             std::to_string(static_cast<int>(dtype))));
  }
  ferry::ParamSpec spec;
  spec.name = name;
  if (group != nullptr) spec.group = group;
  spec.shape.assign(shape, shape + ndim);
  spec.dtype = static_cast<ferry::DType>(dtype);
  spec.param = param;
  spec.grad = grad;
  spec.shard_begin = shard_begin;
  spec.shard_end = shard_end;
  return Report(engine->engine->AddParam(spec));
}

ferry_status ferry_finalize(ferry_engine* engine) {
  if (engine == nullptr) return NullHandle("ferry_finalize");
  return Report(engine->engine->Finalize());
}

ferry_status ferry_step(ferry_engine* engine, float lr, void* stream) {
  if (engine == nullptr) return NullHandle("ferry_step");
  ferry::StepOptions so;
  if (lr >= 0) so.lr = lr;
  return Report(engine->engine->Step(so, stream));
}

ferry_status ferry_synchronize(ferry_engine* engine) {
  if (engine == nullptr) return NullHandle("ferry_synchronize");
  return Report(engine->engine->Synchronize());
}

ferry_status ferry_save_checkpoint(ferry_engine* engine, const char* root, int64_t step, char* dir_out,
                                   size_t dir_out_size) {
  if (engine == nullptr) return NullHandle("ferry_save_checkpoint");
  if (root == nullptr) return Report(absl::InvalidArgumentError("ferry_save_checkpoint: root is NULL"));
  absl::StatusOr<std::string> dir = engine->engine->SaveCheckpoint(root, step);
  if (!dir.ok()) return Report(dir.status());
  if (dir_out != nullptr && dir_out_size > 0) {
    if (dir->size() + 1 > dir_out_size) {
      return Report(absl::InvalidArgumentError("ferry_save_checkpoint: saved to " + *dir +
                                               ", but dir_out is too small for the path"));
    }
    std::memcpy(dir_out, dir->c_str(), dir->size() + 1);
  }
  return Report(absl::OkStatus());
}

ferry_status ferry_load_checkpoint(ferry_engine* engine, const char* path) {
  if (engine == nullptr) return NullHandle("ferry_load_checkpoint");
  if (path == nullptr) return Report(absl::InvalidArgumentError("ferry_load_checkpoint: path is NULL"));
  return Report(engine->engine->LoadCheckpoint(path));
}

ferry_status ferry_sync_from_model(ferry_engine* engine, const char* const* groups, size_t num_groups,
                                   int reset_optimizer) {
  if (engine == nullptr) return NullHandle("ferry_sync_from_model");
  std::vector<std::string> names;
  for (size_t i = 0; i < num_groups; ++i) {
    if (groups == nullptr || groups[i] == nullptr) {
      return Report(absl::InvalidArgumentError("ferry_sync_from_model: group " + std::to_string(i) + " is NULL"));
    }
    names.emplace_back(groups[i]);
  }
  return Report(engine->engine->SyncFromModel(names, reset_optimizer != 0));
}

ferry_status ferry_verify_masters(ferry_engine* engine) {
  if (engine == nullptr) return NullHandle("ferry_verify_masters");
  return Report(engine->engine->VerifyMasters());
}

ferry_status ferry_reload_policy(ferry_engine* engine, const char* path, const char* const* arg_keys,
                                 const char* const* arg_values, size_t num_args) {
  if (engine == nullptr) return NullHandle("ferry_reload_policy");
  if (path == nullptr) return Report(absl::InvalidArgumentError("ferry_reload_policy: path is NULL"));
  std::map<std::string, std::string> args;
  for (size_t i = 0; i < num_args; ++i) {
    if (arg_keys == nullptr || arg_values == nullptr || arg_keys[i] == nullptr || arg_values[i] == nullptr) {
      return Report(absl::InvalidArgumentError("ferry_reload_policy: argument " + std::to_string(i) + " is NULL"));
    }
    args[arg_keys[i]] = arg_values[i];
  }
  return Report(engine->engine->ReloadPolicy(path, args));
}

ferry_status ferry_group_offloaded(ferry_engine* engine, const char* group, int* offloaded) {
  if (engine == nullptr) return NullHandle("ferry_group_offloaded");
  if (group == nullptr || offloaded == nullptr) {
    return Report(absl::InvalidArgumentError("ferry_group_offloaded: group and offloaded must not be NULL"));
  }
  for (const ferry::GroupPlacement& g : engine->engine->Placement()) {
    if (g.group == group) {
      *offloaded = g.offloaded ? 1 : 0;
      return Report(absl::OkStatus());
    }
  }
  return Report(absl::NotFoundError(std::string("ferry_group_offloaded: no group '") + group + "'"));
}

}  // extern "C"
