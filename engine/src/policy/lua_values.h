// Small helpers the policy layer uses to build hook arguments in Lua and to read hook results back
// without running any Lua code: raw table operations only, no metamethods (internal to the policy
// layer; split out of policy.cc).
#ifndef FERRY_POLICY_LUA_VALUES_H_
#define FERRY_POLICY_LUA_VALUES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/adam_state.h"
#include "ferry/dtype.h"
#include "policy/policy_types.h"

struct lua_State;

namespace ferry::policy_internal {

// Debian's Abseil has its own absl::string_view, which std::string_view does not convert to.
inline absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// ---- host -> Lua (raw operations on the fresh table on top of the stack)
void SetString(lua_State* L, const char* key, std::string_view value);
void SetNumber(lua_State* L, const char* key, int64_t value);
void SetBool(lua_State* L, const char* key, bool value);
void PushStringArray(lua_State* L, const std::vector<std::string>& values);
void SetStringArray(lua_State* L, const char* key, const std::vector<std::string>& values);

// ---- Lua -> host
// A Lua string as it appears in messages: quoted, escaped, truncated.
std::string Quote(std::string_view s);
// Describes the value at `idx` without running any metamethod: "\"disk\"", "the number 3", "nil",
// "the boolean true", "a table", ...
std::string Describe(lua_State* L, int idx);
// The string at `idx` (REQUIRES: lua_type == LUA_TSTRING).
std::string_view StringAt(lua_State* L, int idx);
// Whether the value at `idx` is the string `value`.
bool IsString(lua_State* L, int idx, std::string_view value);
// Pushes t[key] read raw (the table at absolute index `t`).
void RawGetField(lua_State* L, int t, const char* key);

// Builds the errors of one hook call: "<policy>: <hook>(): <detail>", and for a wrong result
// " (hook defined at <file>:<line>)" after it.
class Checker final {
 public:
  Checker(std::string_view policy, std::string_view hook) : policy_(policy), hook_(hook) {}
  // Called once the hook is known to exist, before its result is read.
  void set_location(std::string location) { location_ = std::move(location); }
  absl::Status Error(std::string_view detail) const {
    return absl::InvalidArgumentError(
        absl::StrCat(AV(policy_), ": ", AV(hook_), "(): ", AV(detail),
                     location_.empty() ? "" : absl::StrCat(" (hook defined at ", location_, ")")));
  }

 private:
  std::string_view policy_;
  std::string_view hook_;
  std::string location_;
};

// A group's place() value given as a table (at absolute index `idx`): { device = "cpu"|"gpu",
// moments = "fp32"|"bf16", master = "fp32"|"bf16", rounding = "nearest"|"stochastic" }. Checks every
// field (unknown keys included), and that a bf16 master is asked only for bf16 params (`dtype`, the
// group's). On error nothing is written.
absl::Status ReadPlaceTable(lua_State* L, int idx, const Checker& c, std::string_view group, DType dtype,
                            PlaceKind* kind, StateFormat* format);

}  // namespace ferry::policy_internal

#endif  // FERRY_POLICY_LUA_VALUES_H_
