#include "policy/policy_loader.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/errors.h"
#include "policy/lua_sandbox.h"
#include "policy/lua_values.h"

#if __has_include(<luajit-2.1/lua.hpp>)
#include <luajit-2.1/lua.hpp>
#else
#include <lua.hpp>
#endif

namespace ferry::policy_internal {
namespace {

namespace fs = std::filesystem;

// Registry key: weak-keyed table, hook wrapper -> the base hook it calls.
constexpr char kRegWrapped[] = "ferry.policy.wrapped";

constexpr std::string_view kHookNames[] = {"place", "after_load", "checkpoint", "on_step"};
constexpr char kModuleKeys[] = "place, after_load, checkpoint or on_step, and optionally args";

bool IsShippedName(std::string_view name) {
  if (name.empty()) return false;
  for (char ch : name) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                    ch == '_' || ch == '-';
    if (!ok) return false;
  }
  return true;
}

std::vector<std::string> ShippedNames(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() == ".lua") names.push_back(p.stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Wrapper upvalues: 1 the base hook, 2 the fixed args table or false, 3 the set of shared arg names
// (name -> true) or false (the base declares no args: it shares all of them, or none when it has
// fixed args).
int HookWrapper(lua_State* L) {
  const int n = lua_gettop(L);
  if (n < 2) lua_settop(L, 2);
  const int nargs = lua_gettop(L);
  if (lua_type(L, 2) == LUA_TTABLE || lua_type(L, 2) == LUA_TNIL) {
    lua_newtable(L);  // ctx for the base: a shallow copy
    const int ctx = lua_gettop(L);
    if (lua_type(L, 2) == LUA_TTABLE) CopyTable(L, 2, ctx);
    lua_newtable(L);
    const int args = lua_gettop(L);
    const bool fixed = lua_type(L, lua_upvalueindex(2)) == LUA_TTABLE;
    const bool filter = lua_type(L, lua_upvalueindex(3)) == LUA_TTABLE;
    lua_pushliteral(L, "args");
    lua_rawget(L, ctx);
    const int given = lua_gettop(L);
    if (lua_type(L, given) == LUA_TTABLE && (filter || !fixed)) {
      lua_pushnil(L);
      while (lua_next(L, given) != 0) {
        bool keep = true;
        if (filter) {
          lua_pushvalue(L, -2);
          lua_rawget(L, lua_upvalueindex(3));
          keep = lua_toboolean(L, -1) != 0;
          lua_pop(L, 1);
        }
        if (keep) {
          lua_pushvalue(L, -2);
          lua_insert(L, -2);
          lua_rawset(L, args);
        } else {
          lua_pop(L, 1);
        }
      }
    }
    lua_pop(L, 1);  // given
    if (fixed) CopyTable(L, lua_upvalueindex(2), args);
    lua_pushliteral(L, "args");
    lua_insert(L, -2);
    lua_rawset(L, ctx);
    lua_replace(L, 2);
  }
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, nargs, LUA_MULTRET);
  return lua_gettop(L);
}

}  // namespace

std::string RealPath(const std::string& path) {
  char* real = realpath(path.c_str(), nullptr);
  if (real == nullptr) return "";
  std::string out(real);
  std::free(real);
  return out;
}

std::string ShippedPolicyDir(const PolicyOptions& options) {
  if (!options.shipped_policy_dir.empty()) return options.shipped_policy_dir;
  const char* env = std::getenv("FERRY_POLICY_DIR");
  if (env != nullptr && env[0] != '\0') return env;
  std::error_code ec;
#ifdef FERRY_POLICY_SOURCE_DIR
  if (fs::is_directory(FERRY_POLICY_SOURCE_DIR, ec)) return FERRY_POLICY_SOURCE_DIR;
#endif
#ifdef FERRY_POLICY_INSTALL_DIR
  if (fs::is_directory(FERRY_POLICY_INSTALL_DIR, ec)) return FERRY_POLICY_INSTALL_DIR;
#endif
  return "";
}

