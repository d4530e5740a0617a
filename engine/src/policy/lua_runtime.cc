#include "policy/lua_runtime.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "ferry/status.h"

#if __has_include(<luajit-2.1/lua.hpp>)
#include <luajit-2.1/lua.hpp>
#else
#include <lua.hpp>
#endif

namespace ferry {
namespace {

// Registry keys (named fields of the registry, which has no metatable).
constexpr char kRegBudget[] = "ferry.policy.budget";  // lightuserdata: LuaRuntime::Budget*
constexpr char kRegBase[] = "ferry.policy.base";      // allowed base functions (template)
constexpr char kRegLibs[] = "ferry.policy.libs";      // {string=, table=, math=, os=} templates
constexpr char kRegLibMetas[] = "ferry.policy.lib_metas";  // lib name -> metatable of copies
constexpr char kRegEnvMeta[] = "ferry.policy.env_meta";    // metatable of every global environment
constexpr char kRegProxy[] = "ferry.policy.proxy";         // the chunk's environment (always empty)
constexpr char kRegRoute[] = "ferry.policy.route";         // metatable of the proxy: routes globals
constexpr char kRegGlobals[] = "ferry.policy.globals";     // globals the chunk's top level defined
constexpr char kRegHooks[] = "ferry.policy.hooks";         // hook name -> function

constexpr char kProtected[] = "protected by the policy sandbox";

// How far the C stack may grow below the protected call while policy code runs. The VM itself does
// not recurse on the C stack for Lua-to-Lua calls; only C functions that call back into Lua do
// (string.gsub with a function or table replacement keeps an 8 KiB buffer per level and would
// overflow the host's stack long before Lua's own stack limit). Small enough for a thread with a
// modest stack, large enough that no reasonable policy comes near it.
constexpr uintptr_t kCStackLimitBytes = 256 << 10;

// Hooks named in messages about the module table.
constexpr char kHookList[] = "place, after_load, checkpoint or on_step";

// Base functions a policy may use. collectgarbage is replaced by a "count"-only version.
constexpr const char* kBaseFunctions[] = {
    "assert",   "error",        "ipairs",       "next",   "pairs",   "pcall",    "select",
    "tonumber", "tostring",     "type",         "unpack", "xpcall",  "rawequal", "rawget",
    "rawset",   "getmetatable", "setmetatable", "rawlen", "_VERSION"};

// Names a policy may try that the sandbox deliberately leaves out: reading one is an error that
// says so (any other unknown global reads as nil, as usual).
constexpr const char* kForbiddenGlobals[] = {
    "io",      "package",    "require",   "ffi",      "jit",      "debug",
    "load",    "loadstring", "dofile",    "loadfile", "newproxy", "setfenv",
    "getfenv", "module",     "coroutine", "print",    "gcinfo",   "_G"};

bool IsForbiddenGlobal(const char* name) {
  for (const char* f : kForbiddenGlobals) {
    if (std::strcmp(f, name) == 0) return true;
  }
  return false;
}

// The Lua allocator: realloc/free with a byte budget enforced while policy code runs. Shrinking
// never fails (Lua relies on that).
void* LimitedAlloc(void* ud, void* ptr, size_t osize, size_t nsize) {
  auto* budget = static_cast<LuaRuntime::Budget*>(ud);
  const int64_t old_size = ptr == nullptr ? 0 : static_cast<int64_t>(osize);
  if (nsize == 0) {
    std::free(ptr);
    budget->memory_used -= old_size;
    return nullptr;
  }
  const int64_t new_size = static_cast<int64_t>(nsize);
  if (budget->enforce && new_size > old_size &&
      budget->memory_used + (new_size - old_size) > budget->memory_limit) {
    budget->memory_refused = true;
    return nullptr;
  }
  void* p = std::realloc(ptr, nsize);
  if (p == nullptr) return nullptr;
  budget->memory_used += new_size - old_size;
  return p;
}

LuaRuntime::Budget* GetBudget(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, kRegBudget);
  auto* budget = static_cast<LuaRuntime::Budget*>(lua_touserdata(L, -1));
  lua_pop(L, 1);
  return budget;
}

// The hook of every protected call. On each function call it bounds the C stack (see
// kCStackLimitBytes): a call made from deep inside nested C functions fails instead of overflowing
// the host's stack. Every hook_interval instructions it bounds the instruction count; once the
// limit is hit it fires on every instruction, so a script that catches the error with pcall is
// stopped again at once.
void CountHook(lua_State* L, lua_Debug* ar) {
  LuaRuntime::Budget* budget = GetBudget(L);
  char message[200];
  message[0] = '\0';
  if (ar->event != LUA_HOOKCOUNT) {
    // Only calls of Lua functions are refused: unbounded recursion needs one in the loop, and the
    // error handler (a C function) must still run at the depth where the error was raised.
    const auto here = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
    if (budget->c_stack_base > here && budget->c_stack_base - here > kCStackLimitBytes &&
        lua_getinfo(L, "S", ar) != 0 && std::strcmp(ar->what, "C") != 0) {
      std::snprintf(message, sizeof(message),
                    "C stack overflow (calls nested through C functions such as string.gsub, "
                    "table.sort or xpcall use more than %d KiB of C stack)",
                    static_cast<int>(kCStackLimitBytes >> 10));
      luaL_where(L, 0);  // the Lua function being entered: "chunk:line: "
      lua_pushstring(L, message);
      lua_concat(L, 2);
      lua_error(L);
    }
    return;
  }
  budget->instructions += budget->hook_interval;
  if (budget->instructions >= budget->instruction_limit) {
    if (!budget->instruction_limit_hit) {
      budget->instruction_limit_hit = true;
      budget->hook_interval = 1;
      lua_sethook(L, CountHook, LUA_MASKCOUNT | LUA_MASKCALL, 1);
    }
    std::snprintf(message, sizeof(message), "instruction limit exceeded (%lld per call)",
                  static_cast<long long>(budget->instruction_limit));
  } else if (!budget->custom_allocator &&
             static_cast<int64_t>(lua_gc(L, LUA_GCCOUNT, 0)) * 1024 > budget->memory_limit) {
    budget->memory_refused = true;
    std::snprintf(message, sizeof(message), "memory limit exceeded (%lld bytes)",
                  static_cast<long long>(budget->memory_limit));
  }
  if (message[0] != '\0') {
    luaL_where(L, 0);  // the running Lua function: "chunk:line: "
    lua_pushstring(L, message);
    lua_concat(L, 2);
    lua_error(L);
  }
}

// Message handler of every protected call: appends a traceback.
int TracebackHandler(lua_State* L) {
  const char* message = lua_tostring(L, 1);  // strings and numbers; never calls __tostring
  if (message == nullptr) {
    message = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, message, 1);
  return 1;
}

// __index of the global environments and library copies. Upvalue 1: "" for globals, else the
// library's name. Reading a deliberately absent name is an error naming it; other names read nil.
int SandboxIndex(lua_State* L) {
  if (lua_type(L, 2) != LUA_TSTRING) return 0;
  const char* key = lua_tostring(L, 2);
  const char* lib = lua_tostring(L, lua_upvalueindex(1));
  if (lib[0] == '\0') {
    if (IsForbiddenGlobal(key)) {
      return luaL_error(L, "'%s' is not available in the policy sandbox", key);
    }
    return 0;
  }
  if (std::strcmp(lib, "os") == 0 && std::strcmp(key, "clock") != 0) {
    return luaL_error(L, "'os.%s' is not available in the policy sandbox (only os.clock is)", key);
  }
  if (std::strcmp(lib, "string") == 0 && std::strcmp(key, "dump") == 0) {
    return luaL_error(L, "'string.dump' is not available in the policy sandbox");
  }
  return 0;
}

// collectgarbage("count") only: policies must not drive the collector.
int CollectGarbageCount(lua_State* L) {
  const char* option = luaL_optstring(L, 1, "collect");
  if (std::strcmp(option, "count") != 0) {
    return luaL_error(L,
                      "collectgarbage(\"%s\") is not available in the policy sandbox "
                      "(only collectgarbage(\"count\") is)",
                      option);
  }
  lua_pushnumber(L, lua_gc(L, LUA_GCCOUNT, 0) + lua_gc(L, LUA_GCCOUNTB, 0) / 1024.0);
  return 1;
}

// xpcall(f, handler, ...): as in LuaJIT, except that the handler runs after the error has unwound
// the stack. LuaJIT runs a handler inside the error path, and an error raised by the count hook is
// raised with hooks disabled: a looping handler would escape the instruction limit.
int SafeXpcall(lua_State* L) {
  luaL_checkany(L, 2);
  const int n = lua_gettop(L);
  lua_pushvalue(L, 1);
  for (int i = 3; i <= n; ++i) lua_pushvalue(L, i);
  if (lua_pcall(L, n - 2, LUA_MULTRET, 0) == 0) {
    lua_pushboolean(L, 1);
    lua_insert(L, n + 1);
    return lua_gettop(L) - n;
  }
  // Stack: args..., error. Return false, handler(error) (or the handler's own error).
  lua_pushvalue(L, 2);
  lua_insert(L, n + 1);
  lua_pcall(L, 1, 1, 0);
  lua_pushboolean(L, 0);
  lua_insert(L, n + 1);
  return 2;
}

// Pushes {__index = SandboxIndex(lib), __metatable = kProtected}.
void PushSandboxMeta(lua_State* L, const char* lib) {
  lua_createtable(L, 0, 2);
  lua_pushstring(L, lib);
  lua_pushcclosure(L, SandboxIndex, 1);
  lua_setfield(L, -2, "__index");
  lua_pushstring(L, kProtected);
  lua_setfield(L, -2, "__metatable");
}

// Copies the raw entries of the table at `from` into the table at `to` (absolute indices).
void CopyTable(lua_State* L, int from, int to) {
  lua_pushnil(L);
  while (lua_next(L, from) != 0) {
    lua_pushvalue(L, -2);
    lua_insert(L, -2);
    lua_rawset(L, to);
  }
}

// Pushes a copy of global library `lib` without the entries in `drop` (or, with `only`, just that
// entry).
void PushLibCopy(lua_State* L, const char* lib, const char* drop, const char* only) {
  lua_getglobal(L, lib);
  const int src = lua_gettop(L);
  lua_newtable(L);
  const int dst = lua_gettop(L);
  if (only != nullptr) {
    lua_getfield(L, src, only);
    lua_setfield(L, dst, only);
  } else {
    CopyTable(L, src, dst);
    if (drop != nullptr) {
      lua_pushnil(L);
      lua_setfield(L, dst, drop);
    }
  }
  lua_remove(L, src);
}

constexpr const char* kLibNames[] = {"string", "table", "math", "os"};

// Runs in protected mode (lua_cpcall): opens the libraries and builds the sandbox templates.
int SetupSandbox(lua_State* L) {
  auto* budget = static_cast<LuaRuntime::Budget*>(lua_touserdata(L, 1));
  lua_pushlightuserdata(L, budget);
  lua_setfield(L, LUA_REGISTRYINDEX, kRegBudget);

  const lua_CFunction openers[] = {luaopen_base, luaopen_string, luaopen_table, luaopen_math,
                                   luaopen_os};
  const char* opener_names[] = {"", LUA_STRLIBNAME, LUA_TABLIBNAME, LUA_MATHLIBNAME, LUA_OSLIBNAME};
  for (size_t i = 0; i < std::size(openers); ++i) {
    lua_pushcfunction(L, openers[i]);
    lua_pushstring(L, opener_names[i]);
    lua_call(L, 1, 0);
  }
  // Belt and braces: the real string table loses dump too (it stays unreachable anyway).
  lua_getglobal(L, "string");
  lua_pushnil(L);
  lua_setfield(L, -2, "dump");
  lua_pop(L, 1);

  // Base functions.
  lua_newtable(L);
  for (const char* name : kBaseFunctions) {
    lua_getglobal(L, name);
    lua_setfield(L, -2, name);  // absent ones (rawlen in Lua 5.1 mode) stay absent
  }
  lua_pushcfunction(L, CollectGarbageCount);
  lua_setfield(L, -2, "collectgarbage");
  lua_pushcfunction(L, SafeXpcall);
  lua_setfield(L, -2, "xpcall");
  lua_setfield(L, LUA_REGISTRYINDEX, kRegBase);

  // Library templates and the metatables of their per-call copies.
  lua_newtable(L);
  PushLibCopy(L, "string", "dump", nullptr);
  lua_setfield(L, -2, "string");
  PushLibCopy(L, "table", nullptr, nullptr);
  lua_setfield(L, -2, "table");
  PushLibCopy(L, "math", nullptr, nullptr);
  lua_setfield(L, -2, "math");
  PushLibCopy(L, "os", nullptr, "clock");
  lua_setfield(L, -2, "os");
  lua_setfield(L, LUA_REGISTRYINDEX, kRegLibs);
  lua_newtable(L);
  for (const char* lib : kLibNames) {
    PushSandboxMeta(L, lib);
    lua_setfield(L, -2, lib);
  }
  lua_setfield(L, LUA_REGISTRYINDEX, kRegLibMetas);
  PushSandboxMeta(L, "");
  lua_setfield(L, LUA_REGISTRYINDEX, kRegEnvMeta);

  // The string metatable: methods come from a dump-less copy, and the metatable itself is hidden.
  lua_pushliteral(L, "");
  const int has_string_meta = lua_getmetatable(L, -1);
  FERRY_CHECK(has_string_meta != 0) << "LuaJIT strings have a metatable";
  PushLibCopy(L, "string", "dump", nullptr);
  lua_setfield(L, -2, "__index");
  lua_pushstring(L, kProtected);
  lua_setfield(L, -2, "__metatable");
  lua_pop(L, 2);

  // The chunk's environment: an always-empty proxy whose metatable routes global reads and writes
  // to the environment of the current call (see RouteGlobalsTo).
  lua_newtable(L);
  lua_newtable(L);
  lua_pushstring(L, kProtected);
  lua_setfield(L, -2, "__metatable");
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, kRegRoute);
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, kRegProxy);

  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, kRegHooks);
  return 0;
}

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

}  // namespace

