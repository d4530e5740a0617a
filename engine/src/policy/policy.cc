#include "policy/policy.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/errors.h"
#include "ferry/status.h"
#include "policy/lua_runtime.h"
#include "policy/policy_loader.h"
#include "policy/lua_values.h"

#if __has_include(<luajit-2.1/lua.hpp>)
#include <luajit-2.1/lua.hpp>
#else
#include <lua.hpp>
#endif

namespace ferry {

namespace {

constexpr std::string_view kNumaModes[] = {"interleave", "bind", "preferred", "local"};

using policy_internal::AV;
using policy_internal::Checker;
using policy_internal::Describe;
using policy_internal::IsString;
using policy_internal::Quote;
using policy_internal::RawGetField;
using policy_internal::SetBool;
using policy_internal::SetNumber;
using policy_internal::SetString;
using policy_internal::SetStringArray;
using policy_internal::StringAt;

// ---- host -> Lua (raw operations on fresh tables; no metamethods can run)
// -------------------------

void PushGroups(lua_State* L, absl::Span<const GroupInfo> groups) {
  lua_createtable(L, static_cast<int>(groups.size()), 0);
  for (size_t i = 0; i < groups.size(); ++i) {
    const GroupInfo& g = groups[i];
    lua_createtable(L, 0, 7);
    SetString(L, "name", g.name);
    SetNumber(L, "numel", g.numel);
    SetNumber(L, "bytes", g.bytes);
    // Several ranks: the global tensors' size (callers that do not shard give 0: the local size).
    SetNumber(L, "global_numel", g.global_numel > 0 ? g.global_numel : g.numel);
    SetNumber(L, "global_bytes", g.global_bytes > 0 ? g.global_bytes : g.bytes);
    SetString(L, "dtype", DTypeName(g.dtype));
    SetStringArray(L, "tags", g.tags);
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
}

void PushContext(lua_State* L, const PolicyContext& ctx) {
  lua_createtable(L, 0, 6);
  SetNumber(L, "rank", ctx.rank);
  SetNumber(L, "world_size", ctx.world_size);
  SetNumber(L, "gpu_free_bytes", ctx.gpu_free_bytes);
  SetNumber(L, "pinned_budget_bytes", ctx.pinned_budget_bytes);
  SetNumber(L, "numa_nodes", ctx.numa_nodes);
  lua_createtable(L, 0, static_cast<int>(ctx.args.size()));
  for (const auto& [key, value] : ctx.args) {
    lua_pushlstring(L, key.data(), key.size());
    lua_pushlstring(L, value.data(), value.size());
    lua_rawset(L, -3);
  }
  lua_setfield(L, -2, "args");
}

std::vector<std::string> GroupNames(absl::Span<const GroupInfo> groups) {
  std::vector<std::string> names;
  names.reserve(groups.size());
  for (const GroupInfo& g : groups) names.push_back(g.name);
  return names;
}

// ---- Lua -> host: validation
// ----------------------------------------------------------------------

// Every key of the result table at `idx` must be a string among `fields`.
absl::Status CheckFields(lua_State* L, int idx, const Checker& c,
                         std::initializer_list<std::string_view> fields) {
  lua_pushnil(L);
  while (lua_next(L, idx) != 0) {
    const bool known = lua_type(L, -2) == LUA_TSTRING &&
                       std::find(fields.begin(), fields.end(), StringAt(L, -2)) != fields.end();
    if (!known) {
      std::vector<std::string> quoted;
      for (std::string_view f : fields) quoted.push_back(Quote(f));
      return c.Error(absl::StrCat("unknown field ", Describe(L, -2), "; expected only ",
                                  absl::StrJoin(quoted, ", ")));
    }
    lua_pop(L, 1);
  }
  return absl::OkStatus();
}

// Reads the array of strings at absolute index `idx` (a table): keys exactly 1..n, values strings.
absl::Status ReadStringArray(lua_State* L, int idx, const Checker& c, std::string_view field,
                             std::vector<std::string>* out) {
  int64_t count = 0;
  lua_Number max_key = 0;
  lua_pushnil(L);
  while (lua_next(L, idx) != 0) {
    const bool integer_key = lua_type(L, -2) == LUA_TNUMBER && lua_tonumber(L, -2) >= 1 &&
                             lua_tonumber(L, -2) == std::floor(lua_tonumber(L, -2));
    if (!integer_key) {
      return c.Error(absl::StrCat("field \"", AV(field), "\" has key ", Describe(L, -2),
                                  "; expected an array (keys 1..n)"));
    }
    max_key = std::max(max_key, lua_tonumber(L, -2));
    ++count;
    lua_pop(L, 1);
  }
  if (max_key != static_cast<lua_Number>(count)) {
    return c.Error(absl::StrCat("field \"", AV(field), "\" has holes (", count,
                                " entries, largest key ", absl::StrFormat("%.14g", max_key),
                                "); expected an array (keys 1..n)"));
  }
  out->clear();
  for (int64_t i = 1; i <= count; ++i) {
    lua_rawgeti(L, idx, static_cast<int>(i));
    if (lua_type(L, -1) != LUA_TSTRING) {
      return c.Error(absl::StrCat("field \"", AV(field), "\" entry ", i, " is ", Describe(L, -1),
                                  "; expected a string"));
    }
    out->emplace_back(StringAt(L, -1));
    lua_pop(L, 1);
  }
  return absl::OkStatus();
}

// Host inputs: names non-empty and unique. Returns name -> position.
absl::StatusOr<absl::flat_hash_map<std::string, size_t>> IndexNames(
    const Checker& c, std::string_view what, const std::vector<std::string>& names) {
  absl::flat_hash_map<std::string, size_t> index;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i].empty()) {
      return c.Error(absl::StrCat("input: ", AV(what), " ", i, " has an empty name"));
    }
    if (!index.emplace(names[i], i).second) {
      return c.Error(absl::StrCat("input: ", AV(what), " \"", names[i], "\" appears twice"));
    }
  }
  return index;
}