std::string DirectoryOf(const std::string& path) {
  const std::string parent = fs::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

absl::StatusOr<ResolvedPolicy> ResolvePolicyName(std::string_view name, const std::string& from_dir,
                                                 const std::string& shipped_dir) {
  const std::string quoted = Quote(name);
  const std::string allowed =
      "only a shipped policy by name (\"offload_fraction\") or a file in the policy's own "
      "directory (\"my_base.lua\") can be loaded";
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat("empty policy name; ", allowed));
  if (name.front() == '/') {
    return absl::InvalidArgumentError(absl::StrCat(quoted, " is an absolute path, refused; ", allowed));
  }
  if (absl::StrContains(AV(name), "/") || absl::StrContains(AV(name), "\\")) {
    const bool traversal = name == ".." || absl::StartsWith(AV(name), "../") ||
                           absl::StrContains(AV(name), "/../") || absl::EndsWith(AV(name), "/..") ||
                           absl::StrContains(AV(name), "..\\");
    return absl::InvalidArgumentError(
        absl::StrCat(quoted, traversal ? " leaves the policy's directory (path traversal), refused; "
                                       : " names another directory, refused; ",
                     allowed));
  }
  ResolvedPolicy out;
  if (absl::EndsWith(AV(name), ".lua")) {
    if (from_dir.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          quoted, ": a policy loaded from a string has no directory; it can load shipped policies "
                  "by name only"));
    }
    if (name.front() == '.') {
      return absl::InvalidArgumentError(absl::StrCat(quoted, " is a hidden file, refused; ", allowed));
    }
    out.dir = from_dir;
    out.path = absl::StrCat(from_dir, "/", AV(name));
  } else {
    if (!IsShippedName(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          quoted, " is neither a shipped policy's name (letters, digits, _ and -) nor a file name "
                  "ending in .lua; ",
          allowed));
    }
    if (shipped_dir.empty()) {
      return absl::NotFoundError(absl::StrCat("no shipped policy ", quoted,
                                              ": the shipped policies' directory is unknown (set "
                                              "FERRY_POLICY_DIR)"));
    }
    out.dir = shipped_dir;
    out.path = absl::StrCat(shipped_dir, "/", AV(name), ".lua");
  }
  out.canonical = RealPath(out.path);
  if (out.canonical.empty()) {
    if (absl::EndsWith(AV(name), ".lua")) {
      return absl::NotFoundError(absl::StrCat("no policy file ", out.path));
    }
    return absl::NotFoundError(absl::StrCat("no shipped policy ", quoted, " in ", shipped_dir,
                                            " (shipped: ", absl::StrJoin(ShippedNames(shipped_dir), ", "),
                                            ")"));
  }
  // A symbolic link out of the directory counts as leaving it.
  const std::string real_dir = RealPath(out.dir);
  if (real_dir.empty() || fs::path(out.canonical).parent_path().string() != real_dir) {
    return absl::InvalidArgumentError(absl::StrCat(out.path, " resolves to ", out.canonical,
                                                   ", outside ", out.dir, ", refused; ", allowed));
  }
  return out;
}

absl::StatusOr<std::string> ReadPolicyFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return PosixError(absl::StrCat("cannot open policy ", path), errno);
  std::string data;
  char buffer[1 << 14];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) data.append(buffer, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) return PosixError(absl::StrCat("cannot read policy ", path), err);
  return data;
}

