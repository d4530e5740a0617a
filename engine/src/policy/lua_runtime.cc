#include "policy/lua_runtime.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "ferry/status.h"
#include "policy/lua_values.h"

#if __has_include(<luajit-2.1/lua.hpp>)
#include <luajit-2.1/lua.hpp>
#else
#include <lua.hpp>
#endif

namespace ferry {
namespace {

using policy_internal::AV;
using policy_internal::CopyTable;
using policy_internal::DeclaredArgs;
using policy_internal::kLibNames;
using policy_internal::kProtected;
using policy_internal::kRegBase;
using policy_internal::kRegEnvMeta;
using policy_internal::kRegHooks;
using policy_internal::kRegLibMetas;
using policy_internal::kRegLibs;

constexpr char kRegRuntime[] = "ferry.policy.runtime";  // lightuserdata: LuaRuntime*
// Array of the loaded chunks: { proxy = (the chunk's environment: always empty), route = (the
// proxy's metatable: routes globals), globals = (what the chunk's top level defined) }.
constexpr char kRegChunks[] = "ferry.policy.chunks";

// Restores the stack height on scope exit.
class StackRestorer final {
 public:
  explicit StackRestorer(lua_State* L) : L_(L), top_(lua_gettop(L)) {}
  ~StackRestorer() { lua_settop(L_, top_); }
  StackRestorer(const StackRestorer&) = delete;
  StackRestorer& operator=(const StackRestorer&) = delete;

 private:
  lua_State* L_;
  int top_;
};

// Pushes field `field` of chunk record `chunk`.
void PushChunkField(lua_State* L, int chunk, const char* field) {
  lua_getfield(L, LUA_REGISTRYINDEX, kRegChunks);
  lua_rawgeti(L, -1, chunk);
  lua_getfield(L, -1, field);
  lua_replace(L, -3);
  lua_pop(L, 1);
}

}  // namespace

LuaRuntime::LuaRuntime(std::string name, const PolicyOptions& options)
    : name_(std::move(name)), options_(options), shipped_dir_(policy_internal::ShippedPolicyDir(options)) {
  budget_.memory_limit = options.memory_limit_bytes;
  budget_.instruction_limit = options.instruction_limit;
}

LuaRuntime::~LuaRuntime() {
  if (L_ != nullptr) {
    budget_.enforce = false;
    lua_close(L_);
  }
}

absl::StatusOr<std::unique_ptr<LuaRuntime>> LuaRuntime::Create(std::string name,
                                                               const PolicyOptions& options) {
  if (options.instruction_limit <= 0 || options.memory_limit_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": PolicyOptions: instruction_limit (", options.instruction_limit,
        ") and memory_limit_bytes (", options.memory_limit_bytes, ") must be positive"));
  }
  std::unique_ptr<LuaRuntime> rt(new LuaRuntime(std::move(name), options));
  // LuaJIT refuses custom allocators on 64-bit builds without GC64 (lua_newstate returns NULL);
  // there the memory limit is checked from the count hook instead.
  rt->L_ = lua_newstate(policy_internal::LimitedAlloc, &rt->budget_);
  rt->budget_.custom_allocator = rt->L_ != nullptr;
  if (rt->L_ == nullptr) rt->L_ = luaL_newstate();
  if (rt->L_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(rt->name_, ": cannot create a Lua state"));
  }
  lua_State* L = rt->L_;
  // Policies are small; the interpreter honours the count hook on every instruction, compiled
  // traces would not.
  luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
  policy_internal::SandboxSetup setup{&rt->budget_, &LuaRuntime::PolicyFunction};
  if (lua_cpcall(L, policy_internal::SetupSandbox, &setup) != 0) {
    std::string message = lua_isstring(L, -1) ? lua_tostring(L, -1) : "unknown error";
    lua_pop(L, 1);
    return absl::InternalError(
        absl::StrCat(rt->name_, ": cannot set up the policy sandbox: ", message));
  }
  lua_pushlightuserdata(L, rt.get());
  lua_setfield(L, LUA_REGISTRYINDEX, kRegRuntime);
  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, kRegChunks);
  FERRY_CHECK(lua_gettop(L) == 0);
  return rt;
}

