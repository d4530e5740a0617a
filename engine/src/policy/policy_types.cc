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

}  // namespace ferry
