// A Lua policy: a sandboxed LuaJIT state running one policy file, whose hooks decide placement,
// what to sync after a load, and what a checkpoint writes. The engine acts only on the validated
// structs of policy_types.h. See ARCHITECTURE.md "Policies (Lua)" for the Lua-side shapes.
//
// Sandbox. A policy sees an allow-listed environment: assert error ipairs next pairs pcall select
// tonumber tostring type unpack xpcall rawequal rawget rawset getmetatable setmetatable _VERSION,
// collectgarbage("count") only (xpcall runs its handler once the error has unwound the stack, so
// a handler cannot escape the instruction limit), and the libraries string (without dump), table,
// math and os (clock only). Everything else (io, package, require, ffi, jit, debug, load,
// loadstring, dofile, loadfile, newproxy, setfenv, getfenv, module, coroutine, print, _G) is
// absent; naming one of them is an error that says so. Chunks load as text only (bytecode is
// refused). Every hook call, and the chunk's top level at load time, runs under an instruction
// limit and a memory limit, with a fresh global environment: globals the chunk's top level defined
// are visible (shallow copies), globals a hook sets vanish when it returns, and the library tables
// are fresh copies per call. State kept in the chunk's local variables (upvalues) persists across
// calls, as in any Lua module. The string metatable is protected (getmetatable("") returns a
// string, not the table). The JIT compiler is off: policies are small, and the interpreter honours
// the instruction-count hook everywhere. Known limit: a single C library call (e.g. a pathological
// string.find pattern) runs to completion before the instruction limit can stop it; its memory is
// still bounded.
//
// Deep recursion is a clean error, never a crash. Lua frames live on Lua's own bounded stack
// ("stack overflow"). Recursion through C functions that call back into Lua (string.gsub with a
// function or table replacement, table.sort's comparator, xpcall, __tostring under string.format)
// grows the host's C stack instead; a call hook refuses to enter a Lua function once the C stack
// has grown 256 KiB below where the hook call began ("C stack overflow"; kCStackLimitBytes in
// lua_runtime.cc), so a policy cannot overflow the caller's stack, even a small thread stack.
//
// Composition. The sandbox has one more name, ferry.policy(name [, args]), callable from a policy's
// top level only: it loads a shipped policy ("offload_fraction": <shipped dir>/offload_fraction.lua,
// PolicyOptions::shipped_policy_dir) or a file of the calling policy's own directory ("x.lua") into
// this state, with globals of its own, and returns its hooks wrapped so that they see the base's
// args: the fixed `args` of the call, and of the caller's ctx.args those the base declares and the
// call does not fix (listed in the returned table's `args`). Absolute paths, any '/', links out of
// the directory, cycles and missing files are refused (InvalidArgument / NotFound, naming the call
// and the file). The base's top level and hooks count against the same limits as the policy's.
//
// Declared args. A returned table may declare `args = { name = "description", ... }`; then every
// hook refuses ctx.args holding a name not declared (InvalidArgument naming it and the known ones).
// A policy that shares args with a base (above) must declare the shared ones too.
//
// Results are read raw (metatables on returned tables are ignored) and validated completely; an
// error names the policy, the hook, the field, and what was expected versus found, and ends with
// where the hook is defined ("(hook defined at file:line)").
#ifndef FERRY_POLICY_POLICY_H_
#define FERRY_POLICY_POLICY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "policy/policy_types.h"

namespace ferry {

class LuaRuntime;  // lua_runtime.h: the sandboxed state

struct PolicyOptions {
  // Lua VM instructions allowed per hook call (and for the chunk's top level at load time).
  int64_t instruction_limit = 10'000'000;
  // Bytes the whole Lua state may hold while policy code runs (a larger allocation is refused and
  // the call fails with ResourceExhausted). The idle state itself takes ~100 KiB; garbage not yet
  // collected counts too (LuaJIT's collector keeps it within about twice the live data).
  int64_t memory_limit_bytes = int64_t{64} << 20;
  // Where ferry.policy("name") finds shipped policies. Empty: $FERRY_POLICY_DIR, else the source
  // tree's scripts/policies when it exists, else the install tree's share/ferry/policies.
  std::string shipped_policy_dir;
};

// Thread-safety: one thread at a time (the Lua state is not shareable). Different Policy objects
// are independent and may be used from different threads concurrently.
class Policy final {
 public:
  // Loads a policy file into a fresh sandboxed state and runs its top level, which must return a
  // table whose keys are hook names ("place", "after_load", "checkpoint", "on_step"; each optional)
  // and whose values are functions. Errors: NotFound/PermissionDenied for an unreadable file; InvalidArgument
  // for bytecode, syntax errors (with file:line), runtime errors of the top level and a wrong
  // module table; ResourceExhausted for the instruction or memory limit. Messages name the file.
  static absl::StatusOr<std::unique_ptr<Policy>> LoadFile(const std::string& path,
                                                          const PolicyOptions& options = {});
  // Same from source text. `chunk_name` (e.g. "offload_fraction.lua") names the policy in messages
  // and is what path() returns.
  static absl::StatusOr<std::unique_ptr<Policy>> LoadString(std::string_view source,
                                                            std::string_view chunk_name,
                                                            const PolicyOptions& options = {});

