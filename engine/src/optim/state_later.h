// The state later: the bookkeeping of an update split in two passes (CpuAdamTensor::param_only). The
// early pass writes the new params of some of a decided step's in-place pieces first, with their
// grads kept aside here, and their state afterwards (HybridOptimizer::RunStateLater): in the early
// thread's idle time after the pass (the fp32 loop's CPU waits there from the last layer's update to
// the next backward's first grads), or before anything reads that state. Off unless the setting
// (EngineOptions::state_later, else FERRY_STATE_LATER: Resolve) gives a fraction of the offloaded fp32
// grads' bytes to keep, or `auto`: then the bytes staged a cycle (from an empty buffer to the next)
// follow what the idle time held (AutoLimit).
// `ferry bench adam` times the two passes. Pure bookkeeping: no CUDA, no threads.
#ifndef FERRY_OPTIM_STATE_LATER_H_
#define FERRY_OPTIM_STATE_LATER_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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
    size_t kept = 0;      // bytes of the buffer it holds (its grads, to the next line)
    AdamScalars scalars;  // the step's
    uint64_t step = 0;    // step_id() when it was staged
  };

  // What the setting asks: a fraction of the offloaded fp32 grads' bytes, or `auto`.
  struct Setting {
    double fraction = 0.0;  // 0: off
    bool automatic = false;
  };
  // `auto` keeps a buffer of this fraction and stages what the idle time held (AutoLimit).
  static constexpr double kAutoFraction = 0.25;

  StateLater() = default;
  explicit StateLater(Setting setting);
  // "off" (or "0"), "auto", or a fraction in (0, 1]. Errors quote the text; `what` names its source.
  static absl::StatusOr<Setting> Parse(std::string_view text, std::string_view what);
  // FERRY_STATE_LATER parsed (a bad value warns and is off); unset or empty: `fallback`.
  static Setting FromEnv(Setting fallback);
  // What an engine runs: `option` (EngineOptions::state_later) where it is not empty, else FromEnv.
  static absl::StatusOr<Setting> Resolve(std::string_view option);
  bool on() const { return fraction_ > 0.0; }
  bool automatic() const { return automatic_; }
  bool allocated() const { return capacity_ != 0; }
  size_t capacity() const { return capacity_; }  // bytes of the kept grads' buffer (0: not allocated)
  // Bytes of the buffer a cycle may stage: its capacity, or with `auto` the adapted limit.
  size_t limit() const { return limit_; }

  // Allocates the kept grads' buffer once: `fraction` of `grad_bytes` (the offloaded fp32 params'
  // grads). Errors (then off): the allocation failed.
  absl::Status Ensure(size_t grad_bytes);
  // Makes `t` (an in-place fp32 update with a param) param-only, its grads copied into the buffer,
  // and records its piece when it fits in what is left of limit(); false otherwise (`t` unchanged).
  bool Stage(CpuAdamTensor& t, size_t param, size_t group, size_t e0);
  // The kept grads of `piece`.
  const void* grads(const Piece& piece) const { return keep_.get() + piece.keep_at; }

  const std::vector<Piece>& pieces() const { return pieces_; }
  bool empty() const { return pieces_.empty(); }
  // The step whose early work stages pieces now: NextStep at each step's first announcement, so that
  // a step's settling drops its own pieces only, never those a step before left to be written.
  uint64_t step_id() const { return step_; }
  void NextStep() { ++step_; }
  // The first `count` pieces are written, in the early thread's idle time (`idle`) or not (at its next
  // pass's start, or by the trainer's thread): they go. Once no piece is left the buffer is handed
  // out from its start again, and that cycle adapts the `auto` limit (AutoLimit).
  void Done(size_t count, bool idle);
  // Forgets the pieces of step_id() of the groups `drop[g] != 0` (their update is undone or
  // recomputed).
  void Drop(const std::vector<uint8_t>& drop);

  // The `auto` limit after a cycle that wrote `idle` bytes of kept grads in idle time and `spilled`
  // bytes outside it, `limited` if a piece found no room under `limit`: where some spilled, what the
  // idle time held (the window is that large); where none spilled and room was short, one step
  // (`capacity` / 32) more; else the same. Between one step and `capacity`.
  static size_t AutoLimit(size_t limit, size_t capacity, size_t idle, size_t spilled, bool limited);

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  // The buffer is empty again: the cycle's counts go (after adapting the limit, where `adapt`).
  void EndCycle(bool adapt);

  double fraction_ = 0.0;
  bool automatic_ = false;
  size_t capacity_ = 0;  // bytes of keep_ (0: not allocated)
  size_t limit_ = 0;     // bytes a cycle may stage (capacity_, or adapted with `auto`)
  size_t next_ = 0;      // bytes handed out since the buffer was last empty
  // This cycle's kept bytes written in idle time and outside it, and whether room was short.
  size_t cycle_idle_ = 0, cycle_spilled_ = 0;
  bool cycle_limited_ = false;
  uint64_t step_ = 0;
  std::unique_ptr<char, Free> keep_;
  std::vector<Piece> pieces_;
};

}  // namespace ferry

#endif  // FERRY_OPTIM_STATE_LATER_H_
