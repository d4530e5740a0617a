// The policy sandbox's building blocks: the memory-capped allocator, the instruction-count and C
// stack hook, the traceback handler, and the setup of the allow-listed environment templates kept
// in the Lua registry. Internal to the policy layer (LuaRuntime, lua_runtime.h, is their one user).
#ifndef FERRY_POLICY_LUA_SANDBOX_H_
#define FERRY_POLICY_LUA_SANDBOX_H_

#include <cstddef>
#include <cstdint>

struct lua_State;
struct lua_Debug;

namespace ferry::policy_internal {

// What one protected call may spend, and has spent. Reached by the allocator (its ud) and by the
// count hook (through the registry).
struct SandboxBudget {
  int64_t memory_used = 0;  // bytes held by the Lua allocator
  int64_t memory_limit = 0;
  bool enforce = false;  // true only while policy code runs (host pushes are never refused)
  bool memory_refused = false;    // an allocation was refused since the current call began
  bool custom_allocator = false;  // false: luaL_newstate fallback, memory checked in the hook
  int64_t instructions = 0;       // counted in steps of hook_interval
  int64_t instruction_limit = 0;
  int hook_interval = 1000;
  bool instruction_limit_hit = false;
  // Frame address of the protected call in progress (0: none). The call hook refuses to let the C
  // stack grow more than kCStackLimitBytes below it (recursion through C functions).
  uintptr_t c_stack_base = 0;
};

// Registry keys (named fields of the registry, which has no metatable).
inline constexpr char kRegBudget[] = "ferry.policy.budget";  // lightuserdata: SandboxBudget*
inline constexpr char kRegBase[] = "ferry.policy.base";      // allowed base functions (template)
inline constexpr char kRegLibs[] = "ferry.policy.libs";      // library templates, by name
inline constexpr char kRegLibMetas[] = "ferry.policy.lib_metas";  // lib name -> metatable of copies
inline constexpr char kRegEnvMeta[] = "ferry.policy.env_meta";    // metatable of every environment
inline constexpr char kRegHooks[] = "ferry.policy.hooks";         // hook name -> function

inline constexpr char kProtected[] = "protected by the policy sandbox";

// The libraries every environment gets a fresh copy of. "ferry" holds only ferry.policy.
inline constexpr const char* kLibNames[] = {"string", "table", "math", "os", "ferry"};

// What SetupSandbox gets as its light userdata argument.
struct SandboxSetup {
  SandboxBudget* budget;
  int (*policy_function)(lua_State*);  // ferry.policy
};

// Runs in protected mode (lua_cpcall with a SandboxSetup*): opens the libraries and builds the
// templates under the registry keys above.
int SetupSandbox(lua_State* L);

// The Lua allocator: realloc/free with the byte budget of `ud` (a SandboxBudget*) enforced while
// policy code runs. Shrinking never fails.
void* LimitedAlloc(void* ud, void* ptr, size_t osize, size_t nsize);

// The hook of every protected call: bounds the instruction count and the C stack.
void CountHook(lua_State* L, lua_Debug* ar);

// Message handler of every protected call: appends a traceback.
int TracebackHandler(lua_State* L);

// Copies the raw entries of the table at `from` into the table at `to` (absolute indices).
void CopyTable(lua_State* L, int from, int to);

}  // namespace ferry::policy_internal

#endif  // FERRY_POLICY_LUA_SANDBOX_H_
