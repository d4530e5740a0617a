// The sandboxed LuaJIT state behind a Policy: state creation with a memory cap, the chunks it has
// loaded (the policy and the bases it builds on through ferry.policy), each with its own globals,
// text-only chunk loading, and the one wrapper through which every call into Lua goes. The sandbox
// itself is lua_sandbox.h; name resolution, module tables and hook wrappers are policy_loader.h.
// Internal to the policy layer (policy.h is the interface); callers include <lua.hpp> themselves.
#ifndef FERRY_POLICY_LUA_RUNTIME_H_
#define FERRY_POLICY_LUA_RUNTIME_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "policy/lua_sandbox.h"
#include "policy/policy.h"
#include "policy/policy_loader.h"

struct lua_State;

namespace ferry {

// The hook names a policy module may define.
inline constexpr std::string_view kHookNames[] = {"place", "after_load", "checkpoint", "on_step"};

// Thread-safety: one thread at a time.
class LuaRuntime final {
 public:
  using Budget = policy_internal::SandboxBudget;

  // Creates a state with the sandbox installed. `name` names the policy in every message.
  // Errors: ResourceExhausted if the state cannot be created, Internal if the sandbox setup fails.
  static absl::StatusOr<std::unique_ptr<LuaRuntime>> Create(std::string name,
                                                            const PolicyOptions& options);
  LuaRuntime(const LuaRuntime&) = delete;
  LuaRuntime& operator=(const LuaRuntime&) = delete;
  ~LuaRuntime();

  // Compiles `source` as text (bytecode is refused) under the Lua chunk name `lua_chunk_name`
  // ("@path" or "=name"), runs its top level in the sandbox and keeps the hooks and the args
  // declaration of the table it returns. `file` is the file the source came from ("" for a string):
  // ferry.policy("x.lua") calls look for x.lua in its directory. The bases the top level loads run
  // in this state, under the same limits (they count against the top level's). REQUIRES: called
  // once, before any CallHook.
  absl::Status Load(std::string_view source, const std::string& lua_chunk_name,
                    const std::string& file);

  bool HasHook(std::string_view hook) const;

  // Where hook `hook` is defined: "file:line" (the file as given to LoadFile or as ferry.policy
  // resolved it, or the chunk name). A hook taken over from a base names the base's function.
  // REQUIRES: HasHook(hook).
  std::string HookLocation(std::string_view hook) const;

  // Pushes the hook's function, calls `push_args` (which must push exactly the arguments it returns
  // the count of, using raw table operations only), runs the hook through the protected wrapper
  // with fresh global environments (one per loaded chunk) and the limits, and on success calls
  // `read_result(L, index)` with the absolute stack index of the hook's single result. The stack is
  // restored in every case. REQUIRES: HasHook(hook).
  absl::Status CallHook(std::string_view hook, absl::FunctionRef<int(lua_State*)> push_args,
                        absl::FunctionRef<absl::Status(lua_State*, int)> read_result);

  const std::string& name() const { return name_; }
  // Every file loaded: the policy's own (when it came from a file) first, then its bases in the
  // order their ferry.policy calls ran.
  const std::vector<std::string>& files() const { return files_; }
  // The args the policy's returned table declares (nullopt: none declared, so none checked).
  const policy_internal::DeclaredArgs& declared_args() const { return declared_args_; }

 private:
  // A chunk whose top level is running (the policy, then each base it loads in turn).
  struct Loading {
    std::string path;       // as shown in messages ("" for a string)
    std::string canonical;  // real path ("" for a string)
    std::string dir;        // where its ferry.policy("x.lua") looks ("" for a string)
    struct Forward {        // a ferry.policy(name) call without args: the base shares ctx.args
      std::string base;
      std::string where;  // "file:line: "
      std::map<std::string, std::string> declared;  // the base's declaration
    };
    std::vector<Forward> forwards;
  };

  LuaRuntime(std::string name, const PolicyOptions& options);

  // The single wrapper around lua_pcall. REQUIRES: a function and `nargs` arguments on top of the
  // stack. On success they are replaced by `nresults` results; on failure they are popped and the
  // error becomes a Status naming the policy and `what` (e.g. "place()").
  absl::Status ProtectedCall(std::string_view what, int nargs, int nresults);
  // Compiles `source` as a new chunk with an environment of its own, whose globals go to a fresh
  // table while its top level runs. On success pushes the chunk's function; on failure pushes
  // nothing and returns the error (naming `display`).
  absl::Status CompileChunk(std::string_view source, const std::string& lua_chunk_name,
                            std::string_view display);
  // Pushes a fresh global environment for chunk `chunk` (base functions, fresh library copies, the
  // chunk's globals).
  void PushFreshEnv(int chunk);
  // Routes every chunk's globals to a fresh environment (a hook call), or to nothing.
  void RouteAllToFreshEnvs();
  void RouteAllNowhere();
  // Whether `module`'s args declaration covers every arg of the bases `chunk` forwards its args to.
  absl::Status CheckForwards(const Loading& chunk, const policy_internal::DeclaredArgs& declared,
                             std::string_view who) const;

  // ferry.policy(name [, args]): a C function; see policy.h. LoadBase does the work and leaves the
  // result table (returns true) or an error message (false) on the stack.
  static int PolicyFunction(lua_State* L);
  bool LoadBase(lua_State* L);
  bool LoadBaseChecked(lua_State* L, std::string* error);

  std::string name_;
  PolicyOptions options_;
  std::string shipped_dir_;
  Budget budget_;  // address stable: the allocator and the registry point at it
  lua_State* L_ = nullptr;
  int chunks_ = 0;  // chunks compiled (entries of the registry's chunk list)
  std::vector<Loading> loading_;
  std::vector<std::string> files_;
  policy_internal::DeclaredArgs declared_args_;
};

}  // namespace ferry

#endif  // FERRY_POLICY_LUA_RUNTIME_H_
