#include "c/ferry.h"
#include "c/c_comm.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/version.h"

struct ferry_engine {
  std::unique_ptr<ferry::Engine> engine;
  int rank = 0;
  int world_size = 1;
  // The group names handed out by ferry_group_info_at (a deque: appending never moves one).
  std::deque<std::string> group_names;
  // Each group's own (beta1, beta2), read once from Placement() at the first step given one beta of a
  // group (ferry_step_options): the other one comes from here.
  std::map<std::string, std::pair<float, float>> betas;
};

namespace {

thread_local std::string last_error;

ferry_status Report(const absl::Status& s) {
  last_error = s.ok() ? std::string() : std::string(s.message());
  return static_cast<ferry_status>(s.code());
}

// The ferry_engine_options of the oldest layout this library reads: its fields up to checkpoint_timeout_s.
constexpr size_t kOldestOptionsSize = offsetof(ferry_engine_options, bias_correction);

ferry_status NullHandle(const char* fn) {
  last_error = std::string(fn) + ": engine handle is NULL";
  return FERRY_INVALID_ARGUMENT;
}

// Copies `text` NUL-terminated into out[0..size) (when out is not NULL).
absl::Status CopyOut(const char* fn, const std::string& text, char* out, size_t size) {
  if (out == nullptr) return absl::OkStatus();
  if (text.size() + 1 > size) {
    return absl::InvalidArgumentError(std::string(fn) + ": the buffer of " + std::to_string(size) + " bytes is too small for " +
                                      std::to_string(text.size() + 1) + " bytes");
  }
  std::memcpy(out, text.c_str(), text.size() + 1);
  return absl::OkStatus();
}

}  // namespace

