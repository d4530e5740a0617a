// The state later: the bookkeeping of an update split in two passes (CpuAdamTensor::param_only). The
// early pass writes the new params of some of a decided step's in-place pieces first, with their
// grads kept aside here, and their state afterwards (HybridOptimizer::RunStateLater): in the early
// thread's idle time after the pass (the fp32 loop's CPU waits there from the last layer's update to
// the next backward's first grads), or before anything reads that state. Off unless
// FERRY_STATE_LATER gives a fraction of the offloaded fp32 grads' bytes to keep (an A/B of the
// lever; `ferry bench adam` times the two passes). Pure bookkeeping: no CUDA, no threads.
#ifndef FERRY_OPTIM_STATE_LATER_H_
#define FERRY_OPTIM_STATE_LATER_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "base/adam_math.h"
#include "optim/cpu_adam.h"

namespace ferry {

class StateLater {
 public:
  // A piece whose new param went up and whose state is still to write.
  struct Piece {
    size_t param = 0;
    size_t group = 0;
    size_t e0 = 0;        // its first element of the param
    int64_t n = 0;        // elements
    size_t keep_at = 0;   // byte offset of its grads in the kept buffer
    AdamScalars scalars;  // the step's
    uint64_t step = 0;    // step_id() when it was staged
  };

  // `fraction` of the offloaded fp32 grads' bytes (0: off). FractionFromEnv: FERRY_STATE_LATER, 0 when
  // unset or not a number in (0, 1].
  explicit StateLater(double fraction = 0.0) : fraction_(fraction) {}
  static double FractionFromEnv();
  bool on() const { return fraction_ > 0.0; }
  bool allocated() const { return capacity_ != 0; }

  // Allocates the kept grads' buffer once: `fraction` of `grad_bytes` (the offloaded fp32 params'
  // grads). Errors (then off): the allocation failed.
  absl::Status Ensure(size_t grad_bytes);
  // Makes `t` (an in-place fp32 update with a param) param-only, its grads copied into the buffer,
  // and records its piece when it fits in what is left of the buffer; false otherwise (`t` unchanged).
  bool Stage(CpuAdamTensor& t, size_t param, size_t group, size_t e0);
  // The kept grads of `piece`.
  const void* grads(const Piece& piece) const { return keep_.get() + piece.keep_at; }

  const std::vector<Piece>& pieces() const { return pieces_; }
  bool empty() const { return pieces_.empty(); }
  // The step whose early work stages pieces now: NextStep at each step's first announcement, so that
  // a step's settling drops its own pieces only, never those a step before left to be written.
  uint64_t step_id() const { return step_; }
  void NextStep() { ++step_; }
  // The first `count` pieces are written: they go (the buffer is handed out from its start again once
  // no piece is left).
  void Done(size_t count);
  // Forgets the pieces of step_id() of the groups `drop[g] != 0` (their update is undone or
  // recomputed).
  void Drop(const std::vector<uint8_t>& drop);

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  double fraction_ = 0.0;
  size_t capacity_ = 0;  // bytes of keep_ (0: not allocated)
  size_t next_ = 0;      // bytes handed out since the buffer was last empty
  uint64_t step_ = 0;
  std::unique_ptr<char, Free> keep_;
  std::vector<Piece> pieces_;
};

}  // namespace ferry

#endif  // FERRY_OPTIM_STATE_LATER_H_
