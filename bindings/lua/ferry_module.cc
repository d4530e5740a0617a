#include "lua/ferry_module.h"

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "device/device.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/version.h"
#include "lua/lua_tensor.h"

namespace ferry {
namespace {

constexpr char kEngineMeta[] = "ferry.Engine";

struct EngineBox {
  std::unique_ptr<Engine> engine;
};

Engine* CheckEngine(lua_State* L, int idx) {
  auto* box = static_cast<EngineBox*>(luaL_checkudata(L, idx, kEngineMeta));
  if (box->engine == nullptr) luaL_error(L, "ferry: the engine was closed");
  return box->engine.get();
}

// Field helpers for option tables.
std::string OptString(lua_State* L, int t, const char* key, const std::string& def) {
  lua_getfield(L, t, key);
  std::string v = lua_isnil(L, -1) ? def : std::string(luaL_checkstring(L, -1));
  lua_pop(L, 1);
  return v;
}
double OptNumber(lua_State* L, int t, const char* key, double def) {
  lua_getfield(L, t, key);
  double v = def;
  if (!lua_isnil(L, -1)) {
    if (!lua_isnumber(L, -1)) luaL_error(L, "field '%s' must be a number", key);
    v = lua_tonumber(L, -1);
  }
  lua_pop(L, 1);
  return v;
}
bool OptBool(lua_State* L, int t, const char* key, bool def) {
  lua_getfield(L, t, key);
  bool v = lua_isnil(L, -1) ? def : lua_toboolean(L, -1) != 0;
  lua_pop(L, 1);
  return v;
}

// The policy arguments in field `args` of the table at `t` (strings or numbers, by string keys).
std::map<std::string, std::string> OptArgs(lua_State* L, int t, const char* who) {
  std::map<std::string, std::string> args;
  lua_getfield(L, t, "args");
  if (lua_istable(L, -1)) {
    lua_pushnil(L);
    while (lua_next(L, -2) != 0) {
      lua_pushvalue(L, -2);  // copy the key: tostring on it in place would confuse lua_next
      std::string key = lua_tostring(L, -1) ? lua_tostring(L, -1) : "";
      const char* value = lua_tostring(L, -2);
      if (key.empty() || value == nullptr) luaL_error(L, "%s: args must map strings to strings or numbers", who);
      args[key] = value;
      lua_pop(L, 2);
    }
  } else if (!lua_isnil(L, -1)) {
    luaL_error(L, "%s: field 'args' must be a table", who);
  }
  lua_pop(L, 1);
  return args;
}

// An integer field of an option table, in [lo, hi]; `def` when absent. Errors name the field.
int64_t OptInteger(lua_State* L, int t, const char* key, int64_t def, int64_t lo, int64_t hi) {
  const double v = OptNumber(L, t, key, static_cast<double>(def));
  const bool in_range = v >= static_cast<double>(lo) && v <= static_cast<double>(hi);
  if (!in_range || v != static_cast<double>(static_cast<int64_t>(v))) {
    luaL_error(L, "field '%s' must be an integer in [%s, %s], not %s", key, std::to_string(lo).c_str(),
               std::to_string(hi).c_str(), absl::StrCat(v).c_str());
  }
  return static_cast<int64_t>(v);
}

// The fields ferry.engine{} takes, EngineOptions' names where the module has no shorter one of its own.
constexpr const char* kEngineFields[] = {
    "policy", "args", "lr", "beta1", "beta2", "eps", "weight_decay", "adamw", "bias_correction", "chunk_bytes",
    "threads", "threads_max", "trainer_threads", "spare_state", "state_later", "local_rank", "local_world_size",
    "pin_cpu_threads", "pin_trainer_threads", "numa", "trace_path"};

// A field of the table at `t` that ferry.engine{} does not take: an error naming it (a typo is never ignored).
void CheckEngineFields(lua_State* L, int t) {
  lua_pushnil(L);
  while (lua_next(L, t) != 0) {
    lua_pop(L, 1);  // the value; the key stays for lua_next
    const char* key = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : nullptr;
    bool known = false;
    for (const char* f : kEngineFields) known = known || (key != nullptr && std::strcmp(key, f) == 0);
    if (!known) {
      std::string list;
      for (const char* f : kEngineFields) absl::StrAppend(&list, list.empty() ? "" : ", ", f);
      luaL_error(L, "ferry.engine: unknown field '%s' (known: %s)", key != nullptr ? key : luaL_typename(L, -1),
                 list.c_str());
    }
  }
}

// ferry.engine{ policy=, args={}, lr=, beta1=, beta2=, eps=, weight_decay=, adamw=, bias_correction=,
// chunk_bytes=, threads=, threads_max=, trainer_threads=, spare_state=, state_later=, local_rank=,
// local_world_size=, pin_cpu_threads=, pin_trainer_threads=, numa=, trace_path= }: EngineOptions
// (engine/EMBEDDING.md, "The Lua module").
int LEngine(lua_State* L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  CheckEngineFields(L, 1);
  constexpr int64_t kMaxCount = int64_t{1} << 40;
  EngineOptions o;
  o.policy_path = OptString(L, 1, "policy", "");
  o.policy_args = OptArgs(L, 1, "ferry.engine");
  o.optimizer.lr = static_cast<float>(OptNumber(L, 1, "lr", o.optimizer.lr));
  o.optimizer.beta1 = static_cast<float>(OptNumber(L, 1, "beta1", o.optimizer.beta1));
  o.optimizer.beta2 = static_cast<float>(OptNumber(L, 1, "beta2", o.optimizer.beta2));
  o.optimizer.eps = static_cast<float>(OptNumber(L, 1, "eps", o.optimizer.eps));
  o.optimizer.weight_decay = static_cast<float>(OptNumber(L, 1, "weight_decay", o.optimizer.weight_decay));
  o.optimizer.adamw = OptBool(L, 1, "adamw", o.optimizer.adamw);
  o.optimizer.bias_correction = OptBool(L, 1, "bias_correction", o.optimizer.bias_correction);
  o.transfer_chunk_bytes = static_cast<size_t>(OptInteger(L, 1, "chunk_bytes", 0, 0, kMaxCount));
  o.cpu_threads = static_cast<size_t>(OptInteger(L, 1, "threads", 0, 0, kMaxCount));
  o.cpu_threads_max = static_cast<size_t>(OptInteger(L, 1, "threads_max", 0, 0, kMaxCount));
  o.trainer_threads =
      static_cast<size_t>(OptInteger(L, 1, "trainer_threads", static_cast<int64_t>(o.trainer_threads), 0, kMaxCount));
  o.spare_state_fraction = OptNumber(L, 1, "spare_state", o.spare_state_fraction);
  o.state_later = OptString(L, 1, "state_later", "");
  o.local_rank = static_cast<int>(OptInteger(L, 1, "local_rank", -1, -1, INT32_MAX));
  o.local_world_size = static_cast<int>(OptInteger(L, 1, "local_world_size", -1, -1, INT32_MAX));
  o.pin_cpu_threads = static_cast<int>(OptInteger(L, 1, "pin_cpu_threads", -1, -1, 1));
  o.pin_trainer_threads = static_cast<int>(OptInteger(L, 1, "pin_trainer_threads", -1, -1, 1));
  o.numa = OptString(L, 1, "numa", "");
  o.trace_path = OptString(L, 1, "trace_path", "");
  o.device = std::string(BackendName(ModuleDevice(L)->backend()));  // same backend as the tensors
  absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(o);
  if (!e.ok()) RaiseStatus(L, e.status());
  auto* box = static_cast<EngineBox*>(lua_newuserdata(L, sizeof(EngineBox)));
  new (box) EngineBox{*std::move(e)};
  luaL_getmetatable(L, kEngineMeta);
  lua_setmetatable(L, -2);
  lua_newtable(L);  // environment: keeps the engine's tensors alive as long as the engine
  lua_setfenv(L, -2);
  return 1;
}

int LEngineGc(lua_State* L) {
  auto* box = static_cast<EngineBox*>(luaL_checkudata(L, 1, kEngineMeta));
  box->~EngineBox();
  return 0;
}

int LEngineClose(lua_State* L) {
  auto* box = static_cast<EngineBox*>(luaL_checkudata(L, 1, kEngineMeta));
  box->engine.reset();
  return 0;
}

// e:add_param{ name=, group=, shape={...}, dtype=, param=tensor, grad=tensor, tags={...} }
int LEngineAddParam(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  ParamSpec spec;
  spec.name = OptString(L, 2, "name", "");
  spec.group = OptString(L, 2, "group", "");
  lua_getfield(L, 2, "shape");
  if (lua_istable(L, -1)) {
    for (size_t i = 1; i <= lua_objlen(L, -1); ++i) {
      lua_rawgeti(L, -1, static_cast<int>(i));
      spec.shape.push_back(static_cast<int64_t>(lua_tonumber(L, -1)));
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  lua_getfield(L, 2, "tags");
  if (lua_istable(L, -1)) {
    for (size_t i = 1; i <= lua_objlen(L, -1); ++i) {
      lua_rawgeti(L, -1, static_cast<int>(i));
      if (const char* tag = lua_tostring(L, -1)) spec.tags.push_back(tag);
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  LuaTensor* param = nullptr;
  LuaTensor* grad = nullptr;
  lua_getfield(L, 2, "param");
  if (!lua_isnil(L, -1)) param = CheckTensor(L, -1);
  lua_getfield(L, 2, "grad");
  if (!lua_isnil(L, -1)) grad = CheckTensor(L, -1);
  if (param != nullptr) {
    spec.param = param->buffer.data();
    spec.dtype = param->dtype;
    if (param->numel != [&] { int64_t n = 1; for (int64_t d : spec.shape) n *= d; return n; }()) {
      luaL_error(L, "add_param('%s'): shape does not match the param tensor's %d elements", spec.name.c_str(),
                 static_cast<int>(param->numel));
    }
  }
  if (grad != nullptr) {
    spec.grad = grad->buffer.data();
    spec.grad_dtype = grad->dtype;
    if (param != nullptr && grad->numel != param->numel) {
      luaL_error(L, "add_param('%s'): grad has %d elements, param %d", spec.name.c_str(), static_cast<int>(grad->numel),
                 static_cast<int>(param->numel));
    }
  }
  absl::Status s = e->AddParam(spec);
  if (!s.ok()) RaiseStatus(L, s);
  // Keep both tensors alive as long as the engine.
  lua_getfenv(L, 1);
  lua_pushvalue(L, -3);
  lua_rawseti(L, -2, static_cast<int>(lua_objlen(L, -2) + 1));
  lua_pushvalue(L, -2);
  lua_rawseti(L, -2, static_cast<int>(lua_objlen(L, -2) + 1));
  return 0;
}

int CheckOk(lua_State* L, const absl::Status& s) {
  if (!s.ok()) RaiseStatus(L, s);
  return 0;
}

int LEngineFinalize(lua_State* L) { return CheckOk(L, CheckEngine(L, 1)->Finalize()); }

// Raises an error naming the first key of the table at `t` that is not in `known`.
void CheckKeys(lua_State* L, int t, const char* who, std::initializer_list<const char*> known) {
  lua_pushnil(L);
  while (lua_next(L, t) != 0) {
    lua_pop(L, 1);
    const char* key = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : nullptr;
    bool ok = false;
    std::string names;
    for (const char* k : known) {
      ok = ok || (key != nullptr && std::strcmp(key, k) == 0);
      names += names.empty() ? k : std::string(", ") + k;
    }
    if (!ok) {
      lua_pop(L, 1);
      luaL_error(L, "%s: unknown option '%s' (known: %s)", who, key != nullptr ? key : "(not a string)", names.c_str());
    }
  }
}

// e:add_group(name, { lr_scale=, weight_decay=, beta1=, beta2=, eps=, adamw= }): Engine::AddGroup.
int LEngineAddGroup(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  const std::string group = luaL_checkstring(L, 2);
  GroupOptions options;
  if (!lua_isnoneornil(L, 3)) {
    luaL_checktype(L, 3, LUA_TTABLE);
    lua_pushnil(L);
    while (lua_next(L, 3) != 0) {
      const char* key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : nullptr;
      if (key == nullptr) luaL_error(L, "add_group('%s'): option names must be strings", group.c_str());
      double value = 0;
      if (lua_isboolean(L, -1)) {
        value = lua_toboolean(L, -1) ? 1 : 0;
      } else if (lua_isnumber(L, -1)) {
        value = lua_tonumber(L, -1);
      } else {
        luaL_error(L, "add_group('%s'): option '%s' must be a number or a boolean", group.c_str(), key);
      }
      absl::Status st = SetGroupOption(options, key, value);
      if (!st.ok()) RaiseStatus(L, absl::Status(st.code(), absl::StrCat("add_group('", group, "'): ", st.message())));
      lua_pop(L, 1);
    }
  }
  return CheckOk(L, e->AddGroup(group, options));
}

// The step options in the table at `index` (if any), for `what`.
StepOptions CheckStepOptions(lua_State* L, int index, const char* what) {
  StepOptions so;
  if (lua_istable(L, index)) {
    CheckKeys(L, index, what, {"lr", "loss_scale", "max_grad_norm", "check_finite"});
    lua_getfield(L, index, "lr");
    if (!lua_isnil(L, -1)) so.lr = static_cast<float>(luaL_checknumber(L, -1));
    lua_pop(L, 1);
    so.loss_scale = static_cast<float>(OptNumber(L, index, "loss_scale", so.loss_scale));
    so.max_grad_norm = static_cast<float>(OptNumber(L, index, "max_grad_norm", so.max_grad_norm));
    so.check_finite = OptBool(L, index, "check_finite", so.check_finite);
  }
  return so;
}

// A list of names of `kind` ("group", "param"): the table at `index`.
std::vector<std::string> CheckNameList(lua_State* L, int index, const char* what, const char* kind) {
  luaL_checktype(L, index, LUA_TTABLE);
  std::vector<std::string> out;
  for (int i = 1;; ++i) {
    lua_rawgeti(L, index, i);
    if (lua_isnil(L, -1)) {
      lua_pop(L, 1);
      break;
    }
    if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "%s: %s %d is not a string", what, kind, i);
    out.emplace_back(lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  return out;
}

// e:grads_ready({ "group", ... }, { lr=, loss_scale=, max_grad_norm=, check_finite= }): the coming
// step of these groups starts now (their grads are final); e:step completes it.
int LEngineGradsReady(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  const std::vector<std::string> groups = CheckNameList(L, 2, "grads_ready", "group");
  CheckOk(L, e->GradsReady(groups, CheckStepOptions(L, 3, "grads_ready"), nullptr));
  return 0;
}

// e:grads_ready_params({ "param", ... }, { lr=, ... }): grads_ready for buckets of params (of any
// groups), Engine::GradsReadyParams: their part of the coming step starts now; a group is announced
// once all its params are. The same errors as grads_ready (an unknown param, one announced twice in
// a step, an empty list).
int LEngineGradsReadyParams(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  const std::vector<std::string> params = CheckNameList(L, 2, "grads_ready_params", "param");
  CheckOk(L, e->GradsReadyParams(params, CheckStepOptions(L, 3, "grads_ready_params"), nullptr));
  return 0;
}

// e:wait_params_of({ "param", ... }): Engine::WaitParamsOf on the script's (the calling thread's)
// stream. e:step returns with every param updated, so in a script this only checks the names and
// raises between an announcement and its step, as a trainer's per-layer wait would.
int LEngineWaitParamsOf(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  const std::vector<std::string> params = CheckNameList(L, 2, "wait_params_of", "param");
  return CheckOk(L, e->WaitParamsOf(params, nullptr));
}

// e:step{ lr=, loss_scale=, max_grad_norm=, check_finite= } -> skipped (true when a NaN/Inf grad
// skipped the step)
int LEngineStep(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  const StepOptions so = CheckStepOptions(L, 2, "step");
  CheckOk(L, e->Step(so, nullptr));
  CheckOk(L, e->Synchronize());
  lua_pushboolean(L, e->Stats().last_step_skipped);
  return 1;
}

int LEngineSave(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  const char* root = luaL_checkstring(L, 2);
  int64_t step = static_cast<int64_t>(luaL_checknumber(L, 3));
  absl::StatusOr<std::string> dir = e->SaveCheckpoint(root, step);
  if (!dir.ok()) RaiseStatus(L, dir.status());
  lua_pushstring(L, dir->c_str());
  return 1;
}

// e:load(path [, { fall_back_to_previous = }]) -> the directory loaded, and the optimizer settings
// it records differently from the engine's (a list of strings, see LoadReport)
int LEngineLoad(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  const char* path = luaL_checkstring(L, 2);
  LoadOptions lo;
  if (!lua_isnoneornil(L, 3)) {
    luaL_checktype(L, 3, LUA_TTABLE);
    CheckKeys(L, 3, "load", {"fall_back_to_previous"});
    lo.fall_back_to_previous = OptBool(L, 3, "fall_back_to_previous", false);
  }
  CheckOk(L, e->LoadCheckpoint(path, lo));
  const LoadReport report = e->LastLoad();
  lua_pushstring(L, report.dir.c_str());
  lua_createtable(L, static_cast<int>(report.optimizer_differences.size()), 0);
  for (size_t i = 0; i < report.optimizer_differences.size(); ++i) {
    lua_pushstring(L, report.optimizer_differences[i].c_str());
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
  return 2;
}

// e:wait_checkpoint(): raises the error of a finished asynchronous save not yet reported.
int LEngineWaitCheckpoint(lua_State* L) { return CheckOk(L, CheckEngine(L, 1)->WaitCheckpoint()); }

// e:poll_checkpoint() -> false while a save is in flight, else true (raising its error, if any)
int LEnginePollCheckpoint(lua_State* L) {
  std::optional<absl::Status> s = CheckEngine(L, 1)->PollCheckpoint();
  if (s.has_value()) CheckOk(L, *s);
  lua_pushboolean(L, s.has_value());
  return 1;
}

// e:sync_from_model(groups or nil, reset_optimizer)
int LEngineSync(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  std::vector<std::string> groups;
  if (lua_istable(L, 2)) {
    for (size_t i = 1; i <= lua_objlen(L, 2); ++i) {
      lua_rawgeti(L, 2, static_cast<int>(i));
      groups.push_back(luaL_checkstring(L, -1));
      lua_pop(L, 1);
    }
  }
  return CheckOk(L, e->SyncFromModel(groups, lua_toboolean(L, 3) != 0));
}

// e:reload_policy{ path = "policy.lua", args = { key = value } }: Engine::ReloadPolicy between steps.
// The new policy's place() decides; groups whose placement changed move between host and device
// without changing any value. Raises the error (file:line, hook) with the old policy still in force.
int LEngineReloadPolicy(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  const std::string path = OptString(L, 2, "path", "");
  if (path.empty()) luaL_error(L, "reload_policy: field 'path' (the policy file) is required");
  const std::map<std::string, std::string> args = OptArgs(L, 2, "reload_policy");
  return CheckOk(L, e->ReloadPolicy(path, args));
}

// e:verify_masters() -> true, or false and the message
int LEngineVerify(lua_State* L) {
  absl::Status s = CheckEngine(L, 1)->VerifyMasters();
  lua_pushboolean(L, s.ok());
  if (s.ok()) return 1;
  lua_pushstring(L, std::string(s.message()).c_str());
  return 2;
}

// e:placement() -> { {group=, device="cpu"|"gpu", numel=, params=, lr_scale=, weight_decay=, beta1=,
// beta2=, eps=, adamw=, master="fp32"|"bf16", moments="fp32"|"bf16", rounding="nearest"|"stochastic",
// state_bytes=}, ... } in registration order (state_bytes: host memory when offloaded, else device)
int LEnginePlacement(lua_State* L) {
  std::vector<GroupPlacement> pl = CheckEngine(L, 1)->Placement();
  lua_createtable(L, static_cast<int>(pl.size()), 0);
  for (size_t i = 0; i < pl.size(); ++i) {
    lua_createtable(L, 0, 4);
    lua_pushstring(L, pl[i].group.c_str());
    lua_setfield(L, -2, "group");
    lua_pushstring(L, pl[i].offloaded ? "cpu" : "gpu");
    lua_setfield(L, -2, "device");
    lua_pushnumber(L, static_cast<lua_Number>(pl[i].numel));
    lua_setfield(L, -2, "numel");
    lua_pushnumber(L, static_cast<lua_Number>(pl[i].num_params));
    lua_setfield(L, -2, "params");
    lua_pushstring(L, pl[i].master_dtype == DType::kBF16 ? "bf16" : "fp32");
    lua_setfield(L, -2, "master");
    lua_pushstring(L, pl[i].moments_dtype == DType::kBF16 ? "bf16" : "fp32");
    lua_setfield(L, -2, "moments");
    lua_pushstring(L, pl[i].stochastic_rounding ? "stochastic" : "nearest");
    lua_setfield(L, -2, "rounding");
    lua_pushnumber(L, static_cast<lua_Number>(pl[i].host_state_bytes + pl[i].device_state_bytes));
    lua_setfield(L, -2, "state_bytes");
    const GroupOptions& go = pl[i].options;
    lua_pushnumber(L, go.lr_scale.value_or(1.0f));
    lua_setfield(L, -2, "lr_scale");
    lua_pushnumber(L, go.weight_decay.value_or(0.0f));
    lua_setfield(L, -2, "weight_decay");
    lua_pushnumber(L, go.beta1.value_or(0.0f));
    lua_setfield(L, -2, "beta1");
    lua_pushnumber(L, go.beta2.value_or(0.0f));
    lua_setfield(L, -2, "beta2");
    lua_pushnumber(L, go.eps.value_or(0.0f));
    lua_setfield(L, -2, "eps");
    lua_pushboolean(L, go.adamw.value_or(true));
    lua_setfield(L, -2, "adamw");
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
  return 1;
}

int LEngineStats(lua_State* L) {
  Engine* e = CheckEngine(L, 1);
  EngineStats s = e->Stats();
  lua_createtable(L, 0, 19);
  const std::pair<const char*, double> numbers[] = {
      {"step", static_cast<double>(s.step)},
      {"host_registrations", static_cast<double>(s.host_registrations)},
      {"pinned_bytes", static_cast<double>(s.pinned_bytes)},
      {"pinned_huge_bytes", static_cast<double>(s.pinned_huge_bytes)},
      {"gpu_state_bytes", static_cast<double>(s.gpu_state_bytes)},
      {"checkpoint_copied_aside_bytes", static_cast<double>(s.checkpoint_copied_aside_bytes)},
      {"early_groups_kept", static_cast<double>(s.early_groups_kept)},
      {"early_groups_recomputed", static_cast<double>(s.early_groups_recomputed)},
      {"deferred_steps", static_cast<double>(s.deferred_steps)},
      {"spare_state_bytes", static_cast<double>(s.spare_state_bytes)},
      {"cpu_adam_busy_seconds", s.cpu_adam_busy_seconds},
      {"cpu_adam_bytes", static_cast<double>(s.cpu_adam_bytes)},
      {"cpu_adam_spare_bytes", static_cast<double>(s.cpu_adam_spare_bytes)},
      {"cpu_adam_later_bytes", static_cast<double>(s.cpu_adam_later_bytes)},
      {"state_later_kept_bytes", static_cast<double>(s.state_later_kept_bytes)},
      {"state_later_limit_bytes", static_cast<double>(s.state_later_limit_bytes)},
      {"skipped_steps", static_cast<double>(s.skipped_steps)},
      {"local_rank", static_cast<double>(s.local_rank)},
      {"local_world_size", static_cast<double>(s.local_world_size)},
      {"transfer_chunk_bytes", static_cast<double>(s.transfer_chunk_bytes)},
      {"cpu_threads", static_cast<double>(s.cpu_threads)},
      {"numa_node", static_cast<double>(s.numa_node)},
      {"pinned_limit_bytes", static_cast<double>(s.pinned_limit_bytes)},
  };
  for (const auto& [name, value] : numbers) {
    lua_pushnumber(L, static_cast<lua_Number>(value));
    lua_setfield(L, -2, name);
  }
  lua_pushboolean(L, s.last_step_skipped);
  lua_setfield(L, -2, "last_step_skipped");
  lua_pushnumber(L, s.last_grad_norm);
  lua_setfield(L, -2, "last_grad_norm");
  lua_pushstring(L, e->DeviceName().c_str());
  lua_setfield(L, -2, "device");
  lua_pushstring(L, s.cpu_list.c_str());
  lua_setfield(L, -2, "cpu_list");
  lua_pushstring(L, s.host_share.c_str());
  lua_setfield(L, -2, "host_share");
  return 1;
}

}  // namespace

int OpenFerryModule(lua_State* L) {
  static const luaL_Reg engine_methods[] = {
      {"add_param", LEngineAddParam}, {"finalize", LEngineFinalize}, {"step", LEngineStep},
      {"save", LEngineSave},          {"load", LEngineLoad},         {"sync_from_model", LEngineSync},
      {"verify_masters", LEngineVerify}, {"placement", LEnginePlacement}, {"stats", LEngineStats},
      {"reload_policy", LEngineReloadPolicy},
      {"add_group", LEngineAddGroup}, {"wait_checkpoint", LEngineWaitCheckpoint},
      {"poll_checkpoint", LEnginePollCheckpoint}, {"grads_ready", LEngineGradsReady},
      {"grads_ready_params", LEngineGradsReadyParams}, {"wait_params_of", LEngineWaitParamsOf},
      {"close", LEngineClose},        {nullptr, nullptr}};
  static const luaL_Reg functions[] = {{"tensor", LTensor},         {"engine", LEngine},
                                       {"backend", LBackend},       {"device_name", LDeviceName},
                                       {nullptr, nullptr}};
  RegisterTensorType(L);
  NewLuaType(L, kEngineMeta, engine_methods, LEngineGc);
  lua_newtable(L);
  luaL_register(L, nullptr, functions);
  lua_pushstring(L, FERRY_VERSION_STRING);
  lua_setfield(L, -2, "version");
  return 1;
}

void CloseFerryModule() { CloseModuleDevice(); }

void InstallFerryModule(lua_State* L, const std::string& script_dir) {
  OpenFerryModule(L);
  lua_pushstring(L, script_dir.c_str());
  lua_setfield(L, -2, "script_dir");
  lua_pushvalue(L, -1);
  lua_setglobal(L, "ferry");
  // package.loaded.ferry = module, so require("ferry") returns the same table.
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "loaded");
  lua_pushvalue(L, -3);
  lua_setfield(L, -2, "ferry");
  lua_pop(L, 3);
}

}  // namespace ferry