absl::Status CheckSubset(const Checker& c, std::string_view what,
                         const std::vector<std::string>& names,
                         const absl::flat_hash_map<std::string, size_t>& index) {
  for (const std::string& n : names) {
    if (!index.contains(n)) {
      return c.Error(absl::StrCat("input: ", AV(what), " names \"", n, "\", which is not a group"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LuaRuntime>> MakeRuntime(std::string name, std::string_view source,
                                                        const std::string& lua_chunk_name,
                                                        const std::string& file,
                                                        const PolicyOptions& options) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<LuaRuntime> lua,
                         LuaRuntime::Create(std::move(name), options));
  FERRY_RETURN_IF_ERROR(lua->Load(source, lua_chunk_name, file));
  return lua;
}

}  // namespace

Policy::Policy(std::string path, std::unique_ptr<LuaRuntime> lua)
    : path_(std::move(path)), lua_(std::move(lua)) {}

Policy::~Policy() = default;

absl::StatusOr<std::unique_ptr<Policy>> Policy::LoadFile(const std::string& path,
                                                         const PolicyOptions& options) {
  FERRY_ASSIGN_OR_RETURN(std::string source, policy_internal::ReadPolicyFile(path));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<LuaRuntime> lua,
                         MakeRuntime(path, source, absl::StrCat("@", path), path, options));
  return std::unique_ptr<Policy>(new Policy(path, std::move(lua)));
}

absl::StatusOr<std::unique_ptr<Policy>> Policy::LoadString(std::string_view source,
                                                           std::string_view chunk_name,
                                                           const PolicyOptions& options) {
  std::string name(chunk_name);
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<LuaRuntime> lua,
                         MakeRuntime(name, source, absl::StrCat("=", name), "", options));
  return std::unique_ptr<Policy>(new Policy(std::move(name), std::move(lua)));
}

bool Policy::has_hook(std::string_view name) const { return lua_->HasHook(name); }

std::string Policy::hook_location(std::string_view name) const {
  return has_hook(name) ? lua_->HookLocation(name) : "";
}

const std::vector<std::string>& Policy::files() const { return lua_->files(); }

const std::optional<std::map<std::string, std::string>>& Policy::declared_args() const {
  return lua_->declared_args();
}

absl::Status Policy::CheckArgs(const std::map<std::string, std::string>& args) const {
  return policy_internal::CheckArgsAgainst(path_, lua_->declared_args(), args);
}