absl::Status ReadModule(lua_State* L, int module, std::string_view name, DeclaredArgs* declared) {
  declared->reset();
  if (lua_type(L, module) != LUA_TTABLE) {
    return absl::InvalidArgumentError(absl::StrCat(AV(name), ": the chunk returned ",
                                                   luaL_typename(L, module),
                                                   "; expected a table of hooks (", kModuleKeys, ")"));
  }
  lua_pushnil(L);
  while (lua_next(L, module) != 0) {
    if (lua_type(L, -2) != LUA_TSTRING) {
      absl::Status s = absl::InvalidArgumentError(
          absl::StrCat(AV(name), ": the returned table has a ", luaL_typename(L, -2),
                       " key; expected only hook names (", kModuleKeys, ")"));
      lua_pop(L, 2);
      return s;
    }
    const std::string key(StringAt(L, -2));
    absl::Status s;
    if (key == "args") {
      if (lua_type(L, -1) != LUA_TTABLE) {
        s = absl::InvalidArgumentError(absl::StrCat(
            AV(name), ": field \"args\" is ", Describe(L, -1),
            "; expected a table declaring the policy's args (name = \"description\")"));
      } else {
        std::map<std::string, std::string> decl;
        const int t = lua_gettop(L);
        lua_pushnil(L);
        while (s.ok() && lua_next(L, t) != 0) {
          if (lua_type(L, -2) != LUA_TSTRING || lua_type(L, -1) != LUA_TSTRING) {
            s = absl::InvalidArgumentError(absl::StrCat(
                AV(name), ": field \"args\" has ", Describe(L, -2), " = ", Describe(L, -1),
                "; expected arg names mapped to descriptions (strings)"));
            lua_pop(L, 2);
            break;
          }
          decl.emplace(std::string(StringAt(L, -2)), std::string(StringAt(L, -1)));
          lua_pop(L, 1);
        }
        if (s.ok()) *declared = std::move(decl);
      }
    } else if (std::find(std::begin(kHookNames), std::end(kHookNames), key) == std::end(kHookNames)) {
      s = absl::InvalidArgumentError(absl::StrCat(AV(name), ": the returned table has unknown hook \"",
                                                  key, "\"; expected ", kModuleKeys));
    } else if (lua_type(L, -1) != LUA_TFUNCTION) {
      s = absl::InvalidArgumentError(absl::StrCat(AV(name), ": hook \"", key, "\" is a ",
                                                  luaL_typename(L, -1), "; expected a function"));
    }
    if (!s.ok()) {
      lua_pop(L, 2);
      return s;
    }
    lua_pop(L, 1);
  }
  return absl::OkStatus();
}

std::string KnownArgs(const std::map<std::string, std::string>& declared) {
  if (declared.empty()) return "no args";
  std::vector<std::string> names;
  for (const auto& [k, v] : declared) names.push_back(k);
  return absl::StrJoin(names, ", ");
}

absl::Status CheckArgsAgainst(std::string_view who, const DeclaredArgs& declared,
                              const std::map<std::string, std::string>& args) {
  if (!declared.has_value()) return absl::OkStatus();
  for (const auto& [key, value] : args) {
    if (!declared->contains(key)) {
      return absl::InvalidArgumentError(absl::StrCat(AV(who), ": unknown arg ", Quote(key), " (",
                                                     AV(key), "=", AV(value), "); it takes ",
                                                     KnownArgs(*declared)));
    }
  }
  return absl::OkStatus();
}

void PushHookWrapper(lua_State* L, int fn, int args, const DeclaredArgs& shared) {
  lua_pushvalue(L, fn);
  if (args != 0) {
    lua_pushvalue(L, args);
  } else {
    lua_pushboolean(L, 0);
  }
  if (shared.has_value()) {
    lua_createtable(L, 0, static_cast<int>(shared->size()));
    for (const auto& [k, v] : *shared) {
      lua_pushlstring(L, k.data(), k.size());
      lua_pushboolean(L, 1);
      lua_rawset(L, -3);
    }
  } else {
    lua_pushboolean(L, 0);
  }
  lua_pushcclosure(L, HookWrapper, 3);
  lua_getfield(L, LUA_REGISTRYINDEX, kRegWrapped);
  if (lua_type(L, -1) != LUA_TTABLE) {
    lua_pop(L, 1);
    lua_newtable(L);
    lua_createtable(L, 0, 1);
    lua_pushliteral(L, "k");
    lua_setfield(L, -2, "__mode");
    lua_setmetatable(L, -2);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, kRegWrapped);
  }
  lua_pushvalue(L, -2);
  lua_pushvalue(L, fn);
  lua_rawset(L, -3);
  lua_pop(L, 1);
}

void UnwrapHook(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, kRegWrapped);
  if (lua_type(L, -1) != LUA_TTABLE) {
    lua_pop(L, 1);
    return;
  }
  for (;;) {
    lua_pushvalue(L, -2);
    lua_rawget(L, -2);
    if (lua_type(L, -1) != LUA_TFUNCTION) {
      lua_pop(L, 1);
      break;
    }
    lua_replace(L, -3);
  }
  lua_pop(L, 1);
}

}  // namespace ferry::policy_internal
