// Flat buffers and their partition across ranks: pure functions of the parameter specs and the world
// size (deterministic, no collectives), so every rank computes the same plan on its own.
#ifndef FERRY_SHARD_LAYOUT_H_
#define FERRY_SHARD_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace ferry {

// Where one tensor sits in a flat buffer, in elements.
struct Slot {
  int64_t offset = 0;
  int64_t numel = 0;
};

// Tensors packed back to back in one flat buffer, each starting at a multiple of `alignment` elements.
// Immutable after Pack; safe for concurrent use.
class Layout final {
 public:
  // REQUIRES nothing: bad input (numel <= 0, alignment <= 0, overflow) is an InvalidArgument naming
  // the tensor's index.
  static absl::StatusOr<Layout> Pack(absl::Span<const int64_t> numels, int64_t alignment_elements);

  const std::vector<Slot>& slots() const { return slots_; }
  int64_t total_elements() const { return total_; }  // including alignment padding
  int64_t payload_elements() const { return payload_; }

 private:
  std::vector<Slot> slots_;
  int64_t total_ = 0;
  int64_t payload_ = 0;
};

// A piece of one tensor owned by one rank.
struct Chunk {
  int rank = 0;
  size_t tensor = 0;          // index into the Layout's slots
  int64_t tensor_offset = 0;  // first element within the tensor
  int64_t global_offset = 0;  // first element within the flat buffer
  int64_t numel = 0;
};

// The flat buffer's payload split into `world_size` contiguous shards, as even as possible: the first
// (payload % world_size) ranks own one element more. Padding is owned by nobody.
class ShardPlan final {
 public:
  static absl::StatusOr<ShardPlan> Partition(const Layout& layout, int world_size);

  int world_size() const { return world_size_; }
  // Chunks of `rank`, in flat-buffer order. REQUIRES: 0 <= rank < world_size.
  const std::vector<Chunk>& chunks(int rank) const { return chunks_[static_cast<size_t>(rank)]; }
  // Elements owned by `rank`.
  int64_t shard_elements(int rank) const;

 private:
  int world_size_ = 1;
  std::vector<std::vector<Chunk>> chunks_;
};

}  // namespace ferry

#endif  // FERRY_SHARD_LAYOUT_H_