absl::StatusOr<Placement> Policy::Place(absl::Span<const GroupInfo> groups,
                                        const PolicyContext& ctx) {
  Checker c(path_, "place");
  FERRY_RETURN_IF_ERROR(CheckArgs(ctx.args));
  const std::vector<std::string> names = GroupNames(groups);
  FERRY_ASSIGN_OR_RETURN(auto index, IndexNames(c, "group", names));
  Placement placement;
  if (!has_hook("place")) {
    for (const std::string& n : names) placement.groups.emplace(n, PlaceKind::kGpu);
    return placement;
  }
  std::vector<std::optional<PlaceKind>> kinds(groups.size());
  std::vector<std::optional<StateFormat>> formats(groups.size());
  std::optional<std::string> numa;
  std::optional<double> spare_state;
  auto push_args = [&](lua_State* L) {
    PushGroups(L, groups);
    PushContext(L, ctx);
    return 2;
  };
  auto read = [&](lua_State* L, int r) -> absl::Status {
    if (lua_type(L, r) != LUA_TTABLE) {
      return c.Error(absl::StrCat("returned ", Describe(L, r),
                                  "; expected a table mapping each group name to \"cpu\" or "
                                  "\"gpu\""));
    }
    lua_pushnil(L);
    while (lua_next(L, r) != 0) {
      if (lua_type(L, -2) != LUA_TSTRING) {
        return c.Error(absl::StrCat("has key ", Describe(L, -2),
                                    "; expected group names (strings) and optionally \"numa\" and "
                                    "\"spare_state\""));
      }
      const std::string_view key = StringAt(L, -2);
      auto it = index.find(AV(key));
      const bool placement_value =
          IsString(L, -1, "cpu") || IsString(L, -1, "gpu") || lua_type(L, -1) == LUA_TTABLE;
      if (key == "numa" && (it == index.end() || !placement_value)) {
        // The NUMA mode (a group named "numa" is placed with "cpu"/"gpu" under the same key).
        const bool valid = lua_type(L, -1) == LUA_TSTRING &&
                           std::find(std::begin(kNumaModes), std::end(kNumaModes),
                                     StringAt(L, -1)) != std::end(kNumaModes);
        if (!valid) {
          return c.Error(absl::StrCat("field \"numa\" is ", Describe(L, -1),
                                      "; expected \"interleave\", \"bind\", \"preferred\" or "
                                      "\"local\""));
        }
        numa = std::string(StringAt(L, -1));
      } else if (key == "spare_state" && (it == index.end() || !placement_value)) {
        // The bound on the spare state (a group named "spare_state" is placed as "numa" is above).
        const double f = lua_type(L, -1) == LUA_TNUMBER ? lua_tonumber(L, -1) : std::nan("");
        if (!(f >= 0.0 && f <= 1.0)) {  // NaN, out of range, or not a number
          return c.Error(absl::StrCat("field \"spare_state\" is ", Describe(L, -1),
                                      "; expected a number in [0, 1] (a fraction of the offloaded "
                                      "state's pinned bytes)"));
        }
        spare_state = f;
      } else if (it == index.end()) {
        return c.Error(absl::StrCat("names unknown group ", Quote(key), "; expected only the ",
                                    groups.size(), " groups passed to place()"));
      } else if (!placement_value) {
        return c.Error(absl::StrCat("group ", Quote(key), " has placement ", Describe(L, -1),
                                    "; expected \"cpu\" or \"gpu\""));
      } else if (lua_type(L, -1) == LUA_TTABLE) {
        PlaceKind kind = PlaceKind::kGpu;
        StateFormat format;
        FERRY_RETURN_IF_ERROR(
            policy_internal::ReadPlaceTable(L, lua_gettop(L), c, key, groups[it->second].dtype, &kind, &format));
        kinds[it->second] = kind;
        formats[it->second] = format;
      } else {
        kinds[it->second] = IsString(L, -1, "cpu") ? PlaceKind::kCpu : PlaceKind::kGpu;
      }
      lua_pop(L, 1);
    }
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (!kinds[i].has_value()) {
        const size_t missing = std::count(kinds.begin(), kinds.end(), std::nullopt);
        return c.Error(absl::StrCat(
            "group ", Quote(names[i]), " has no placement",
            missing > 1 ? absl::StrCat(" (nor do ", missing - 1, " other groups)") : "",
            "; expected \"cpu\" or \"gpu\" for every group"));
      }
    }
    return absl::OkStatus();
  };
  c.set_location(lua_->HookLocation("place"));
  FERRY_RETURN_IF_ERROR(lua_->CallHook("place", push_args, read));
  for (size_t i = 0; i < names.size(); ++i) {
    placement.groups.emplace(names[i], *kinds[i]);
    if (formats[i].has_value()) placement.state.emplace(names[i], *formats[i]);
  }
  placement.numa = std::move(numa);
  placement.spare_state = spare_state;
  return placement;
}

