#include "policy/lua_values.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ferry/status.h"

#if __has_include(<luajit-2.1/lua.hpp>)
#include <luajit-2.1/lua.hpp>
#else
#include <lua.hpp>
#endif

namespace ferry::policy_internal {

void SetString(lua_State* L, const char* key, std::string_view value) {
  lua_pushlstring(L, value.data(), value.size());
  lua_setfield(L, -2, key);
}
void SetNumber(lua_State* L, const char* key, int64_t value) {
  lua_pushnumber(L, static_cast<lua_Number>(value));
  lua_setfield(L, -2, key);
}
void SetBool(lua_State* L, const char* key, bool value) {
  lua_pushboolean(L, value ? 1 : 0);
  lua_setfield(L, -2, key);
}
void PushStringArray(lua_State* L, const std::vector<std::string>& values) {
  lua_createtable(L, static_cast<int>(values.size()), 0);
  for (size_t i = 0; i < values.size(); ++i) {
    lua_pushlstring(L, values[i].data(), values[i].size());
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
}
void SetStringArray(lua_State* L, const char* key, const std::vector<std::string>& values) {
  PushStringArray(L, values);
  lua_setfield(L, -2, key);
}


// A Lua string as it appears in messages: quoted, escaped, truncated.
std::string Quote(std::string_view s) {
  constexpr size_t kMax = 80;
  if (s.size() > kMax) return absl::StrCat("\"", absl::CHexEscape(AV(s.substr(0, kMax))), "...\"");
  return absl::StrCat("\"", absl::CHexEscape(AV(s)), "\"");
}

// Describes the value at `idx` without running any metamethod: "\"disk\"", "the number 3", "nil",
// "the boolean true", "a table", ...
std::string Describe(lua_State* L, int idx) {
  switch (lua_type(L, idx)) {
    case LUA_TNIL: return "nil";
    case LUA_TSTRING: {
      size_t len = 0;
      const char* s = lua_tolstring(L, idx, &len);
      return Quote(std::string_view(s, len));
    }
    case LUA_TNUMBER:
      return absl::StrFormat("the number %.14g", lua_tonumber(L, idx));  // as Lua prints it
    case LUA_TBOOLEAN: return lua_toboolean(L, idx) ? "the boolean true" : "the boolean false";
    default: return absl::StrCat("a ", luaL_typename(L, idx));
  }
}

// The string at `idx` (REQUIRES: lua_type == LUA_TSTRING).
std::string_view StringAt(lua_State* L, int idx) {
  size_t len = 0;
  const char* s = lua_tolstring(L, idx, &len);
  return std::string_view(s, len);
}

bool IsString(lua_State* L, int idx, std::string_view value) {
  return lua_type(L, idx) == LUA_TSTRING && StringAt(L, idx) == value;
}

// Pushes t[key] read raw (the table at absolute index `t`).
void RawGetField(lua_State* L, int t, const char* key) {
  lua_pushstring(L, key);
  lua_rawget(L, t);
}

absl::Status ReadPlaceTable(lua_State* L, int idx, const Checker& c, std::string_view group, DType dtype,
                            PlaceKind* kind, StateFormat* format) {
  const std::string where = absl::StrCat("group ", Quote(group));
  lua_pushnil(L);
  while (lua_next(L, idx) != 0) {
    constexpr std::string_view kFields[] = {"device", "moments", "master", "rounding"};
    const bool known = lua_type(L, -2) == LUA_TSTRING &&
                       std::find(std::begin(kFields), std::end(kFields), StringAt(L, -2)) != std::end(kFields);
    if (!known) {
      return c.Error(absl::StrCat(where, " has unknown field ", Describe(L, -2),
                                  "; expected only \"device\", \"moments\", \"master\" and \"rounding\""));
    }
    lua_pop(L, 1);
  }
  StateFormat f;
  auto dtype_field = [&](const char* field, DType* out) -> absl::Status {
    RawGetField(L, idx, field);
    if (lua_isnil(L, -1)) {
      lua_pop(L, 1);
      return absl::OkStatus();
    }
    if (IsString(L, -1, "fp32")) {
      *out = DType::kF32;
    } else if (IsString(L, -1, "bf16")) {
      *out = DType::kBF16;
    } else {
      const std::string found = Describe(L, -1);
      lua_pop(L, 1);
      return c.Error(absl::StrCat(where, ": ", field, " is ", found, "; expected \"fp32\" or \"bf16\""));
    }
    lua_pop(L, 1);
    return absl::OkStatus();
  };
  RawGetField(L, idx, "device");
  if (!IsString(L, -1, "cpu") && !IsString(L, -1, "gpu")) {
    const std::string found = Describe(L, -1);
    lua_pop(L, 1);
    return c.Error(absl::StrCat(where, ": device is ", found, "; expected \"cpu\" or \"gpu\""));
  }
  *kind = IsString(L, -1, "cpu") ? PlaceKind::kCpu : PlaceKind::kGpu;
  lua_pop(L, 1);
  FERRY_RETURN_IF_ERROR(dtype_field("moments", &f.moments));
  FERRY_RETURN_IF_ERROR(dtype_field("master", &f.master));
  RawGetField(L, idx, "rounding");
  if (IsString(L, -1, "stochastic")) {
    f.rounding = StateRounding::kStochastic;
  } else if (!lua_isnil(L, -1) && !IsString(L, -1, "nearest")) {
    const std::string found = Describe(L, -1);
    lua_pop(L, 1);
    return c.Error(absl::StrCat(where, ": rounding is ", found, "; expected \"nearest\" or \"stochastic\""));
  }
  lua_pop(L, 1);
  if (f.master == DType::kBF16 && dtype != DType::kBF16) {
    return c.Error(absl::StrCat(where, ": master = \"bf16\" needs bf16 params, but its params are ",
                                AV(DTypeName(dtype)), " (a bf16 master would lose their precision)"));
  }
  *format = f;
  return absl::OkStatus();
}

}  // namespace ferry::policy_internal
