// Plain C++ shapes of what policy hooks receive and return. No Lua here: the policy layer turns
// hook results into these structs only after validating them completely, so the engine never sees a
// half-checked decision. All types are plain values (copyable, no shared state).
#ifndef FERRY_POLICY_POLICY_TYPES_H_
#define FERRY_POLICY_POLICY_TYPES_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/adam_state.h"
#include "ferry/dtype.h"

namespace ferry {

// Where a group's fp32 master copy and Adam state live.
enum class PlaceKind : uint8_t { kGpu, kCpu };

// "gpu" or "cpu": the spelling policies use.
std::string_view PlaceKindName(PlaceKind kind);

// One parameter group as a policy sees it (Lua: {name=, numel=, bytes=, dtype=, tags={...}}).
struct GroupInfo {
  std::string name;  // unique and non-empty within one hook call
  int64_t numel = 0;  // elements this rank holds (its shards)
  int64_t bytes = 0;  // bytes of the low-precision parameters this rank holds
  int64_t global_numel = 0;  // elements of the global tensors (= numel for one rank; 0: not given)
  int64_t global_bytes = 0;
  DType dtype = DType::kBF16;
  std::vector<std::string> tags;
};

// What every hook gets as `ctx`. Integers reach Lua as numbers (exact up to 2^53).
struct PolicyContext {
  int rank = 0;
  int world_size = 1;
  int64_t gpu_free_bytes = 0;
  int64_t pinned_budget_bytes = 0;
  int numa_nodes = 1;
  std::map<std::string, std::string> args;  // policy arguments (EngineOptions::policy_args)
};

// Result of place(): every group named exactly once.
//
// A group's value is its device ("cpu" | "gpu"), or a table that also gives the precision of its
// optimizer state: { device = "cpu"|"gpu", moments = "fp32"|"bf16", master = "fp32"|"bf16",
// rounding = "nearest"|"stochastic" } (every field but device optional; fp32 and nearest by default;
// a bf16 master only for a group whose params are bf16).
struct Placement {
  std::map<std::string, PlaceKind> groups;
  // The state format of the groups whose place() value was a table (others: fp32 state).
  std::map<std::string, StateFormat> state;
  std::optional<std::string> numa;  // "interleave" | "bind" | "preferred" | "local" when set
  // A bound on the early steps' spare state, a fraction in [0, 1] of the offloaded state's pinned
  // bytes (the key "spare_state"); the engine takes the smaller of it and
  // EngineOptions::spare_state_fraction. Unset: no bound of the policy's.
  std::optional<double> spare_state;
};

// The spellings of state dtypes and roundings in policies and reports: "fp32", "bf16"; "nearest",
// "stochastic".
std::string_view StateDTypeName(DType t);
std::string_view StateRoundingName(StateRounding r);
// "fp32/fp32", "bf16 moments", "bf16 master+moments, stochastic", ...: a StateFormat in words.
std::string DescribeStateFormat(const StateFormat& f);

enum class LoadKind : uint8_t { kCheckpoint, kModelOnly, kExternal };

// "checkpoint", "model_only" or "external".
std::string_view LoadKindName(LoadKind kind);

// What happened in a load (Lua: {kind=, optimizer_loaded=, masters_loaded=, groups={names},
// all_groups={names}}).
struct LoadEvent {
  LoadKind kind = LoadKind::kCheckpoint;
  bool optimizer_loaded = false;
  bool masters_loaded = false;
  std::vector<std::string> groups;  // the groups the load restored (subset of all groups)
};

// Result of after_load().
struct SyncPlan {
  // Groups whose fp32 masters are re-synced from the model params, in the engine's group order.
  std::vector<std::string> sync_groups;
  bool reset_optimizer = false;
};

// What a checkpoint is about to write (Lua: {step=, reason=, bytes={model=, master=, optimizer=},
// offloaded={names}, groups={names}}).
struct CheckpointInfo {
  int64_t step = 0;
  std::string reason;
  int64_t model_bytes = 0, master_bytes = 0, optimizer_bytes = 0;
  std::vector<std::string> offloaded;  // groups placed on the CPU
  std::vector<std::string> groups;     // every group
};

// Result of checkpoint().
struct CheckpointPlan {
  bool skip_optimizer = false;
  bool skip_master = false;
  std::vector<std::string> skip_groups;  // in CheckpointInfo::groups order
  bool async = false;
  int keep_last = 0;  // 0 = keep all
};

// One group as on_step() sees it (Lua: {name=, placement="cpu"|"gpu", numel=, bytes=}).
struct GroupStepInfo {
  std::string name;  // unique and non-empty within one hook call
  PlaceKind placement = PlaceKind::kGpu;  // where its fp32 master and Adam state live now
  int64_t numel = 0;  // elements this rank holds (its shards)
  int64_t bytes = 0;  // bytes of the low-precision parameters this rank holds
  int64_t global_numel = 0;  // elements of the global tensors (= numel for one rank; 0: not given)
  int64_t global_bytes = 0;
};

// What on_step() gets after each optimizer step (Lua: {step=, step_seconds=, gpu_state_bytes=,
// pinned_bytes=, groups={...}}).
struct StepStats {
  int64_t step = 0;           // optimizer steps taken, this one included
  double step_seconds = 0.0;  // wall time of the Engine::Step call that just ran
  int64_t gpu_state_bytes = 0;  // device memory held for GPU groups' fp32 state
  int64_t pinned_bytes = 0;     // pinned host memory reserved
  std::vector<GroupStepInfo> groups;  // every group, in the engine's order
};

// One change of placement asked for by on_step().
struct GroupMove {
  std::string group;
  PlaceKind to = PlaceKind::kGpu;
  friend bool operator==(const GroupMove&, const GroupMove&) = default;
};

// Result of on_step(): the groups to move, in StepStats::groups order, each at most once. Only real
// changes are listed (a group the hook names with its current placement is left out), so an empty
// request means "nothing to do".
struct MoveRequest {
  std::vector<GroupMove> moves;
  bool empty() const { return moves.empty(); }
};

// The placement of every group of `stats` once `request` is applied (numa and spare_state unset).
// `request` must come from OnStep for these stats (its groups are among stats.groups).
Placement PlacementAfter(const StepStats& stats, const MoveRequest& request);

}  // namespace ferry

#endif  // FERRY_POLICY_POLICY_TYPES_H_