absl::StatusOr<SyncPlan> Policy::AfterLoad(const LoadEvent& event,
                                           absl::Span<const GroupInfo> groups,
                                           const PolicyContext& ctx) {
  Checker c(path_, "after_load");
  FERRY_RETURN_IF_ERROR(CheckArgs(ctx.args));
  const std::vector<std::string> names = GroupNames(groups);
  FERRY_ASSIGN_OR_RETURN(auto index, IndexNames(c, "group", names));
  FERRY_RETURN_IF_ERROR(IndexNames(c, "event group", event.groups).status());
  FERRY_RETURN_IF_ERROR(CheckSubset(c, "event.groups", event.groups, index));

  // Defaults, also for fields the hook leaves out.
  std::vector<bool> sync(names.size(), !event.masters_loaded);
  bool reset_optimizer = !event.optimizer_loaded;
  if (has_hook("after_load")) {
    auto push_args = [&](lua_State* L) {
      lua_createtable(L, 0, 5);
      SetString(L, "kind", LoadKindName(event.kind));
      SetBool(L, "optimizer_loaded", event.optimizer_loaded);
      SetBool(L, "masters_loaded", event.masters_loaded);
      SetStringArray(L, "groups", event.groups);
      SetStringArray(L, "all_groups", names);
      PushContext(L, ctx);
      return 2;
    };
    auto read = [&](lua_State* L, int r) -> absl::Status {
      if (lua_type(L, r) != LUA_TTABLE) {
        return c.Error(absl::StrCat("returned ", Describe(L, r),
                                    "; expected a table {sync = \"all\" | \"none\" | {group "
                                    "names}, reset_optimizer = boolean}"));
      }
      FERRY_RETURN_IF_ERROR(CheckFields(L, r, c, {"sync", "reset_optimizer"}));
      RawGetField(L, r, "sync");
      const int s = lua_gettop(L);
      if (IsString(L, s, "all") || IsString(L, s, "none")) {
        std::fill(sync.begin(), sync.end(), IsString(L, s, "all"));
      } else if (lua_type(L, s) == LUA_TTABLE) {
        std::vector<std::string> listed;
        FERRY_RETURN_IF_ERROR(ReadStringArray(L, s, c, "sync", &listed));
        std::fill(sync.begin(), sync.end(), false);
        for (size_t i = 0; i < listed.size(); ++i) {
          auto it = index.find(listed[i]);
          if (it == index.end()) {
            return c.Error(absl::StrCat("field \"sync\" entry ", i + 1, " is ", Quote(listed[i]),
                                        ", which is not a group; expected names from "
                                        "event.all_groups"));
          }
          if (sync[it->second]) {
            return c.Error(absl::StrCat("field \"sync\" names group ", Quote(listed[i]),
                                        " twice; expected each group at most once"));
          }
          sync[it->second] = true;
        }
      } else if (lua_type(L, s) != LUA_TNIL) {
        return c.Error(absl::StrCat("field \"sync\" is ", Describe(L, s),
                                    "; expected \"all\", \"none\" or an array of group names"));
      }
      lua_pop(L, 1);
      RawGetField(L, r, "reset_optimizer");
      if (lua_type(L, -1) == LUA_TBOOLEAN) {
        reset_optimizer = lua_toboolean(L, -1) != 0;
      } else if (lua_type(L, -1) != LUA_TNIL) {
        return c.Error(
            absl::StrCat("field \"reset_optimizer\" is ", Describe(L, -1), "; expected a boolean"));
      }
      lua_pop(L, 1);
      return absl::OkStatus();
    };
    c.set_location(lua_->HookLocation("after_load"));
    FERRY_RETURN_IF_ERROR(lua_->CallHook("after_load", push_args, read));
  }
  SyncPlan plan;
  for (size_t i = 0; i < names.size(); ++i) {
    if (sync[i]) plan.sync_groups.push_back(names[i]);
  }
  plan.reset_optimizer = reset_optimizer;
  return plan;
}

