#include "shard/layout.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace ferry {

absl::StatusOr<Layout> Layout::Pack(absl::Span<const int64_t> numels, int64_t alignment_elements) {
  if (alignment_elements <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Layout::Pack: alignment must be positive, got ", alignment_elements));
  }
  Layout layout;
  layout.slots_.reserve(numels.size());
  int64_t cursor = 0;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 16;  // leaves room for byte sizes
  for (size_t i = 0; i < numels.size(); ++i) {
    int64_t n = numels[i];
    if (n <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Layout::Pack: tensor ", i, " has ", n, " elements; expected at least 1"));
    }
    int64_t start = (cursor + alignment_elements - 1) / alignment_elements * alignment_elements;
    if (start > kMax - n) {
      return absl::InvalidArgumentError(absl::StrCat("Layout::Pack: tensor ", i, " overflows the layout"));
    }
    layout.slots_.push_back(Slot{start, n});
    cursor = start + n;
    layout.payload_ += n;
  }
  layout.total_ = cursor;
  return layout;
}

absl::StatusOr<ShardPlan> ShardPlan::Partition(const Layout& layout, int world_size) {
  if (world_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ShardPlan::Partition: world size must be positive, got ", world_size));
  }
  ShardPlan plan;
  plan.world_size_ = world_size;
  plan.chunks_.resize(static_cast<size_t>(world_size));
  const int64_t payload = layout.payload_elements();
  const int64_t base = payload / world_size;
  const int64_t extra = payload % world_size;
  // Shards are ranges of the payload (padding excluded), walked tensor by tensor.
  int rank = 0;
  int64_t left_in_rank = base + (rank < extra ? 1 : 0);
  const auto& slots = layout.slots();
  for (size_t t = 0; t < slots.size(); ++t) {
    int64_t done = 0;
    while (done < slots[t].numel) {
      while (left_in_rank == 0) {
        ++rank;
        left_in_rank = base + (rank < extra ? 1 : 0);
      }
      int64_t take = std::min(left_in_rank, slots[t].numel - done);
      plan.chunks_[static_cast<size_t>(rank)].push_back(
          Chunk{rank, t, done, slots[t].offset + done, take});
      done += take;
      left_in_rank -= take;
    }
  }
  return plan;
}

int64_t ShardPlan::shard_elements(int rank) const {
  int64_t n = 0;
  for (const Chunk& c : chunks_[static_cast<size_t>(rank)]) n += c.numel;
  return n;
}

}  // namespace ferry
