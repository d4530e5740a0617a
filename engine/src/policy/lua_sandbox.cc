// The policy sandbox's building blocks (lua_sandbox.h). Split out of lua_runtime.cc.
#include "policy/lua_sandbox.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "base/logging.h"

#if __has_include(<luajit-2.1/lua.hpp>)
#include <luajit-2.1/lua.hpp>
#else
#include <lua.hpp>
#endif

namespace ferry::policy_internal {

// How far the C stack may grow below the protected call while policy code runs. The VM itself does
// not recurse on the C stack for Lua-to-Lua calls; only C functions that call back into Lua do
// (string.gsub with a function or table replacement keeps an 8 KiB buffer per level and would
// overflow the host's stack long before Lua's own stack limit). Small enough for a thread with a
// modest stack, large enough that no reasonable policy comes near it.
constexpr uintptr_t kCStackLimitBytes = 256 << 10;

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

static bool IsForbiddenGlobal(const char* name) {
  for (const char* f : kForbiddenGlobals) {
    if (std::strcmp(f, name) == 0) return true;
  }
  return false;
}

// The Lua allocator: realloc/free with a byte budget enforced while policy code runs. Shrinking
// never fails (Lua relies on that).
void* LimitedAlloc(void* ud, void* ptr, size_t osize, size_t nsize) {
  auto* budget = static_cast<SandboxBudget*>(ud);
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

static SandboxBudget* GetBudget(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, kRegBudget);
  auto* budget = static_cast<SandboxBudget*>(lua_touserdata(L, -1));
  lua_pop(L, 1);
  return budget;
}

// The hook of every protected call. On each function call it bounds the C stack (see
// kCStackLimitBytes): a call made from deep inside nested C functions fails instead of overflowing
// the host's stack. Every hook_interval instructions it bounds the instruction count; once the
// limit is hit it fires on every instruction, so a script that catches the error with pcall is
// stopped again at once.
void CountHook(lua_State* L, lua_Debug* ar) {
  SandboxBudget* budget = GetBudget(L);
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
static int SandboxIndex(lua_State* L) {
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
  if (std::strcmp(lib, "ferry") == 0) {
    return luaL_error(L,
                      "'ferry.%s' is not available in the policy sandbox (only ferry.policy is; "
                      "the ferry module of `ferry run` scripts is not)",
                      key);
  }
  if (std::strcmp(lib, "string") == 0 && std::strcmp(key, "dump") == 0) {
    return luaL_error(L, "'string.dump' is not available in the policy sandbox");
  }
  return 0;
}

// collectgarbage("count") only: policies must not drive the collector.
static int CollectGarbageCount(lua_State* L) {
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
static int SafeXpcall(lua_State* L) {
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
static void PushSandboxMeta(lua_State* L, const char* lib) {
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
static void PushLibCopy(lua_State* L, const char* lib, const char* drop, const char* only) {
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

// Runs in protected mode (lua_cpcall): opens the libraries and builds the sandbox templates.
int SetupSandbox(lua_State* L) {
  const auto* setup = static_cast<const SandboxSetup*>(lua_touserdata(L, 1));
  lua_pushlightuserdata(L, setup->budget);
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
  lua_createtable(L, 0, 1);  // ferry: only ferry.policy (policy_loader.h)
  lua_pushcfunction(L, setup->policy_function);
  lua_setfield(L, -2, "policy");
  lua_setfield(L, -2, "ferry");
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

  lua_newtable(L);
  lua_setfield(L, LUA_REGISTRYINDEX, kRegHooks);
  return 0;
}

}  // namespace ferry::policy_internal