  Policy(const Policy&) = delete;
  Policy& operator=(const Policy&) = delete;
  ~Policy();

  // The file path given to LoadFile, or the chunk name given to LoadString.
  const std::string& path() const { return path_; }
  // Whether the policy defines hook `name` ("place", "after_load", "checkpoint" or "on_step").
  bool has_hook(std::string_view name) const;
  // Where hook `name` is defined, "file:line" (a hook taken over from a base through ferry.policy
  // names the base's file); "" when the policy has no such hook.
  std::string hook_location(std::string_view name) const;
  // Every file this policy loaded: its own (LoadFile) first, then the bases of ferry.policy calls
  // in the order they ran. A hot reload (Engine::ReloadPolicy) reads them all again.
  const std::vector<std::string>& files() const;
  // The args the policy declares (`args = { name = "description", ... }` in its returned table), or
  // nullopt when it declares none (then any args are accepted).
  const std::optional<std::map<std::string, std::string>>& declared_args() const;
  // InvalidArgument naming the first arg of `args` the policy does not declare, and the ones it
  // does ("<path>: unknown arg \"fracton\" (fracton=0.25); it takes fraction, from, numa"). OK when all
  // are declared or the policy declares none. Every hook below checks ctx.args this way first.
  absl::Status CheckArgs(const std::map<std::string, std::string>& args) const;

  // Hooks. Each validates its inputs (group names non-empty and unique: InvalidArgument otherwise),
  // calls the Lua hook if the policy has one, and validates the result completely. On any error the
  // Policy is unchanged apart from state the script itself keeps in upvalues, and stays usable.
  // Errors: InvalidArgument for a Lua runtime error (message with file:line, hook and traceback) or
  // a wrong result; ResourceExhausted when the call hit the instruction or memory limit.
  //
  // place(groups, ctx). Default when absent: every group "gpu", no NUMA mode, no spare-state bound.
  // The result names every group of `groups` exactly once; besides the groups it may hold the keys
  // "numa" (a NUMA mode) and "spare_state" (a number in [0, 1]: Placement::spare_state). A group
  // named "numa" or "spare_state" is still placed under its name ("cpu", "gpu" or a table).
  absl::StatusOr<Placement> Place(absl::Span<const GroupInfo> groups, const PolicyContext& ctx);

  // after_load(event, ctx). `groups` are all the engine's groups: sync "all" means these, and every
  // named group must be one of them (event.groups must be too). Lua sees event.groups =
  // event.groups and event.all_groups = the names of `groups`. Fields missing from the result take
  // the defaults. Default when absent: sync all groups when !masters_loaded, else none;
  // reset_optimizer = !optimizer_loaded. sync_groups come back in `groups` order.
  absl::StatusOr<SyncPlan> AfterLoad(const LoadEvent& event, absl::Span<const GroupInfo> groups,
                                     const PolicyContext& ctx);

  // checkpoint(info, ctx). Fields missing from the result take the defaults. Default when absent:
  // nothing skipped, synchronous, keep all. skip_groups come back in info.groups order.
  absl::StatusOr<CheckpointPlan> Checkpoint(const CheckpointInfo& info, const PolicyContext& ctx);

  // on_step(stats, ctx), after an optimizer step. The hook returns nil or {} (nothing to do), or
  // {move = {[group] = "cpu" | "gpu", ...}} naming groups of stats.groups. A group named with the
  // placement it already has is left out of the request; the moves come back in stats.groups order.
  // Default when absent: an empty request, without entering Lua (cheap enough to call every step;
  // has_hook("on_step") tells whether building StepStats is worth it).
  absl::StatusOr<MoveRequest> OnStep(const StepStats& stats, const PolicyContext& ctx);

 private:
  Policy(std::string path, std::unique_ptr<LuaRuntime> lua);

  std::string path_;
  std::unique_ptr<LuaRuntime> lua_;
};

}  // namespace ferry

#endif  // FERRY_POLICY_POLICY_H_
