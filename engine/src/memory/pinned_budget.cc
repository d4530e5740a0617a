#include "memory/pinned_budget.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/absl_compat.h"
#include "base/logging.h"
#include "memory/format.h"

namespace ferry {
namespace {

using memory_internal::FormatBytes;

// The cgroup v2 memory limit of this process's cgroup namespace root, or kUnlimited.
size_t CgroupMemoryLimit() {
  std::ifstream in("/sys/fs/cgroup/memory.max");
  std::string text;
  if (!in || !std::getline(in, text)) return PinnedBudget::kUnlimited;
  uint64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value)) return PinnedBudget::kUnlimited;
  return static_cast<size_t>(value);
}

size_t PhysicalMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return PinnedBudget::kUnlimited;
  return static_cast<size_t>(pages) * static_cast<size_t>(page);
}

std::string FormatLimit(size_t limit) {
  return limit == PinnedBudget::kUnlimited ? std::string("unlimited") : FormatBytes(limit);
}

}  // namespace

PinnedBudget::PinnedBudget(size_t limit_bytes, std::string name)
    : name_(std::move(name)), limit_(limit_bytes) {}

PinnedBudget::~PinnedBudget() {
  std::lock_guard<std::mutex> lock(mu_);
  if (reserved_ != 0) {
    FERRY_LOG(ERROR) << "pinned budget '" << name_ << "' destroyed with " << FormatBytes(reserved_)
                     << " still reserved by " << live_ << " arena(s)";
  }
}

size_t PinnedBudget::DefaultProcessLimit() {
  const size_t usable = std::min(PhysicalMemory(), CgroupMemoryLimit());
  if (usable == kUnlimited) return kUnlimited;
  return usable / 10 * 9;
}

PinnedBudget& PinnedBudget::Process() {
  static PinnedBudget* const process = new PinnedBudget(DefaultProcessLimit(), "process");
  return *process;
}

void PinnedBudget::set_limit(size_t limit_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  limit_ = limit_bytes;
}

size_t PinnedBudget::limit() const {
  std::lock_guard<std::mutex> lock(mu_);
  return limit_;
}

PinnedBudgetStats PinnedBudget::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return PinnedBudgetStats{.limit_bytes = limit_,
                           .reserved_bytes = reserved_,
                           .peak_bytes = peak_,
                           .live_reservations = live_,
                           .refusals = refusals_};
}

absl::Status PinnedBudget::Reserve(size_t bytes, std::string_view who) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t free = limit_ > reserved_ ? limit_ - reserved_ : 0;
  if (bytes > free) {
    ++refusals_;
    return absl::ResourceExhaustedError(absl::StrCat(
        ToAbsl(who), ": the pinned-memory budget '", name_, "' stops this reservation of ",
        FormatBytes(bytes), ": its limit is ", FormatLimit(limit_), ", of which ",
        FormatBytes(reserved_), " is reserved by ", live_, " live arena(s), leaving ",
        FormatBytes(free),
        ". Raise the limit (PinnedBudget::set_limit; the process budget starts at 90% of the host "
        "memory this process may use), destroy arenas no longer needed, or use a smaller arena (see "
        "engine/TROUBLESHOOTING.md#the-pinned-budget)"));
  }
  reserved_ += bytes;
  peak_ = std::max(peak_, reserved_);
  ++live_;
  return absl::OkStatus();
}

void PinnedBudget::Release(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  FERRY_CHECK(bytes <= reserved_ && live_ > 0)
      << "pinned budget '" << name_ << "': release of " << bytes << " bytes but " << reserved_
      << " reserved by " << live_ << " reservation(s)";
  reserved_ -= bytes;
  --live_;
}

}  // namespace ferry
