// Small helpers shared by the checkpoint files (internal to ckpt/): the XXH3-64 state every piece
// is hashed with, the I/O piece size, and status annotation.
#ifndef FERRY_CKPT_CKPT_IO_H_
#define FERRY_CKPT_CKPT_IO_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "xxhash.h"

namespace ferry {
struct ManifestChunk;
struct TensorEntry;
}  // namespace ferry

namespace ferry::ckpt_internal {

static_assert(sizeof(size_t) == sizeof(uint64_t), "checkpoint offsets assume a 64-bit size_t");

// Tensors are written and read in pieces of this size, each hashed right after it is written or
// read, while it is still in cache: one pass over the data, large system calls.
inline constexpr size_t kIoChunkBytes = size_t{8} << 20;

struct Xxh3StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using Xxh3State = std::unique_ptr<XXH3_state_t, Xxh3StateDeleter>;

// A fresh, reset XXH3-64 state.
inline absl::StatusOr<Xxh3State> NewXxh3State() {
  Xxh3State state(XXH3_createState());
  if (state == nullptr) return absl::ResourceExhaustedError("XXH3_createState: out of memory");
  // Only fails for a null state, excluded above.
  XXH_errorcode rc = XXH3_64bits_reset(state.get());
  (void)rc;
  return state;
}

// `s` with `more` appended to its message (same code).
inline absl::Status Annotate(const absl::Status& s, absl::string_view more) {
  return absl::Status(s.code(), absl::StrCat(s.message(), more));
}

// "bytes [a, b) of rank-00001.safetensors, elements [i, j) of the tensor": where chunk `c` of `e`
// lies, for error messages (defined in checkpoint_reader.cc).
std::string DescribeChunk(const TensorEntry& e, const ManifestChunk& c);

}  // namespace ferry::ckpt_internal

#endif  // FERRY_CKPT_CKPT_IO_H_