void LuaRuntime::PushFreshEnv(int chunk) {
  lua_State* L = L_;
  lua_newtable(L);
  const int env = lua_gettop(L);
  lua_getfield(L, LUA_REGISTRYINDEX, kRegBase);
  CopyTable(L, lua_gettop(L), env);
  lua_pop(L, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, kRegLibs);
  const int libs = lua_gettop(L);
  lua_getfield(L, LUA_REGISTRYINDEX, kRegLibMetas);
  const int metas = lua_gettop(L);
  for (const char* lib : kLibNames) {
    lua_newtable(L);
    lua_getfield(L, libs, lib);
    CopyTable(L, lua_gettop(L), lua_gettop(L) - 1);
    lua_pop(L, 1);
    lua_getfield(L, metas, lib);
    lua_setmetatable(L, -2);
    lua_setfield(L, env, lib);
  }
  lua_pop(L, 2);
  // The chunk's own globals (defined by its top level) win over the sandbox's.
  PushChunkField(L, chunk, "globals");
  if (lua_istable(L, -1)) CopyTable(L, lua_gettop(L), env);
  lua_pop(L, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, kRegEnvMeta);
  lua_setmetatable(L, env);
}

void LuaRuntime::RouteAllToFreshEnvs() {
  lua_State* L = L_;
  for (int i = 1; i <= chunks_; ++i) {
    PushFreshEnv(i);
    PushChunkField(L, i, "route");
    lua_pushvalue(L, -2);
    lua_setfield(L, -2, "__index");
    lua_pushvalue(L, -2);
    lua_setfield(L, -2, "__newindex");
    lua_pop(L, 2);
  }
}

void LuaRuntime::RouteAllNowhere() {
  lua_State* L = L_;
  for (int i = 1; i <= chunks_; ++i) {
    PushChunkField(L, i, "route");
    lua_pushnil(L);
    lua_setfield(L, -2, "__index");
    lua_pushnil(L);
    lua_setfield(L, -2, "__newindex");
    lua_pop(L, 1);
  }
}

