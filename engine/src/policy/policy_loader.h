// What lets one policy build on another (ferry.policy), apart from the Lua state itself: where a
// base's name leads (shipped policies by name, files of the policy's own directory; nothing else),
// reading policy files, the module table a chunk returns (hooks and its declared args), and the
// hook wrappers through which a derived policy calls its base with the base's own args. Internal
// to the policy layer (LuaRuntime is its user).
#ifndef FERRY_POLICY_POLICY_LOADER_H_
#define FERRY_POLICY_POLICY_LOADER_H_

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "policy/policy.h"

struct lua_State;

namespace ferry::policy_internal {

// A policy's declared args (arg name -> description), or nullopt when it declares none.
using DeclaredArgs = std::optional<std::map<std::string, std::string>>;

// Where a base named in ferry.policy(name) lives.
struct ResolvedPolicy {
  std::string path;       // what messages and chunk names show: <dir>/<file>
  std::string canonical;  // the real path, for cycle checks
  std::string dir;        // its directory: where its own ferry.policy("x.lua") calls look
};

// The directory of the shipped policies: options.shipped_policy_dir, else $FERRY_POLICY_DIR, else
// the source tree's scripts/policies when it exists, else the install tree's share/ferry/policies.
std::string ShippedPolicyDir(const PolicyOptions& options);

// The real path of `path` (symbolic links resolved), or "" when it does not exist.
std::string RealPath(const std::string& path);

// The directory of the policy file `path` ("." for a bare file name).
std::string DirectoryOf(const std::string& path);

// Resolves ferry.policy's `name`: a name without ".lua" ("offload_fraction") is a shipped policy;
// "name.lua" is a file in `from_dir` (the calling policy's directory; empty for a policy loaded from
// a string, which may load shipped policies only). Refused with InvalidArgument: absolute paths,
// any '/' (so "../x.lua" and "sub/x.lua"), names that are neither, and a file whose real path is
// outside its directory (a symbolic link out). NotFound for a file that does not exist (the
// message lists the shipped policies for a shipped name).
absl::StatusOr<ResolvedPolicy> ResolvePolicyName(std::string_view name, const std::string& from_dir,
                                                 const std::string& shipped_dir);

// The whole file (NotFound / PermissionDenied / Internal naming it on failure).
absl::StatusOr<std::string> ReadPolicyFile(const std::string& path);

// Checks the module table at absolute index `module` that the chunk `name` returned: string keys
// only; "args" (optional) a table of arg name -> description (strings); every other key a hook
// name with a function value. Sets `*declared` to the "args" declaration. Runs no Lua code.
absl::Status ReadModule(lua_State* L, int module, std::string_view name, DeclaredArgs* declared);

// "fraction, numa" (or "no args").
std::string KnownArgs(const std::map<std::string, std::string>& declared);

// InvalidArgument naming the first arg of `args` that `declared` lacks, and the known ones;
// OK when every arg is declared or nothing is declared. `who` names the policy in the message.
absl::Status CheckArgsAgainst(std::string_view who, const DeclaredArgs& declared,
                              const std::map<std::string, std::string>& args);

// Pushes a wrapper of the function at absolute index `fn` (a base's hook): it calls the hook with
// ctx.args replaced by the base's args, in a shallow copy of ctx. The base's args: the caller's
// ctx.args whose names are in `shared` (all of them when `shared` is nullopt and there are no fixed
// args; none when it is nullopt and there are), then the fixed args of the table at absolute index
// `args` (0: none) over them. The wrapper is recorded so that UnwrapHook can see through it.
void PushHookWrapper(lua_State* L, int fn, int args, const DeclaredArgs& shared);

// Replaces the function on top of the stack by the base hook it wraps, repeatedly (no-op for a
// function that is no wrapper).
void UnwrapHook(lua_State* L);

}  // namespace ferry::policy_internal

#endif  // FERRY_POLICY_POLICY_LOADER_H_
