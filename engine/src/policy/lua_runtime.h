// The sandboxed LuaJIT state behind a Policy: state creation with a memory cap, the allow-listed
// environment, text-only chunk loading, and the one wrapper through which every call into Lua goes.
// Internal to the policy layer (policy.h is the interface); callers include <lua.hpp> themselves.
#ifndef FERRY_POLICY_LUA_RUNTIME_H_
#define FERRY_POLICY_LUA_RUNTIME_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "policy/policy.h"

struct lua_State;

namespace ferry {

// The hook names a policy module may define.
inline constexpr std::string_view kHookNames[] = {"place", "after_load", "checkpoint", "on_step"};

// Thread-safety: one thread at a time.
class LuaRuntime final {
 public:
  // What one call may spend, and has spent. Public only so the allocator and the count hook (free
  // functions in lua_runtime.cc, reached through the allocator's ud and the registry) can use it.
  struct Budget {
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

  // Creates a state with the sandbox installed. `name` names the policy in every message.
  // Errors: ResourceExhausted if the state cannot be created, Internal if the sandbox setup fails.
  static absl::StatusOr<std::unique_ptr<LuaRuntime>> Create(std::string name,
                                                            const PolicyOptions& options);
  LuaRuntime(const LuaRuntime&) = delete;
  LuaRuntime& operator=(const LuaRuntime&) = delete;
  ~LuaRuntime();

  // Compiles `source` as text (bytecode is refused) under the Lua chunk name `lua_chunk_name`
  // ("@path" or "=name"), runs its top level in the sandbox and keeps the hooks of the table it
  // returns. REQUIRES: called once, before any CallHook.
  absl::Status Load(std::string_view source, const std::string& lua_chunk_name);

  bool HasHook(std::string_view hook) const;

  // Where hook `hook` is defined: "file:line" (the file as given to LoadFile, or the chunk name).
  // REQUIRES: HasHook(hook).
  std::string HookLocation(std::string_view hook) const;

  // Pushes the hook's function, calls `push_args` (which must push exactly the arguments it returns
  // the count of, using raw table operations only), runs the hook through the protected wrapper
  // with a fresh global environment and the limits, and on success calls `read_result(L, index)`
  // with the absolute stack index of the hook's single result. The stack is restored in every case.
  // REQUIRES: HasHook(hook).
  absl::Status CallHook(std::string_view hook, absl::FunctionRef<int(lua_State*)> push_args,
                        absl::FunctionRef<absl::Status(lua_State*, int)> read_result);

  const std::string& name() const { return name_; }

 private:
  LuaRuntime(std::string name, const PolicyOptions& options);

  // The single wrapper around lua_pcall. REQUIRES: a function and `nargs` arguments on top of the
  // stack. On success they are replaced by `nresults` results; on failure they are popped and the
  // error becomes a Status naming the policy and `what` (e.g. "place()").
  absl::Status ProtectedCall(std::string_view what, int nargs, int nresults);
  // Pushes a fresh global environment (base functions, fresh library copies, the chunk's globals).
  void PushFreshEnv();
  // Points the chunk environment's proxy at the table on top of the stack (popped), or at nothing.
  void RouteGlobalsTo();
  void RouteGlobalsNowhere();

  std::string name_;
  PolicyOptions options_;
  Budget budget_;  // address stable: the allocator and the registry point at it
  lua_State* L_ = nullptr;
};

}  // namespace ferry

#endif  // FERRY_POLICY_LUA_RUNTIME_H_