absl::StatusOr<CheckpointPlan> Policy::Checkpoint(const CheckpointInfo& info,
                                                  const PolicyContext& ctx) {
  Checker c(path_, "checkpoint");
  FERRY_RETURN_IF_ERROR(CheckArgs(ctx.args));
  FERRY_ASSIGN_OR_RETURN(auto index, IndexNames(c, "group", info.groups));
  FERRY_RETURN_IF_ERROR(IndexNames(c, "offloaded group", info.offloaded).status());
  FERRY_RETURN_IF_ERROR(CheckSubset(c, "info.offloaded", info.offloaded, index));

  CheckpointPlan plan;
  if (!has_hook("checkpoint")) return plan;
  auto skip_group = std::make_unique<bool[]>(info.groups.size());  // all false
  auto push_args = [&](lua_State* L) {
    lua_createtable(L, 0, 5);
    SetNumber(L, "step", info.step);
    SetString(L, "reason", info.reason);
    lua_createtable(L, 0, 3);
    SetNumber(L, "model", info.model_bytes);
    SetNumber(L, "master", info.master_bytes);
    SetNumber(L, "optimizer", info.optimizer_bytes);
    lua_setfield(L, -2, "bytes");
    SetStringArray(L, "offloaded", info.offloaded);
    SetStringArray(L, "groups", info.groups);
    PushContext(L, ctx);
    return 2;
  };
  auto read = [&](lua_State* L, int r) -> absl::Status {
    if (lua_type(L, r) != LUA_TTABLE) {
      return c.Error(absl::StrCat("returned ", Describe(L, r),
                                  "; expected a table {skip = {...}, async = boolean, "
                                  "keep_last = integer >= 0}"));
    }
    FERRY_RETURN_IF_ERROR(CheckFields(L, r, c, {"skip", "async", "keep_last"}));
    RawGetField(L, r, "skip");
    if (lua_type(L, -1) == LUA_TTABLE) {
      std::vector<std::string> listed;
      FERRY_RETURN_IF_ERROR(ReadStringArray(L, lua_gettop(L), c, "skip", &listed));
      for (size_t i = 0; i < listed.size(); ++i) {
        bool* flag = nullptr;  // what this entry skips
        if (listed[i] == "optimizer") {
          flag = &plan.skip_optimizer;
        } else if (listed[i] == "master") {
          flag = &plan.skip_master;
        } else if (auto it = index.find(listed[i]); it != index.end()) {
          flag = &skip_group[it->second];
        } else {
          return c.Error(absl::StrCat("field \"skip\" entry ", i + 1, " is ", Quote(listed[i]),
                                      "; expected \"optimizer\", \"master\" or a group name "
                                      "from info.groups"));
        }
        if (*flag) {
          return c.Error(absl::StrCat("field \"skip\" names ", Quote(listed[i]),
                                      " twice; expected each entry at most once"));
        }
        *flag = true;
      }
    } else if (lua_type(L, -1) != LUA_TNIL) {
      return c.Error(absl::StrCat("field \"skip\" is ", Describe(L, -1),
                                  "; expected an array of \"optimizer\", \"master\" or group "
                                  "names"));
    }
    lua_pop(L, 1);
    RawGetField(L, r, "async");
    if (lua_type(L, -1) == LUA_TBOOLEAN) {
      plan.async = lua_toboolean(L, -1) != 0;
    } else if (lua_type(L, -1) != LUA_TNIL) {
      return c.Error(absl::StrCat("field \"async\" is ", Describe(L, -1), "; expected a boolean"));
    }
    lua_pop(L, 1);
    RawGetField(L, r, "keep_last");
    if (lua_type(L, -1) == LUA_TNUMBER) {
      const lua_Number k = lua_tonumber(L, -1);
      if (!(k >= 0 && k <= std::numeric_limits<int>::max() && k == std::floor(k))) {
        return c.Error(absl::StrCat("field \"keep_last\" is ", Describe(L, -1),
                                    "; expected an integer >= 0 (0 keeps all)"));
      }
      plan.keep_last = static_cast<int>(k);
    } else if (lua_type(L, -1) != LUA_TNIL) {
      return c.Error(absl::StrCat("field \"keep_last\" is ", Describe(L, -1),
                                  "; expected an integer >= 0 (0 keeps all)"));
    }
    lua_pop(L, 1);
    return absl::OkStatus();
  };
  // A failed call must not leave a half-filled plan behind.
  c.set_location(lua_->HookLocation("checkpoint"));
  absl::Status status = lua_->CallHook("checkpoint", push_args, read);
  if (!status.ok()) return status;
  for (size_t i = 0; i < info.groups.size(); ++i) {
    if (skip_group[i]) plan.skip_groups.push_back(info.groups[i]);
  }
  return plan;
}