extern "C" {

void ferry_engine_options_init(ferry_engine_options* o) { ferry_engine_options_init_sized(o, sizeof(*o)); }

void ferry_engine_options_init_sized(void* options, size_t options_size) {
  if (options == nullptr) return;
  const ferry::EngineOptions d;
  ferry_engine_options o;
  std::memset(&o, 0, sizeof(o));
  o.lr = d.optimizer.lr;
  o.beta1 = d.optimizer.beta1;
  o.beta2 = d.optimizer.beta2;
  o.eps = d.optimizer.eps;
  o.weight_decay = d.optimizer.weight_decay;
  o.adamw = d.optimizer.adamw ? 1 : 0;
  o.transfer_chunk_bytes = d.transfer_chunk_bytes;
  o.bias_correction = d.optimizer.bias_correction ? 1 : 0;
  o.device_ordinal = d.device_ordinal;
  o.cpu_threads = d.cpu_threads;
  o.trainer_threads = d.trainer_threads;
  o.cpu_threads_max = d.cpu_threads_max;
  o.spare_state_fraction = d.spare_state_fraction;
  o.local_rank = d.local_rank;
  o.local_world_size = d.local_world_size;
  o.pin_cpu_threads = d.pin_cpu_threads;
  o.pin_trainer_threads = d.pin_trainer_threads;
  std::memcpy(options, &o, std::min(options_size, sizeof(o)));
  if (options_size > sizeof(o)) std::memset(static_cast<char*>(options) + sizeof(o), 0, options_size - sizeof(o));
}

const char* ferry_version(void) { return FERRY_VERSION_STRING; }

size_t ferry_engine_options_size(void) { return sizeof(ferry_engine_options); }

size_t ferry_stats_size(void) { return sizeof(ferry_stats); }

const char* ferry_last_error(void) { return last_error.c_str(); }

ferry_status ferry_engine_create(const ferry_engine_options* options, ferry_engine** out) {
  return ferry_engine_create_sized(options, sizeof(ferry_engine_options), out);
}

ferry_status ferry_engine_create_sized(const void* options_bytes, size_t options_size, ferry_engine** out) {
  if (options_bytes == nullptr || out == nullptr) {
    return Report(absl::InvalidArgumentError("ferry_engine_create: options and out must not be NULL"));
  }
  *out = nullptr;
  if (options_size < kOldestOptionsSize || options_size > sizeof(ferry_engine_options)) {
    return Report(absl::InvalidArgumentError(absl::StrCat(
        "ferry_engine_create_sized: options_size is ", options_size,
        " bytes; this library reads a ferry_engine_options of ", kOldestOptionsSize,
        " (its fields up to checkpoint_timeout_s) to ", sizeof(ferry_engine_options),
        " bytes (all of them): a larger one is from a newer header than this library's")));
  }
  ferry_engine_options full;  // the fields the caller's struct lacks keep their defaults
  ferry_engine_options_init(&full);
  std::memcpy(&full, options_bytes, options_size);
  const ferry_engine_options* options = &full;
  using Timeout = std::pair<const char*, double>;
  for (const auto& [field, seconds] : {Timeout{"collective_timeout_s", options->collective_timeout_s},
                                       Timeout{"checkpoint_timeout_s", options->checkpoint_timeout_s}}) {
    if (!(seconds >= 0.0 && std::isfinite(seconds))) {
      return Report(absl::InvalidArgumentError(absl::StrCat("ferry_engine_create: ferry_engine_options.", field, " is ",
                                                            seconds, "; it must be >= 0 (0: the default)")));
    }
  }
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
  o.optimizer.bias_correction = options->bias_correction != 0;
  o.device_ordinal = options->device_ordinal;
  o.cpu_threads = options->cpu_threads;
  o.trainer_threads = options->trainer_threads;
  o.cpu_threads_max = options->cpu_threads_max;
  o.spare_state_fraction = options->spare_state_fraction;
  if (options->state_later != nullptr) o.state_later = options->state_later;
  o.local_rank = options->local_rank;
  o.local_world_size = options->local_world_size;
  o.pin_cpu_threads = options->pin_cpu_threads;
  o.pin_trainer_threads = options->pin_trainer_threads;
  if (options->numa != nullptr) o.numa = options->numa;
  if (options->trace_path != nullptr) o.trace_path = options->trace_path;
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

ferry_status ferry_add_group(ferry_engine* engine, const char* group, const char* const* keys, const double* values,
                             size_t num_options) {
  if (engine == nullptr) return NullHandle("ferry_add_group");
  if (group == nullptr) return Report(absl::InvalidArgumentError("ferry_add_group: group is NULL"));
  ferry::GroupOptions options;
  for (size_t i = 0; i < num_options; ++i) {
    if (keys == nullptr || values == nullptr || keys[i] == nullptr) {
      return Report(absl::InvalidArgumentError("ferry_add_group('" + std::string(group) + "'): option " +
                                               std::to_string(i) + " is NULL"));
    }
    absl::Status s = ferry::SetGroupOption(options, keys[i], values[i]);
    if (!s.ok()) return Report(absl::Status(s.code(), "ferry_add_group('" + std::string(group) + "'): " + std::string(s.message())));
  }
  return Report(engine->engine->AddGroup(group, options));
}

void ferry_step_options_init(ferry_step_options* o) {
  const ferry::StepOptions d;
  std::memset(o, 0, sizeof(*o));
  o->has_lr = 0;
  o->lr = 0.0f;
  o->loss_scale = d.loss_scale;
  o->max_grad_norm = d.max_grad_norm;
  o->check_finite = d.check_finite ? 1 : 0;
  o->wait_for_params = d.wait_for_params ? 1 : 0;
}

namespace {

// `options`' per-group values (NaN or a NULL array: none) as StepOptions' lists; a group given one beta
// takes its other one from its settings (ferry_engine::betas).
absl::Status GroupValuesOf(ferry_engine& handle, const ferry_step_options& o, const char* fn,
                           ferry::StepOptions& so) {
  if (o.num_groups == 0) return absl::OkStatus();
  if (o.group_names == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": group_names is NULL"));
  for (size_t i = 0; i < o.num_groups; ++i) {
    if (o.group_names[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(fn, ": group_names[", i, "] is NULL"));
    }
    const std::string name = o.group_names[i];
    auto given = [&](const float* values) { return values != nullptr && !std::isnan(values[i]); };
    if (given(o.group_lr)) so.group_lr.emplace_back(name, o.group_lr[i]);
    if (given(o.group_weight_decay)) so.group_weight_decay.emplace_back(name, o.group_weight_decay[i]);
    if (!given(o.group_beta1) && !given(o.group_beta2)) continue;
    if (handle.betas.empty()) {
      for (const ferry::GroupPlacement& g : handle.engine->Placement()) {
        handle.betas[g.group] = {*g.options.beta1, *g.options.beta2};
      }
    }
    auto it = handle.betas.find(name);
    if (it == handle.betas.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(fn, ": group_names[", i, "] names no parameter group '", name, "'"));
    }
    const float beta1 = given(o.group_beta1) ? o.group_beta1[i] : it->second.first;
    const float beta2 = given(o.group_beta2) ? o.group_beta2[i] : it->second.second;
    so.group_betas.emplace_back(name, std::pair<float, float>{beta1, beta2});
  }
  return absl::OkStatus();
}

absl::StatusOr<ferry::StepOptions> StepOptionsOf(ferry_engine& handle, const ferry_step_options* options,
                                                 const char* fn) {
  ferry::StepOptions so;
  if (options != nullptr) {
    if (options->has_lr != 0) so.lr = options->lr;
    so.loss_scale = options->loss_scale;
    so.max_grad_norm = options->max_grad_norm;
    so.check_finite = options->check_finite != 0;
    so.wait_for_params = options->wait_for_params != 0;
    FERRY_RETURN_IF_ERROR(GroupValuesOf(handle, *options, fn, so));
  }
  return so;
}

// `n` names of the list the caller calls `list` ("groups", "params"); InvalidArgument naming `fn`
// and `list` for a null list or name.
absl::StatusOr<std::vector<std::string>> Names(const char* fn, const char* list, const char* const* names, size_t n) {
  if (n > 0 && names == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": ", list, " is NULL"));
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) {
    if (names[i] == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": ", list, "[", i, "] is NULL"));
    out.emplace_back(names[i]);
  }
  return out;
}

}  // namespace