LuaRuntime::LuaRuntime(std::string name, const PolicyOptions& options)
    : name_(std::move(name)), options_(options) {
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
  rt->L_ = lua_newstate(LimitedAlloc, &rt->budget_);
  rt->budget_.custom_allocator = rt->L_ != nullptr;
  if (rt->L_ == nullptr) rt->L_ = luaL_newstate();
  if (rt->L_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(rt->name_, ": cannot create a Lua state"));
  }
  lua_State* L = rt->L_;
  // Policies are small; the interpreter honours the count hook on every instruction, compiled
  // traces would not.
  luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
  if (lua_cpcall(L, SetupSandbox, &rt->budget_) != 0) {
    std::string message = lua_isstring(L, -1) ? lua_tostring(L, -1) : "unknown error";
    lua_pop(L, 1);
    return absl::InternalError(
        absl::StrCat(rt->name_, ": cannot set up the policy sandbox: ", message));
  }
  FERRY_CHECK(lua_gettop(L) == 0);
  return rt;
}

void LuaRuntime::PushFreshEnv() {
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
  lua_getfield(L, LUA_REGISTRYINDEX, kRegGlobals);
  if (lua_istable(L, -1)) CopyTable(L, lua_gettop(L), env);
  lua_pop(L, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, kRegEnvMeta);
  lua_setmetatable(L, env);
}