absl::StatusOr<MoveRequest> Policy::OnStep(const StepStats& stats, const PolicyContext& ctx) {
  Checker c(path_, "on_step");
  FERRY_RETURN_IF_ERROR(CheckArgs(ctx.args));
  std::vector<std::string> names;
  names.reserve(stats.groups.size());
  for (const GroupStepInfo& g : stats.groups) names.push_back(g.name);
  FERRY_ASSIGN_OR_RETURN(auto index, IndexNames(c, "group", names));
  for (const GroupStepInfo& g : stats.groups) {
    if (g.placement != PlaceKind::kCpu && g.placement != PlaceKind::kGpu) {
      return c.Error(absl::StrCat("input: group \"", g.name, "\" has an invalid placement"));
    }
  }
  MoveRequest request;
  if (!has_hook("on_step")) return request;
  std::vector<std::optional<PlaceKind>> target(names.size());
  auto push_args = [&](lua_State* L) {
    lua_createtable(L, 0, 5);
    SetNumber(L, "step", stats.step);
    lua_pushnumber(L, stats.step_seconds);
    lua_setfield(L, -2, "step_seconds");
    SetNumber(L, "gpu_state_bytes", stats.gpu_state_bytes);
    SetNumber(L, "pinned_bytes", stats.pinned_bytes);
    lua_createtable(L, static_cast<int>(stats.groups.size()), 0);
    for (size_t i = 0; i < stats.groups.size(); ++i) {
      const GroupStepInfo& g = stats.groups[i];
      lua_createtable(L, 0, 4);
      SetString(L, "name", g.name);
      SetString(L, "placement", PlaceKindName(g.placement));
      SetNumber(L, "numel", g.numel);
      SetNumber(L, "bytes", g.bytes);
      lua_rawseti(L, -2, static_cast<int>(i + 1));
    }
    lua_setfield(L, -2, "groups");
    PushContext(L, ctx);
    return 2;
  };
  auto read = [&](lua_State* L, int r) -> absl::Status {
    if (lua_type(L, r) == LUA_TNIL) return absl::OkStatus();
    if (lua_type(L, r) != LUA_TTABLE) {
      return c.Error(absl::StrCat("returned ", Describe(L, r),
                                  "; expected nil (nothing to do) or a table {move = {[group name] "
                                  "= \"cpu\" | \"gpu\"}}"));
    }
    FERRY_RETURN_IF_ERROR(CheckFields(L, r, c, {"move"}));
    RawGetField(L, r, "move");
    const int m = lua_gettop(L);
    if (lua_type(L, m) == LUA_TNIL) return absl::OkStatus();
    if (lua_type(L, m) != LUA_TTABLE) {
      return c.Error(absl::StrCat("field \"move\" is ", Describe(L, m),
                                  "; expected a table mapping group names to \"cpu\" or \"gpu\""));
    }
    lua_pushnil(L);
    while (lua_next(L, m) != 0) {
      if (lua_type(L, -2) != LUA_TSTRING) {
        return c.Error(absl::StrCat("field \"move\" has key ", Describe(L, -2),
                                    "; expected group names (strings) from stats.groups"));
      }
      const std::string_view key = StringAt(L, -2);
      auto it = index.find(AV(key));
      if (it == index.end()) {
        return c.Error(absl::StrCat("field \"move\" names unknown group ", Quote(key),
                                    "; expected only the ", names.size(),
                                    " groups of stats.groups"));
      }
      if (!IsString(L, -1, "cpu") && !IsString(L, -1, "gpu")) {
        return c.Error(absl::StrCat("field \"move\" group ", Quote(key), " is ", Describe(L, -1),
                                    "; expected \"cpu\" or \"gpu\""));
      }
      target[it->second] = IsString(L, -1, "cpu") ? PlaceKind::kCpu : PlaceKind::kGpu;
      lua_pop(L, 1);
    }
    lua_pop(L, 1);
    return absl::OkStatus();
  };
  c.set_location(lua_->HookLocation("on_step"));
  FERRY_RETURN_IF_ERROR(lua_->CallHook("on_step", push_args, read));
  for (size_t i = 0; i < names.size(); ++i) {
    if (target[i].has_value() && *target[i] != stats.groups[i].placement) {
      request.moves.push_back(GroupMove{names[i], *target[i]});
    }
  }
  return request;
}

}  // namespace ferry