ferry_status ferry_step_with(ferry_engine* engine, const ferry_step_options* options, void* stream) {
  if (engine == nullptr) return NullHandle("ferry_step_with");
  absl::StatusOr<ferry::StepOptions> so = StepOptionsOf(*engine, options, "ferry_step_with");
  if (!so.ok()) return Report(so.status());
  return Report(engine->engine->Step(*so, stream));
}

ferry_status ferry_grads_ready(ferry_engine* engine, const char* const* groups, size_t num_groups,
                               const ferry_step_options* options, void* stream) {
  if (engine == nullptr) return NullHandle("ferry_grads_ready");
  absl::StatusOr<std::vector<std::string>> names = Names("ferry_grads_ready", "groups", groups, num_groups);
  if (!names.ok()) return Report(names.status());
  absl::StatusOr<ferry::StepOptions> so = StepOptionsOf(*engine, options, "ferry_grads_ready");
  if (!so.ok()) return Report(so.status());
  return Report(engine->engine->GradsReady(*names, *so, stream));
}

ferry_status ferry_wait_params(ferry_engine* engine, const char* const* groups, size_t num_groups, void* stream) {
  if (engine == nullptr) return NullHandle("ferry_wait_params");
  absl::StatusOr<std::vector<std::string>> names = Names("ferry_wait_params", "groups", groups, num_groups);
  if (!names.ok()) return Report(names.status());
  return Report(engine->engine->WaitParams(*names, stream));
}

ferry_status ferry_grads_ready_params(ferry_engine* engine, const char* const* params, size_t num_params,
                                      const ferry_step_options* options, void* stream) {
  if (engine == nullptr) return NullHandle("ferry_grads_ready_params");
  absl::StatusOr<std::vector<std::string>> names = Names("ferry_grads_ready_params", "params", params, num_params);
  if (!names.ok()) return Report(names.status());
  absl::StatusOr<ferry::StepOptions> so = StepOptionsOf(*engine, options, "ferry_grads_ready_params");
  if (!so.ok()) return Report(so.status());
  return Report(engine->engine->GradsReadyParams(*names, *so, stream));
}

ferry_status ferry_wait_params_of(ferry_engine* engine, const char* const* params, size_t num_params, void* stream) {
  if (engine == nullptr) return NullHandle("ferry_wait_params_of");
  absl::StatusOr<std::vector<std::string>> names = Names("ferry_wait_params_of", "params", params, num_params);
  if (!names.ok()) return Report(names.status());
  return Report(engine->engine->WaitParamsOf(*names, stream));
}

ferry_status ferry_get_stats(ferry_engine* engine, ferry_stats* out) {
  return ferry_get_stats_sized(engine, out, sizeof(ferry_stats));
}

