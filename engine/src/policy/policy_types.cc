#include "policy/policy_types.h"

namespace ferry {

std::string_view PlaceKindName(PlaceKind kind) {
  switch (kind) {
    case PlaceKind::kGpu: return "gpu";
    case PlaceKind::kCpu: return "cpu";
  }
  return "invalid";
}

std::string_view LoadKindName(LoadKind kind) {
  switch (kind) {
    case LoadKind::kCheckpoint: return "checkpoint";
    case LoadKind::kModelOnly: return "model_only";
    case LoadKind::kExternal: return "external";
  }
  return "invalid";
}

Placement PlacementAfter(const StepStats& stats, const MoveRequest& request) {
  Placement placement;
  for (const GroupStepInfo& g : stats.groups) placement.groups[g.name] = g.placement;
  for (const GroupMove& m : request.moves) placement.groups[m.group] = m.to;
  return placement;
}

std::string_view StateDTypeName(DType t) { return t == DType::kBF16 ? "bf16" : "fp32"; }

std::string_view StateRoundingName(StateRounding r) {
  return r == StateRounding::kStochastic ? "stochastic" : "nearest";
}

std::string DescribeStateFormat(const StateFormat& f) {
  if (f.all_f32()) return "fp32";
  std::string out = f.master == DType::kBF16 && f.moments == DType::kBF16 ? "bf16 master+moments"
                    : f.master == DType::kBF16                              ? "bf16 master"
                                                                            : "bf16 moments";
  out += f.rounding == StateRounding::kStochastic ? ", stochastic" : ", nearest";
  return out;
}

}  // namespace ferry
