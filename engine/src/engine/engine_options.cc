// EngineOptions and GroupOptions: their ranges, checked where they are given (Engine::Create, AddGroup,
// SetGroupOption), each error naming the field; a group's settings as the text checkpoints record
// and the ranks compare.
#include <charconv>
#include <cmath>
#include <utility>

#include "engine/engine_impl.h"
#include "memory/numa.h"

namespace ferry {
namespace engine_internal {

// The range of each optimizer setting; `where` prefixes the message. Checks only the fields set.
absl::Status ValidateGroupOptions(const GroupOptions& o, std::string_view where) {
  auto bad = [&](const char* field, float v, const char* want) {
    return absl::InvalidArgumentError(absl::StrCat(ToAbsl(where), ": ", field, " is ", v, "; it must be ", want));
  };
  if (o.lr_scale && !(std::isfinite(*o.lr_scale) && *o.lr_scale >= 0.0f)) {
    return bad("lr_scale", *o.lr_scale, ">= 0 and finite");
  }
  if (o.weight_decay && !(std::isfinite(*o.weight_decay) && *o.weight_decay >= 0.0f)) {
    return bad("weight_decay", *o.weight_decay, ">= 0 and finite");
  }
  if (o.beta1 && !(*o.beta1 >= 0.0f && *o.beta1 < 1.0f)) return bad("beta1", *o.beta1, "in [0, 1)");
  if (o.beta2 && !(*o.beta2 >= 0.0f && *o.beta2 < 1.0f)) return bad("beta2", *o.beta2, "in [0, 1)");
  if (o.eps && !(std::isfinite(*o.eps) && *o.eps > 0.0f)) return bad("eps", *o.eps, "> 0 and finite");
  return absl::OkStatus();
}

std::string FormatGroupSettings(const GroupOptions& o, bool bias_correction) {
  auto f = [](std::optional<float> v) {  // the shortest text that reads back as the same float
    char buf[32];
    const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), v.value_or(0.0f));
    return std::string(buf, r.ptr);
  };
  return absl::StrCat("adamw=", o.adamw.value_or(true) ? 1 : 0, " lr_scale=", f(o.lr_scale),
                      " weight_decay=", f(o.weight_decay), " beta1=", f(o.beta1), " beta2=", f(o.beta2),
                      " eps=", f(o.eps), " bias_correction=", bias_correction ? 1 : 0);
}

std::vector<std::array<std::string, 3>> DiffGroupSettings(std::string_view a, std::string_view b) {
  auto fields = [](std::string_view text) {
    std::vector<std::pair<std::string, std::string>> out;
    for (absl::string_view kv : absl::StrSplit(ToAbsl(text), ' ', absl::SkipEmpty())) {
      std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
      out.push_back(std::move(p));
    }
    return out;
  };
  std::vector<std::array<std::string, 3>> out;
  const std::vector<std::pair<std::string, std::string>> fb = fields(b);
  for (const auto& [key, value] : fields(a)) {
    for (const auto& [kb, vb] : fb) {
      if (kb == key && vb != value) out.push_back({key, value, vb});
    }
  }
  return out;
}

absl::Status ValidateEngineOptions(const EngineOptions& o) {
  auto bad = [](std::string_view field, const auto& value, std::string_view want) {
    return absl::InvalidArgumentError(
        absl::StrCat("EngineOptions::", ToAbsl(field), " is ", value, "; it must be ", ToAbsl(want)));
  };
  const OptimizerOptions& opt = o.optimizer;
  if (!(std::isfinite(opt.lr) && opt.lr >= 0.0f)) return bad("optimizer.lr", opt.lr, ">= 0 and finite");
  FERRY_RETURN_IF_ERROR(ValidateGroupOptions(
      GroupOptions{.weight_decay = opt.weight_decay, .beta1 = opt.beta1, .beta2 = opt.beta2, .eps = opt.eps},
      "EngineOptions::optimizer"));
  if (o.device_ordinal < 0) return bad("device_ordinal", o.device_ordinal, ">= 0");
  if (!(o.spare_state_fraction >= 0.0 && o.spare_state_fraction <= 1.0)) {
    return bad("spare_state_fraction", o.spare_state_fraction, "in [0, 1] (a fraction of the offloaded state's bytes)");
  }
  if (!o.state_later.empty()) {  // (the environment's value, read per optimizer, only warns)
    FERRY_RETURN_IF_ERROR(StateLater::Parse(o.state_later, "EngineOptions::state_later").status());
  }
  if ((o.local_rank != -1 || o.local_world_size != -1) &&
      !(o.local_world_size >= 1 && o.local_rank >= 0 && o.local_rank < o.local_world_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EngineOptions::local_rank is ", o.local_rank, " and local_world_size is ", o.local_world_size,
        "; set both (0 <= local_rank < local_world_size) or leave both -1 (the launcher's environment)"));
  }
  for (const auto& [field, value] : {std::pair<std::string_view, int>{"pin_cpu_threads", o.pin_cpu_threads},
                                     {"pin_trainer_threads", o.pin_trainer_threads}}) {
    if (value < -1 || value > 1) return bad(field, value, "-1 (the engine's rule), 0 (never) or 1 (always)");
  }
  if (!o.numa.empty()) {
    absl::StatusOr<NumaPolicy> numa = ParseNumaPolicy(o.numa);
    if (!numa.ok()) return absl::InvalidArgumentError(absl::StrCat("EngineOptions::numa: ", numa.status().message()));
  }
  if (o.collective_timeout <= absl::ZeroDuration()) {
    return bad("collective_timeout", absl::FormatDuration(o.collective_timeout), "> 0");
  }
  if (o.checkpoint_timeout <= absl::ZeroDuration()) {
    return bad("checkpoint_timeout", absl::FormatDuration(o.checkpoint_timeout), "> 0");
  }
  return absl::OkStatus();
}

}  // namespace engine_internal

std::vector<std::string_view> GroupOptionNames() {
  return {"lr_scale", "weight_decay", "beta1", "beta2", "eps", "adamw"};
}

absl::Status SetGroupOption(GroupOptions& options, std::string_view name, double value) {
  GroupOptions o = options;
  const float f = static_cast<float>(value);
  if (name == "lr_scale") {
    o.lr_scale = f;
  } else if (name == "weight_decay") {
    o.weight_decay = f;
  } else if (name == "beta1") {
    o.beta1 = f;
  } else if (name == "beta2") {
    o.beta2 = f;
  } else if (name == "eps") {
    o.eps = f;
  } else if (name == "adamw") {
    if (value != 0.0 && value != 1.0) {
      return absl::InvalidArgumentError(absl::StrCat("group option adamw is ", value, "; it must be 0 or 1"));
    }
    o.adamw = value != 0.0;
  } else {
    std::string known;
    for (std::string_view n : GroupOptionNames()) absl::StrAppend(&known, known.empty() ? "" : ", ", ToAbsl(n));
    return absl::InvalidArgumentError(absl::StrCat("unknown group option '", ToAbsl(name), "' (known: ", known, ")"));
  }
  FERRY_RETURN_IF_ERROR(engine_internal::ValidateGroupOptions(o, absl::StrCat("group option ", ToAbsl(name))));
  options = o;
  return absl::OkStatus();
}

}  // namespace ferry