ferry_status ferry_get_stats_sized(ferry_engine* engine, void* out_bytes, size_t out_size) {
  if (engine == nullptr) return NullHandle("ferry_get_stats");
  if (out_bytes == nullptr) return Report(absl::InvalidArgumentError("ferry_get_stats: out is NULL"));
  if (out_size < sizeof(int64_t)) {
    return Report(absl::InvalidArgumentError(absl::StrCat(
        "ferry_get_stats_sized: out_size is ", out_size, " bytes; a ferry_stats of any version holds at least its "
        "first field (", sizeof(int64_t), " bytes; this library's is ", sizeof(ferry_stats), ")")));
  }
  const ferry::EngineStats s = engine->engine->Stats();
  ferry_stats full;
  ferry_stats* out = &full;
  std::memset(out, 0, sizeof(*out));
  out->step = s.step;
  out->skipped_steps = s.skipped_steps;
  out->last_step_skipped = s.last_step_skipped ? 1 : 0;
  out->last_grad_norm = s.last_grad_norm;
  out->host_registrations = s.host_registrations;
  out->pinned_host_calls = s.pinned_host_calls;
  out->pinned_bytes = s.pinned_bytes;
  out->pinned_huge_bytes = s.pinned_huge_bytes;
  out->gpu_state_bytes = s.gpu_state_bytes;
  out->checkpoint_copied_aside_bytes = s.checkpoint_copied_aside_bytes;
  out->early_groups_kept = s.early_groups_kept;
  out->early_groups_recomputed = s.early_groups_recomputed;
  out->deferred_steps = s.deferred_steps;
  out->spare_state_bytes = s.spare_state_bytes;
  out->cpu_adam_busy_seconds = s.cpu_adam_busy_seconds;
  out->cpu_adam_bytes = s.cpu_adam_bytes;
  out->cpu_adam_spare_bytes = s.cpu_adam_spare_bytes;
  out->cpu_adam_later_bytes = s.cpu_adam_later_bytes;
  out->state_later_kept_bytes = s.state_later_kept_bytes;
  out->state_later_limit_bytes = s.state_later_limit_bytes;
  out->local_rank = s.local_rank;
  out->local_world_size = s.local_world_size;
  out->cpu_threads = s.cpu_threads;
  out->transfer_chunk_bytes = s.transfer_chunk_bytes;
  out->pinned_limit_bytes = s.pinned_limit_bytes;
  out->numa_node = s.numa_node;
  // The caller's struct may be an older (shorter) or newer (longer) version: its prefix is ours.
  const size_t n = std::min(out_size, sizeof(full));
  std::memcpy(out_bytes, &full, n);
  if (out_size > n) std::memset(static_cast<char*>(out_bytes) + n, 0, out_size - n);
  return Report(absl::OkStatus());
}

ferry_status ferry_num_groups(ferry_engine* engine, size_t* num_groups) {
  if (engine == nullptr) return NullHandle("ferry_num_groups");
  if (num_groups == nullptr) return Report(absl::InvalidArgumentError("ferry_num_groups: num_groups is NULL"));
  *num_groups = engine->engine->Placement().size();
  return Report(absl::OkStatus());
}

ferry_status ferry_group_info_at(ferry_engine* engine, size_t index, ferry_group_info* out) {
  if (engine == nullptr) return NullHandle("ferry_group_info_at");
  if (out == nullptr) return Report(absl::InvalidArgumentError("ferry_group_info_at: out is NULL"));
  const std::vector<ferry::GroupPlacement> groups = engine->engine->Placement();
  if (index >= groups.size()) {
    return Report(absl::OutOfRangeError("ferry_group_info_at: index " + std::to_string(index) + " of " +
                                        std::to_string(groups.size()) + " groups"));
  }
  const ferry::GroupPlacement& g = groups[index];
  auto name = std::find(engine->group_names.begin(), engine->group_names.end(), g.group);
  if (name == engine->group_names.end()) name = engine->group_names.insert(engine->group_names.end(), g.group);
  std::memset(out, 0, sizeof(*out));
  out->group = name->c_str();
  out->offloaded = g.offloaded ? 1 : 0;
  out->numel = g.numel;
  out->num_params = g.num_params;
  out->global_numel = g.global_numel;
  out->lr_scale = g.options.lr_scale.value_or(1.0f);
  out->weight_decay = g.options.weight_decay.value_or(0.0f);
  out->beta1 = g.options.beta1.value_or(0.0f);
  out->beta2 = g.options.beta2.value_or(0.0f);
  out->eps = g.options.eps.value_or(0.0f);
  out->adamw = g.options.adamw.value_or(true) ? 1 : 0;
  out->master_dtype = g.master_dtype == ferry::DType::kBF16 ? FERRY_BF16 : FERRY_F32;
  out->moments_dtype = g.moments_dtype == ferry::DType::kBF16 ? FERRY_BF16 : FERRY_F32;
  out->stochastic_rounding = g.stochastic_rounding ? 1 : 0;
  out->host_state_bytes = static_cast<uint64_t>(g.host_state_bytes);
  out->device_state_bytes = static_cast<uint64_t>(g.device_state_bytes);
  return Report(absl::OkStatus());
}

