#include "optim/state_later.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/absl_compat.h"
#include "base/logging.h"

namespace ferry {

StateLater::StateLater(Setting setting)
    : fraction_(setting.automatic ? kAutoFraction : setting.fraction), automatic_(setting.automatic) {}

absl::StatusOr<StateLater::Setting> StateLater::Parse(std::string_view text, std::string_view what) {
  if (text == "off" || text == "0") return Setting{};
  if (text == "auto") return Setting{.fraction = kAutoFraction, .automatic = true};
  const std::string copy(text);
  char* end = nullptr;
  const double f = std::strtod(copy.c_str(), &end);
  if (copy.empty() || end != copy.c_str() + copy.size() || !(f > 0.0) || !(f <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(ToAbsl(what), " is '", copy,
                                                   "': it must be 'off', 'auto' or a fraction in (0, 1]"));
  }
  return Setting{.fraction = f};
}

StateLater::Setting StateLater::FromEnv(Setting fallback) {
  const char* env = std::getenv("FERRY_STATE_LATER");
  if (env == nullptr || *env == '\0') return fallback;
  absl::StatusOr<Setting> setting = Parse(env, "FERRY_STATE_LATER");
  if (!setting.ok()) {
    FERRY_LOG(WARNING) << setting.status().message() << "; the state is written with the params";
    return {};
  }
  return *setting;
}

absl::StatusOr<StateLater::Setting> StateLater::Resolve(std::string_view option) {
  if (option.empty()) return FromEnv(Setting{});
  return Parse(option, "EngineOptions::state_later");
}

absl::Status StateLater::Ensure(size_t grad_bytes) {
  if (!on() || capacity_ != 0) return absl::OkStatus();
  const size_t wanted = static_cast<size_t>(std::ceil(fraction_ * static_cast<double>(grad_bytes)));
  const size_t bytes = std::max<size_t>(64, wanted / 64 * 64);
  keep_.reset(static_cast<char*>(std::aligned_alloc(64, bytes)));
  if (keep_ == nullptr) {
    fraction_ = 0.0;
    return absl::ResourceExhaustedError(
        absl::StrCat("the state later: could not allocate ", bytes, " bytes for the kept grads"));
  }
  capacity_ = bytes;
  // `auto` starts at a quarter of its buffer (about 6% of the grads' bytes) and moves from there.
  limit_ = automatic_ ? std::max<size_t>(64, bytes / 4 / 64 * 64) : bytes;
  return absl::OkStatus();
}

bool StateLater::Stage(CpuAdamTensor& t, size_t param, size_t group, size_t e0) {
  if (capacity_ == 0 || t.numel <= 0 || t.param == nullptr || t.master_src != nullptr || !t.state.all_f32()) {
    return false;
  }
  const size_t bytes = static_cast<size_t>(t.numel) * DTypeSize(t.grad_dtype);
  const size_t at = next_;
  if (at + bytes > limit_) {
    cycle_limited_ = true;
    return false;
  }
  next_ = std::min(capacity_, (at + bytes + 63) / 64 * 64);  // the next piece's grads start a line
  t.param_only = true;
  t.grad_copy = keep_.get() + at;
  pieces_.push_back(Piece{param, group, e0, t.numel, at, next_ - at, *t.scalars, step_});
  return true;
}

void StateLater::Done(size_t count, bool idle) {
  count = std::min(count, pieces_.size());
  for (size_t i = 0; i < count; ++i) (idle ? cycle_idle_ : cycle_spilled_) += pieces_[i].kept;
  pieces_.erase(pieces_.begin(), pieces_.begin() + static_cast<std::ptrdiff_t>(count));
  if (pieces_.empty()) EndCycle(/*adapt=*/true);
}

size_t StateLater::AutoLimit(size_t limit, size_t capacity, size_t idle, size_t spilled, bool limited) {
  const size_t step = std::max<size_t>(64, capacity / 32 / 64 * 64);
  size_t next = limit;
  if (spilled > 0) {
    next = idle / 64 * 64;
  } else if (limited) {
    next = limit + step;
  }
  return std::min(capacity, std::max(std::min(step, capacity), next));
}

void StateLater::EndCycle(bool adapt) {
  next_ = 0;
  if (adapt && automatic_) limit_ = AutoLimit(limit_, capacity_, cycle_idle_, cycle_spilled_, cycle_limited_);
  cycle_idle_ = cycle_spilled_ = 0;
  cycle_limited_ = false;
}

void StateLater::Drop(const std::vector<uint8_t>& drop) {
  pieces_.erase(std::remove_if(pieces_.begin(), pieces_.end(),
                               [&](const Piece& p) {
                                 return p.step == step_ && p.group < drop.size() && drop[p.group] != 0;
                               }),
                pieces_.end());
  if (pieces_.empty()) EndCycle(/*adapt=*/false);  // an undone step tells nothing of the idle time
}

}  // namespace ferry
