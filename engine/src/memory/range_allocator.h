// An offsets-only sub-allocator over one contiguous range: the bookkeeping behind PinnedArena.
#ifndef FERRY_MEMORY_RANGE_ALLOCATOR_H_
#define FERRY_MEMORY_RANGE_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace ferry {

// RangeAllocator hands out blocks of [0, capacity) by best fit over a free list and coalesces
// neighbouring free blocks on release, so freeing everything gives back one block of the full capacity.
// Every block starts and ends on a multiple of `granule` (sizes are rounded up to it); alignment is
// computed on the address `base + offset`, so a caller can ask for blocks aligned in its address space.
// It touches no memory: it only does arithmetic on offsets.
// Thread-safety: none; one thread at a time (PinnedArena guards it with its mutex).
class RangeAllocator final {
 public:
  // REQUIRES: granule is a power of two; base % granule == 0; capacity % granule == 0.
  RangeAllocator(uintptr_t base, size_t capacity, size_t granule);

  RangeAllocator(const RangeAllocator&) = delete;
  RangeAllocator& operator=(const RangeAllocator&) = delete;

  // Returns the offset of a new block of at least `bytes` whose address (base + offset) is a multiple of
  // `alignment`, or nullopt when no free block fits (nothing changes then).
  // REQUIRES: bytes > 0; alignment is a power of two.
  std::optional<size_t> Allocate(size_t bytes, size_t alignment);

  // Frees the block that Allocate returned at `offset` for a request of `bytes`. On error nothing
  // changes: FailedPrecondition when no allocation starts at `offset` (a double release, or an offset
  // never handed out); InvalidArgument when `offset` points inside an allocation or `bytes` is not the
  // size that was requested.
  absl::Status Release(size_t offset, size_t bytes);

  size_t capacity() const { return capacity_; }
  size_t granule() const { return granule_; }
  // Bytes held by allocations, counting the rounding to `granule` (in_use + free == capacity).
  size_t in_use_bytes() const { return in_use_; }
  size_t free_bytes() const { return capacity_ - in_use_; }
  size_t largest_free_block() const;
  size_t num_allocations() const { return allocated_.size(); }
  size_t num_free_blocks() const { return free_by_offset_.size(); }

  // The free blocks as (offset, size), in address order. For tests and diagnostics.
  std::vector<std::pair<size_t, size_t>> FreeBlocks() const;

 private:
  struct Allocation {
    size_t requested;  // what the caller asked for (checked on release)
    size_t reserved;   // requested rounded up to granule_
  };

  void InsertFree(size_t offset, size_t size);
  void EraseFree(std::map<size_t, size_t>::iterator it);

  const uintptr_t base_;
  const size_t capacity_;
  const size_t granule_;
  size_t in_use_ = 0;
  std::map<size_t, size_t> free_by_offset_;          // offset -> size
  std::set<std::pair<size_t, size_t>> free_by_size_;  // (size, offset), for best fit
  std::map<size_t, Allocation> allocated_;           // offset -> allocation
};

}  // namespace ferry

#endif  // FERRY_MEMORY_RANGE_ALLOCATOR_H_
