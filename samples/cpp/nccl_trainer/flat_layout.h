// The NCCL trainer's flat buffers and their shards: every tensor of the model at a fixed, aligned
// offset of one flat buffer (params in bf16, local grads in int64 fixed point), the buffer padded to
// `world * chunk` elements so that NCCL's reduce-scatter and all-gather hand each rank one equal
// chunk, and each tensor's part of a rank's chunk as Ferry's ParamSpec range.
//
// The tensors' offsets do not depend on the world size (only the padding at the end does), so the
// elements of a tensor sit at the same place of the flat buffer whatever the number of ranks.
//
// Pure functions of the shapes and the world size; plain C++17 (no Abseil or Ferry types), so that
// nvcc compiles it and tests/samples checks it on any machine.
#ifndef FERRY_SAMPLES_NCCL_TRAINER_FLAT_LAYOUT_H_
#define FERRY_SAMPLES_NCCL_TRAINER_FLAT_LAYOUT_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "exact_math.h"

namespace nccl_trainer {

// Every tensor starts, and every rank's chunk is sized, at a multiple of this many elements: 256 B
// of bf16, 1 KiB of int64. So every pointer the trainer hands Ferry or NCCL is 256-byte aligned.
constexpr int64_t kAlign = 128;

// The model: a 2-layer MLP, out = W2 tanh(W1 x + b1) + b2, trained on `batch` examples per step (the
// global batch, split evenly over the ranks).
struct Shape {
  int64_t in = 256;
  int64_t hidden = 1024;
  int64_t out = 64;
  int64_t batch = 64;
};

struct TensorSlot {
  std::string name;    // "fc1.weight", ...
  std::string group;   // "fc1" or "fc2": Ferry's unit of placement
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in elements, from the start of the flat buffer; a multiple of kAlign
};

inline int64_t RoundUp(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct FlatLayout {
  std::vector<TensorSlot> tensors;  // fc1.weight, fc1.bias, fc2.weight, fc2.bias
  int world = 1;
  int64_t used = 0;   // one past the last tensor's last element
  int64_t chunk = 0;  // each rank's share: a multiple of kAlign, world * chunk >= used

  int64_t total() const { return chunk * world; }  // elements of each flat buffer
  int64_t chunk_begin(int rank) const { return chunk * rank; }

  // The part of tensor `t` in rank `rank`'s chunk, as [begin, end) of the flattened tensor. Empty when
  // the chunk misses the tensor: then begin == end == 0 (the chunk lies before it) or numel (after),
  // so that the ranks' ranges, sorted, tile [0, numel) as Ferry's Finalize requires.
  std::pair<int64_t, int64_t> ShardOf(size_t t, int rank) const {
    const TensorSlot& s = tensors[t];
    const int64_t lo = std::clamp(chunk_begin(rank) - s.offset, int64_t{0}, s.numel);
    const int64_t hi = std::clamp(chunk_begin(rank) + chunk - s.offset, int64_t{0}, s.numel);
    return {lo, std::max(lo, hi)};
  }
};

inline FlatLayout MakeLayout(const Shape& shape, int world) {
  FlatLayout layout;
  layout.world = world;
  const struct {
    const char* name;
    const char* group;
    std::vector<int64_t> dims;
  } tensors[] = {{"fc1.weight", "fc1", {shape.hidden, shape.in}},
                 {"fc1.bias", "fc1", {shape.hidden}},
                 {"fc2.weight", "fc2", {shape.out, shape.hidden}},
                 {"fc2.bias", "fc2", {shape.out}}};
  int64_t at = 0;
  for (const auto& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.dims) numel *= d;
    layout.tensors.push_back({t.name, t.group, t.dims, numel, at});
    layout.used = at + numel;
    at = RoundUp(layout.used, kAlign);
  }
  layout.chunk = RoundUp((layout.used + world - 1) / world, kAlign);
  return layout;
}

// The full params at start, layout.total() bf16 bits: the weights from InitialWeight (seeded by the
// tensor's index), the biases and the padding 0. The same on every rank, whatever the world size.
inline std::vector<uint16_t> InitialParams(const FlatLayout& layout) {
  std::vector<uint16_t> flat(static_cast<size_t>(layout.total()), 0);
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const TensorSlot& s = layout.tensors[t];
    if (s.shape.size() != 2) continue;
    for (int64_t k = 0; k < s.numel; ++k) flat[s.offset + k] = InitialWeight(t + 1, k, s.shape[1]);
  }
  return flat;
}

// The elements of every tensor, in order, out of a flat buffer of `layout` (the padding between and
// after the tensors left out): what a run's result is compared by, whatever its world size.
template <typename T>
std::vector<T> TensorElements(const FlatLayout& layout, const std::vector<T>& flat) {
  std::vector<T> out;
  out.reserve(static_cast<size_t>(layout.used));
  for (const TensorSlot& s : layout.tensors) {
    out.insert(out.end(), flat.begin() + s.offset, flat.begin() + s.offset + s.numel);
  }
  return out;
}

// FNV-1a over bytes: a run's fingerprint, printed so that runs with different world sizes can be
// compared by eye (the check itself compares the bytes).
inline uint64_t Fingerprint(const void* data, size_t bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

}  // namespace nccl_trainer

#endif  // FERRY_SAMPLES_NCCL_TRAINER_FLAT_LAYOUT_H_
