#include "memory/range_allocator.h"

#include <iterator>

#include "absl/strings/str_cat.h"
#include "base/logging.h"

namespace ferry {
namespace {

bool IsPowerOfTwo(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

// Rounds `x` up to a multiple of `align` (a power of two). REQUIRES: no overflow (callers check).
uintptr_t AlignUp(uintptr_t x, size_t align) { return (x + align - 1) & ~(uintptr_t{align} - 1); }

}  // namespace

RangeAllocator::RangeAllocator(uintptr_t base, size_t capacity, size_t granule)
    : base_(base), capacity_(capacity), granule_(granule) {
  FERRY_CHECK(IsPowerOfTwo(granule)) << "granule " << granule;
  FERRY_CHECK(base % granule == 0) << "base " << base << " granule " << granule;
  FERRY_CHECK(capacity % granule == 0) << "capacity " << capacity << " granule " << granule;
  if (capacity > 0) InsertFree(0, capacity);
}

std::optional<size_t> RangeAllocator::Allocate(size_t bytes, size_t alignment) {
  FERRY_CHECK(bytes > 0);
  FERRY_CHECK(IsPowerOfTwo(alignment)) << "alignment " << alignment;
  if (bytes > capacity_ || alignment > capacity_ + granule_) return std::nullopt;
  const size_t need = AlignUp(bytes, granule_);
  // Best fit: the smallest free block that holds `need` bytes after its alignment padding.
  for (auto it = free_by_size_.lower_bound({need, 0}); it != free_by_size_.end(); ++it) {
    const auto [size, offset] = *it;
    const size_t aligned = AlignUp(base_ + offset, alignment) - base_;
    const size_t pad = aligned - offset;  // a multiple of granule_ (both ends are)
    if (pad > size || size - pad < need) continue;
    EraseFree(free_by_offset_.find(offset));
    if (pad > 0) InsertFree(offset, pad);
    if (size - pad > need) InsertFree(aligned + need, size - pad - need);
    allocated_.emplace(aligned, Allocation{.requested = bytes, .reserved = need});
    in_use_ += need;
    return aligned;
  }
  return std::nullopt;
}

absl::Status RangeAllocator::Release(size_t offset, size_t bytes) {
  auto it = allocated_.find(offset);
  if (it == allocated_.end()) {
    // Say what the offset is, so the caller can tell a double release from a stray pointer.
    auto after = allocated_.upper_bound(offset);
    if (after != allocated_.begin()) {
      auto before = std::prev(after);
      if (offset < before->first + before->second.reserved) {
        return absl::InvalidArgumentError(absl::StrCat(
            "offset ", offset, " points inside the allocation at offset ", before->first, " of ",
            before->second.requested, " bytes; release the span that Allocate returned"));
      }
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "no allocation starts at offset ", offset,
        " (already released: double release, or never allocated)"));
  }
  if (it->second.requested != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("release of the allocation at offset ", offset,
                                                   " says ", bytes, " bytes but ",
                                                   it->second.requested, " were allocated"));
  }
  size_t start = offset;
  size_t size = it->second.reserved;
  in_use_ -= size;
  allocated_.erase(it);
  // Coalesce with the free neighbours on both sides.
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    FERRY_CHECK(prev->first + prev->second <= start)
        << "free block overlaps the allocation at " << start;
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      EraseFree(prev);
    }
  }
  next = free_by_offset_.lower_bound(start + size);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    EraseFree(next);
  }
  InsertFree(start, size);
  return absl::OkStatus();
}

size_t RangeAllocator::largest_free_block() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

std::vector<std::pair<size_t, size_t>> RangeAllocator::FreeBlocks() const {
  return {free_by_offset_.begin(), free_by_offset_.end()};
}

void RangeAllocator::InsertFree(size_t offset, size_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void RangeAllocator::EraseFree(std::map<size_t, size_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

}  // namespace ferry