void LuaRuntime::RouteGlobalsTo() {
  lua_State* L = L_;
  lua_getfield(L, LUA_REGISTRYINDEX, kRegRoute);
  lua_pushvalue(L, -2);
  lua_setfield(L, -2, "__index");
  lua_pushvalue(L, -2);
  lua_setfield(L, -2, "__newindex");
  lua_pop(L, 2);
}

void LuaRuntime::RouteGlobalsNowhere() {
  lua_State* L = L_;
  lua_getfield(L, LUA_REGISTRYINDEX, kRegRoute);
  lua_pushnil(L);
  lua_setfield(L, -2, "__index");
  lua_pushnil(L);
  lua_setfield(L, -2, "__newindex");
  lua_pop(L, 1);
}

absl::Status LuaRuntime::ProtectedCall(std::string_view what, int nargs, int nresults) {
  lua_State* L = L_;
  const int func = lua_gettop(L) - nargs;
  FERRY_CHECK(func >= 1);
  lua_pushcfunction(L, TracebackHandler);
  lua_insert(L, func);  // handler below the function

  budget_.instructions = 0;
  budget_.instruction_limit_hit = false;
  budget_.hook_interval = static_cast<int>(std::min<int64_t>(1000, options_.instruction_limit));
  budget_.memory_refused = false;
  budget_.c_stack_base = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  lua_sethook(L, CountHook, LUA_MASKCOUNT | LUA_MASKCALL, budget_.hook_interval);
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
  const std::string prefix =
      absl::StrCat(name_, ": ", absl::string_view(what.data(), what.size()), ": ");
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
  return absl::InvalidArgumentError(absl::StrCat(prefix, message));
}