absl::Status LuaRuntime::ProtectedCall(std::string_view what, int nargs, int nresults) {
  lua_State* L = L_;
  const int func = lua_gettop(L) - nargs;
  FERRY_CHECK(func >= 1);
  lua_pushcfunction(L, policy_internal::TracebackHandler);
  lua_insert(L, func);  // handler below the function

  budget_.instructions = 0;
  budget_.instruction_limit_hit = false;
  budget_.hook_interval = static_cast<int>(std::min<int64_t>(1000, options_.instruction_limit));
  budget_.memory_refused = false;
  budget_.c_stack_base = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  lua_sethook(L, policy_internal::CountHook, LUA_MASKCOUNT | LUA_MASKCALL, budget_.hook_interval);
  budget_.enforce = true;
  const int rc = lua_pcall(L, nargs, nresults, func);
  budget_.enforce = false;
  lua_sethook(L, nullptr, 0, 0);
  budget_.c_stack_base = 0;
  lua_remove(L, func);  // the handler

  if (rc == 0) {
    FERRY_CHECK(lua_gettop(L) == func - 1 + nresults) << name_ << ": " << what;
    return absl::OkStatus();
  }
  std::string message = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "(no message)";
  lua_pop(L, 1);
  FERRY_CHECK(lua_gettop(L) == func - 1) << name_ << ": " << what;
  lua_gc(L, LUA_GCCOLLECT, 0);  // give back what the failed call held before the next one
  const std::string prefix = absl::StrCat(name_, ": ", AV(what), ": ");
  if (rc == LUA_ERRMEM) {
    return absl::ResourceExhaustedError(absl::StrCat(prefix, "memory limit of ",
                                                     options_.memory_limit_bytes,
                                                     " bytes exceeded (", message, ")"));
  }
  if (budget_.instruction_limit_hit) {
    return absl::ResourceExhaustedError(absl::StrCat(prefix, message));
  }
  if (budget_.memory_refused) {
    return absl::ResourceExhaustedError(
        absl::StrCat(prefix, message, "\n(an allocation was refused at the memory limit of ",
                     options_.memory_limit_bytes, " bytes)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, message, " (see engine/TROUBLESHOOTING.md#a-policy-error)"));
}

absl::Status LuaRuntime::CompileChunk(std::string_view source, const std::string& lua_chunk_name,
                                      std::string_view display) {
  lua_State* L = L_;
  const bool enforce = budget_.enforce;
  budget_.enforce = true;
  const int rc = luaL_loadbufferx(L, source.data(), source.size(), lua_chunk_name.c_str(), "t");
  budget_.enforce = enforce;
  if (rc != 0) {
    std::string message = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "(no message)";
    lua_pop(L, 1);
    if (rc == LUA_ERRMEM) {
      return absl::ResourceExhaustedError(
          absl::StrCat(AV(display), ": memory limit exceeded while compiling (", message, ")"));
    }
    // Mode "t" is what refuses bytecode; say so in words.
    if (!source.empty() && source[0] == LUA_SIGNATURE[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          AV(display),
          ": is a precompiled (bytecode) chunk; policies are loaded from Lua source text "
          "only (",
          message, ")"));
    }
    return absl::InvalidArgumentError(absl::StrCat(AV(display), ": cannot load: ", message));
  }
  const int fn = lua_gettop(L);
  // The chunk (and every function it creates) sees globals through its proxy, whose metatable
  // routes them to the environment of the current call.
  const int chunk = ++chunks_;
  lua_getfield(L, LUA_REGISTRYINDEX, kRegChunks);
  lua_createtable(L, 0, 3);
  lua_newtable(L);  // proxy
  lua_createtable(L, 0, 3);  // route
  lua_pushstring(L, kProtected);
  lua_setfield(L, -2, "__metatable");
  lua_pushvalue(L, -1);
  lua_setfield(L, -4, "route");
  lua_setmetatable(L, -2);
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, "proxy");
  lua_setfenv(L, fn);
  lua_rawseti(L, -2, chunk);
  lua_pop(L, 1);
  // Top-level globals land in a table of their own, which later calls see (shallow-copied).
  lua_newtable(L);
  const int globals = lua_gettop(L);
  lua_createtable(L, 0, 2);
  PushFreshEnv(chunk);
  lua_setfield(L, -2, "__index");
  lua_pushstring(L, kProtected);
  lua_setfield(L, -2, "__metatable");
  lua_setmetatable(L, globals);
  PushChunkField(L, chunk, "route");
  lua_pushvalue(L, globals);
  lua_setfield(L, -2, "__index");
  lua_pushvalue(L, globals);
  lua_setfield(L, -2, "__newindex");
  lua_pop(L, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, kRegChunks);
  lua_rawgeti(L, -1, chunk);
  lua_pushvalue(L, globals);
  lua_setfield(L, -2, "globals");
  lua_pop(L, 3);  // record, chunks, globals
  FERRY_CHECK(lua_gettop(L) == fn);
  return absl::OkStatus();
}

absl::Status LuaRuntime::CheckForwards(const Loading& chunk, const DeclaredArgs& declared,
                                       std::string_view who) const {
  if (!declared.has_value()) return absl::OkStatus();
  for (const Loading::Forward& f : chunk.forwards) {
    for (const auto& [arg, description] : f.declared) {
      if (!declared->contains(arg)) {
        return absl::InvalidArgumentError(absl::StrCat(
            AV(who), ": ", f.where, "ferry.policy(\"", f.base,
            "\") shares this policy's args with the base, which takes \"", arg,
            "\"; declare it in this policy's args too (it shares ",
            policy_internal::KnownArgs(f.declared), "; args = base.args declares them)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LuaRuntime::Load(std::string_view source, const std::string& lua_chunk_name,
                              const std::string& file) {
  lua_State* L = L_;
  StackRestorer restore(L);
  loading_.clear();
  if (!file.empty()) {
    loading_.push_back({file, policy_internal::RealPath(file), policy_internal::DirectoryOf(file), {}});
    files_.push_back(file);
  } else {
    loading_.push_back({});
  }
  absl::Status status = CompileChunk(source, lua_chunk_name, name_);
  if (status.ok()) status = ProtectedCall("top level", 0, 1);
  RouteAllNowhere();
  const Loading top = std::move(loading_.back());
  loading_.clear();
  FERRY_RETURN_IF_ERROR(status);

  // The module table: hook name -> function, and the args declaration.
  const int module = lua_gettop(L);
  FERRY_RETURN_IF_ERROR(policy_internal::ReadModule(L, module, name_, &declared_args_));
  FERRY_RETURN_IF_ERROR(CheckForwards(top, declared_args_, name_));
  lua_getfield(L, LUA_REGISTRYINDEX, kRegHooks);
  const int hooks = lua_gettop(L);
  for (std::string_view hook : kHookNames) {
    lua_pushlstring(L, hook.data(), hook.size());
    lua_pushvalue(L, -1);
    lua_rawget(L, module);
    lua_rawset(L, hooks);
  }
  return absl::OkStatus();
}

int LuaRuntime::PolicyFunction(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, kRegRuntime);
  auto* rt = static_cast<LuaRuntime*>(lua_touserdata(L, -1));
  lua_pop(L, 1);
  if (rt->LoadBase(L)) return 1;
  // The message is on top; prefix where ferry.policy was called (the calling file when a tail call
  // left no line to name). No C++ object is alive here.
  luaL_where(L, 1);
  if (lua_objlen(L, -1) == 0 && !rt->loading_.empty() && !rt->loading_.back().path.empty()) {
    lua_pop(L, 1);
    lua_pushfstring(L, "%s: ", rt->loading_.back().path.c_str());
  }
  lua_insert(L, -2);
  lua_concat(L, 2);
  return lua_error(L);
}

bool LuaRuntime::LoadBase(lua_State* L) {
  std::string error;
  if (LoadBaseChecked(L, &error)) return true;
  lua_pushlstring(L, error.data(), error.size());
  return false;
}

bool LuaRuntime::LoadBaseChecked(lua_State* L, std::string* error) {
  const int nargs = lua_gettop(L);
  if (nargs < 1 || lua_type(L, 1) != LUA_TSTRING) {
    *error = "ferry.policy(name [, args]): name must be a string, e.g. \"offload_fraction\"";
    return false;
  }
  const std::string name(lua_tostring(L, 1));
  const std::string call = absl::StrCat("ferry.policy(", policy_internal::Quote(name), ")");
  if (nargs >= 2 && lua_type(L, 2) != LUA_TTABLE && lua_type(L, 2) != LUA_TNIL) {
    *error = absl::StrCat(call, ": args is ", policy_internal::Describe(L, 2),
                          "; expected a table of args, or nothing to share this policy's args");
    return false;
  }
  if (loading_.empty()) {
    *error = absl::StrCat(call, ": ferry.policy can only be called from a policy's top level, "
                                "while it loads (not from a hook)");
    return false;
  }
  absl::StatusOr<policy_internal::ResolvedPolicy> resolved =
      policy_internal::ResolvePolicyName(name, loading_.back().dir, shipped_dir_);
  if (!resolved.ok()) {
    *error = absl::StrCat(call, ": ", resolved.status().message());
    return false;
  }
  for (size_t i = 0; i < loading_.size(); ++i) {
    if (loading_[i].canonical == resolved->canonical) {
      std::vector<std::string> chain;
      for (size_t j = i; j < loading_.size(); ++j) chain.push_back(loading_[j].path);
      chain.push_back(resolved->path);
      *error = absl::StrCat(call, ": a cycle of policies, refused: ", absl::StrJoin(chain, " -> "));
      return false;
    }
  }
  absl::StatusOr<std::string> source = policy_internal::ReadPolicyFile(resolved->path);
  if (!source.ok()) {
    *error = absl::StrCat(call, ": ", source.status().message());
    return false;
  }
  // Fixed args: strings (numbers and booleans as their text).
  std::map<std::string, std::string> fixed;
  const bool forward = nargs < 2 || lua_type(L, 2) == LUA_TNIL;
  if (!forward) {
    lua_pushnil(L);
    while (lua_next(L, 2) != 0) {
      const int vt = lua_type(L, -1);
      if (lua_type(L, -2) != LUA_TSTRING ||
          (vt != LUA_TSTRING && vt != LUA_TNUMBER && vt != LUA_TBOOLEAN)) {
        *error = absl::StrCat(call, ": args has ", policy_internal::Describe(L, -2), " = ",
                              policy_internal::Describe(L, -1),
                              "; expected arg names mapped to strings (or numbers, booleans)");
        lua_pop(L, 2);
        return false;
      }
      std::string value = vt == LUA_TBOOLEAN ? (lua_toboolean(L, -1) ? "true" : "false")
                                             : std::string(lua_tostring(L, -1));  // a copy: the
      fixed.emplace(std::string(policy_internal::StringAt(L, -2)), std::move(value));  // key stays
      lua_pop(L, 1);
    }
  }
  files_.push_back(resolved->path);
  absl::Status compiled = CompileChunk(*source, absl::StrCat("@", resolved->path), resolved->path);
  if (!compiled.ok()) {
    *error = absl::StrCat(call, ": ", compiled.message());
    return false;
  }
  loading_.push_back({resolved->path, resolved->canonical, resolved->dir, {}});
  // No message handler: the base's error names its file and line; the policy's protected call
  // adds the traceback once the error reaches it.
  const int rc = lua_pcall(L, 0, 1, 0);
  const Loading base = std::move(loading_.back());
  loading_.pop_back();
  if (rc != 0) {
    *error = absl::StrCat(call, ": ", lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "(no message)");
    lua_pop(L, 1);
    return false;
  }
  const int module = lua_gettop(L);
  DeclaredArgs declared;
  absl::Status s = policy_internal::ReadModule(L, module, resolved->path, &declared);
  if (s.ok()) s = CheckForwards(base, declared, resolved->path);
  if (s.ok() && !forward) s = policy_internal::CheckArgsAgainst(resolved->path, declared, fixed);
  if (!s.ok()) {
    *error = absl::StrCat(call, ": ", s.message());
    return false;
  }
  // The args the base shares with this policy: those it declares and is not given here.
  DeclaredArgs shared;
  if (declared.has_value()) {
    shared.emplace();
    for (const auto& [k, v] : *declared) {
      if (!fixed.contains(k)) shared->emplace(k, v);
    }
  }
  if (shared.has_value() && !shared->empty()) {
    loading_.back().forwards.push_back({name, "", *shared});
    lua_Debug ar;
    if (lua_getstack(L, 1, &ar) != 0 && lua_getinfo(L, "Sl", &ar) != 0 && ar.currentline > 0) {
      loading_.back().forwards.back().where = absl::StrCat(ar.short_src, ":", ar.currentline, ": ");
    }
  }
  // The result: each hook wrapped to see the base's args, and the args it shares (base.args).
  lua_newtable(L);
  const int result = lua_gettop(L);
  int args_table = 0;
  if (!forward) {
    lua_createtable(L, 0, static_cast<int>(fixed.size()));
    for (const auto& [k, v] : fixed) {
      lua_pushlstring(L, k.data(), k.size());
      lua_pushlstring(L, v.data(), v.size());
      lua_rawset(L, -3);
    }
    args_table = lua_gettop(L);
  }
  for (std::string_view hook : kHookNames) {
    lua_pushlstring(L, hook.data(), hook.size());
    lua_rawget(L, module);
    if (lua_type(L, -1) == LUA_TFUNCTION) {
      policy_internal::PushHookWrapper(L, lua_gettop(L), args_table, shared);
      lua_setfield(L, result, std::string(hook).c_str());
    }
    lua_pop(L, 1);
  }
  if (shared.has_value()) {
    lua_createtable(L, 0, static_cast<int>(shared->size()));
    for (const auto& [k, v] : *shared) {
      lua_pushlstring(L, k.data(), k.size());
      lua_pushlstring(L, v.data(), v.size());
      lua_rawset(L, -3);
    }
    lua_setfield(L, result, "args");
  }
  lua_settop(L, result);
  lua_replace(L, 1);
  lua_settop(L, 1);
  return true;
}

bool LuaRuntime::HasHook(std::string_view hook) const {
  lua_State* L = L_;
  lua_getfield(L, LUA_REGISTRYINDEX, kRegHooks);
  lua_pushlstring(L, hook.data(), hook.size());
  lua_rawget(L, -2);
  const bool present = lua_type(L, -1) == LUA_TFUNCTION;
  lua_pop(L, 2);
  return present;
}

std::string LuaRuntime::HookLocation(std::string_view hook) const {
  lua_State* L = L_;
  StackRestorer restore(L);
  lua_getfield(L, LUA_REGISTRYINDEX, kRegHooks);
  lua_pushlstring(L, hook.data(), hook.size());
  lua_rawget(L, -2);
  FERRY_CHECK(lua_type(L, -1) == LUA_TFUNCTION) << name_ << " has no hook " << hook;
  policy_internal::UnwrapHook(L);
  lua_Debug ar;
  if (lua_getinfo(L, ">S", &ar) == 0 || ar.source == nullptr) return name_;
  // "@path" for files, "=name" for LoadString: drop the marker, keep the whole name.
  const char* source = ar.source[0] == '@' || ar.source[0] == '=' ? ar.source + 1 : ar.source;
  if (ar.linedefined < 0) return source;  // a C function
  return absl::StrCat(source, ":", ar.linedefined);
}

absl::Status LuaRuntime::CallHook(std::string_view hook,
                                  absl::FunctionRef<int(lua_State*)> push_args,
                                  absl::FunctionRef<absl::Status(lua_State*, int)> read_result) {
  lua_State* L = L_;
  StackRestorer restore(L);
  if (!lua_checkstack(L, 32)) {
    return absl::ResourceExhaustedError(absl::StrCat(name_, ": Lua stack exhausted"));
  }
  lua_getfield(L, LUA_REGISTRYINDEX, kRegHooks);
  lua_pushlstring(L, hook.data(), hook.size());
  lua_rawget(L, -2);
  lua_remove(L, -2);
  FERRY_CHECK(lua_type(L, -1) == LUA_TFUNCTION) << name_ << " has no hook " << hook;
  const int nargs = push_args(L);
  RouteAllToFreshEnvs();
  absl::Status status = ProtectedCall(absl::StrCat(AV(hook), "()"), nargs, 1);
  RouteAllNowhere();
  FERRY_RETURN_IF_ERROR(status);
  return read_result(L, lua_gettop(L));
}

}  // namespace ferry