ferry_status ferry_wait_checkpoint(ferry_engine* engine) {
  if (engine == nullptr) return NullHandle("ferry_wait_checkpoint");
  return Report(engine->engine->WaitCheckpoint());
}

ferry_status ferry_poll_checkpoint(ferry_engine* engine, int* done) {
  if (engine == nullptr) return NullHandle("ferry_poll_checkpoint");
  if (done == nullptr) return Report(absl::InvalidArgumentError("ferry_poll_checkpoint: done is NULL"));
  std::optional<absl::Status> s = engine->engine->PollCheckpoint();
  *done = s.has_value() ? 1 : 0;
  return Report(s.value_or(absl::OkStatus()));
}

void ferry_load_options_init(ferry_load_options* o) {
  const ferry::LoadOptions d;
  std::memset(o, 0, sizeof(*o));
  o->fall_back_to_previous = d.fall_back_to_previous ? 1 : 0;
}

ferry_status ferry_load_checkpoint_with(ferry_engine* engine, const char* path, const ferry_load_options* options,
                                        char* dir_out, size_t dir_out_size) {
  if (engine == nullptr) return NullHandle("ferry_load_checkpoint_with");
  if (path == nullptr) return Report(absl::InvalidArgumentError("ferry_load_checkpoint_with: path is NULL"));
  ferry::LoadOptions lo;
  if (options != nullptr) lo.fall_back_to_previous = options->fall_back_to_previous != 0;
  absl::Status s = engine->engine->LoadCheckpoint(path, lo);
  if (!s.ok()) return Report(s);
  return Report(CopyOut("ferry_load_checkpoint_with: loaded, but dir_out", engine->engine->LastLoad().dir, dir_out,
                        dir_out_size));
}

ferry_status ferry_load_differences(ferry_engine* engine, char* out, size_t out_size, size_t* count) {
  if (engine == nullptr) return NullHandle("ferry_load_differences");
  const std::vector<std::string> diffs = engine->engine->LastLoad().optimizer_differences;
  std::string text;
  for (const std::string& d : diffs) text += (text.empty() ? "" : "\n") + d;
  if (count != nullptr) *count = diffs.size();
  return Report(CopyOut("ferry_load_differences", text, out, out_size));
}

ferry_status ferry_device_info(ferry_engine* engine, char* name_out, size_t name_out_size, int* on_gpu) {
  if (engine == nullptr) return NullHandle("ferry_device_info");
  if (on_gpu != nullptr) *on_gpu = engine->engine->OnGpu() ? 1 : 0;
  return Report(CopyOut("ferry_device_info", engine->engine->DeviceName(), name_out, name_out_size));
}

ferry_status ferry_host_share(ferry_engine* engine, char* cpus_out, size_t cpus_out_size, char* reason_out,
                              size_t reason_out_size) {
  if (engine == nullptr) return NullHandle("ferry_host_share");
  const ferry::EngineStats s = engine->engine->Stats();
  const absl::Status cpus = CopyOut("ferry_host_share (cpus_out)", s.cpu_list, cpus_out, cpus_out_size);
  if (!cpus.ok()) return Report(cpus);
  return Report(CopyOut("ferry_host_share (reason_out)", s.host_share, reason_out, reason_out_size));
}

}  // extern "C"