absl::Status LuaRuntime::Load(std::string_view source, const std::string& lua_chunk_name) {
  lua_State* L = L_;
  StackRestorer restore(L);
  budget_.enforce = true;
  const int rc = luaL_loadbufferx(L, source.data(), source.size(), lua_chunk_name.c_str(), "t");
  budget_.enforce = false;
  if (rc != 0) {
    std::string message = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "(no message)";
    if (rc == LUA_ERRMEM) {
      return absl::ResourceExhaustedError(
          absl::StrCat(name_, ": memory limit exceeded while compiling (", message, ")"));
    }
    // Mode "t" is what refuses bytecode; say so in words.
    if (!source.empty() && source[0] == LUA_SIGNATURE[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_,
          ": is a precompiled (bytecode) chunk; policies are loaded from Lua source text "
          "only (",
          message, ")"));
    }
    return absl::InvalidArgumentError(absl::StrCat(name_, ": cannot load: ", message));
  }
  // The chunk (and every function it creates) sees globals through the proxy.
  lua_getfield(L, LUA_REGISTRYINDEX, kRegProxy);
  lua_setfenv(L, -2);
  // Top-level globals land in a table of their own, which later calls see (shallow-copied).
  lua_newtable(L);
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, kRegGlobals);
  lua_createtable(L, 0, 2);
  PushFreshEnv();
  lua_setfield(L, -2, "__index");
  lua_pushstring(L, kProtected);
  lua_setfield(L, -2, "__metatable");
  lua_setmetatable(L, -2);
  RouteGlobalsTo();
  absl::Status status = ProtectedCall("top level", 0, 1);
  RouteGlobalsNowhere();
  FERRY_RETURN_IF_ERROR(status);

  // The module table: hook name -> function.
  const int module = lua_gettop(L);
  if (lua_type(L, module) != LUA_TTABLE) {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ": the chunk returned ", luaL_typename(L, module),
                     "; expected a table of hooks (", kHookList, ")"));
  }
  lua_getfield(L, LUA_REGISTRYINDEX, kRegHooks);
  const int hooks = lua_gettop(L);
  lua_pushnil(L);
  while (lua_next(L, module) != 0) {
    if (lua_type(L, -2) != LUA_TSTRING) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": the returned table has a ", luaL_typename(L, -2),
                       " key; expected only hook names (", kHookList, ")"));
    }
    const std::string key = lua_tostring(L, -2);
    const bool known =
        std::find(std::begin(kHookNames), std::end(kHookNames), key) != std::end(kHookNames);
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": the returned table has unknown hook \"", key,
                       "\"; expected ", kHookList));
    }
    if (lua_type(L, -1) != LUA_TFUNCTION) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, ": hook \"", key, "\" is a ", luaL_typename(L, -1), "; expected a function"));
    }
    lua_pushvalue(L, -2);
    lua_insert(L, -2);
    lua_rawset(L, hooks);
  }
  return absl::OkStatus();
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
  lua_Debug ar;
  if (lua_getinfo(L, ">S", &ar) == 0 || ar.source == nullptr) return name_;
  // "@path" for files, "=name" for LoadString: drop the marker, keep the whole name.
  const char* source = ar.source[0] == '@' || ar.source[0] == '=' ? ar.source + 1 : ar.source;
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
  PushFreshEnv();
  RouteGlobalsTo();
  absl::Status status =
      ProtectedCall(absl::StrCat(absl::string_view(hook.data(), hook.size()), "()"), nargs, 1);
  RouteGlobalsNowhere();
  FERRY_RETURN_IF_ERROR(status);
  return read_result(L, lua_gettop(L));
}

}  // namespace ferry
