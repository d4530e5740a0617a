// StreamedAdam: a benchmark's GPU Adam over state that stays in pinned host memory (see below).
#ifndef FERRY_TESTS_BENCH_STREAMED_ADAM_H_
#define FERRY_TESTS_BENCH_STREAMED_ADAM_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/adam_math.h"
#include "device/device.h"
#include "ferry/dtype.h"
#include "ferry/status.h"
#include "memory/pinned_arena.h"

namespace ferry::bench {

// Adam on the GPU over fp32 state kept in pinned host memory: each piece of the tensors (at most
// `piece` elements) goes up into one of `slots` device slots, is updated there (the grads and params
// are the trainer's bf16 tensors, on the device) and goes back down, the copies and kernels of
// different pieces overlapping on three streams. The state never stays on the device. `ferry bench
// step --streamed` measures it beside the offloaded step of other params: whether the host's memory
// and PCIe have room for both (a lever for the fully offloaded step; the engine does not do this).
class StreamedAdam {
 public:
  struct Tensor {
    void* param = nullptr;       // bf16, device
    const void* grad = nullptr;  // bf16, device
    int64_t numel = 0;
  };
  static absl::StatusOr<std::unique_ptr<StreamedAdam>> Create(Device& device, const std::vector<Tensor>& tensors,
                                                              int64_t piece, size_t slots) {
    if (piece < 1) return absl::InvalidArgumentError("StreamedAdam: a piece must hold at least one element");
    std::unique_ptr<StreamedAdam> s(new StreamedAdam(device));
    for (const Tensor& t : tensors) s->numel_ += t.numel;
    s->slots_count_ = std::max<size_t>(1, slots);
    FERRY_ASSIGN_OR_RETURN(s->up_, device.CreateStream());
    FERRY_ASSIGN_OR_RETURN(s->update_, device.CreateStream());
    FERRY_ASSIGN_OR_RETURN(s->down_, device.CreateStream());
    s->scalars_ = MakeAdamScalars(AdamHyper{}, 1);
    if (s->numel_ == 0) return s;  // nothing streamed (share 0)
    PinnedArenaOptions ao;
    ao.capacity_bytes = static_cast<size_t>(s->numel_) * 12 + 4096;
    ao.name = "streamed Adam state";
    FERRY_ASSIGN_OR_RETURN(s->arena_, PinnedArena::Create(&device, ao));
    FERRY_ASSIGN_OR_RETURN(s->state_, s->arena_->Allocate(static_cast<size_t>(s->numel_) * 12));
    float* const host = s->state_.as<float>();
    std::fill(host, host + s->numel_, 0.01f);                  // master
    std::fill(host + s->numel_, host + 3 * s->numel_, 0.0f);  // m, v
    int64_t at = 0;
    for (const Tensor& t : tensors) {
      for (int64_t off = 0; off < t.numel; off += piece) {
        const int64_t n = std::min(piece, t.numel - off);
        s->pieces_.push_back(
            Piece{static_cast<uint16_t*>(t.param) + off, static_cast<const uint16_t*>(t.grad) + off, at, n});
        at += n;
      }
    }
    for (size_t k = 0; k < s->slots_count_; ++k) {
      FERRY_ASSIGN_OR_RETURN(DeviceBuffer b, device.Allocate(static_cast<size_t>(piece) * 12));
      s->slots_.push_back(std::move(b));
      for (auto* events : {&s->up_done_, &s->update_done_}) {
        FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, device.CreateEvent());
        events->push_back(std::move(e));
      }
      // Waited on by the host: a blocking event sleeps instead of spinning on a core CPU Adam uses.
      FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Event> down, device.CreateBlockingEvent());
      s->down_done_.push_back(std::move(down));
    }
    return s;
  }
  ~StreamedAdam() {
    if (worker_.joinable()) worker_.join();
    if (down_ != nullptr) (void)down_->Synchronize();
    if (arena_ != nullptr && !state_.empty()) (void)arena_->Release(state_);
  }
  int64_t numel() const { return numel_; }
  // One step over every piece, on a thread of its own: a piece is enqueued once its slot's last piece
  // is down (a blocking wait), so at most slots_count_ pieces' copies are queued ahead of anyone else's on
  // the copy engines (enqueued all at once, they delayed the offloaded step's copies until the end).
  void Start() {
    if (worker_.joinable()) worker_.join();  // a step not waited for finishes first
    worker_ = std::thread([this] { status_ = Run(); });
  }
  absl::Status Wait() {
    if (worker_.joinable()) worker_.join();
    FERRY_RETURN_IF_ERROR(status_);
    return down_->Synchronize();
  }

 private:
  absl::Status Run() {
    for (size_t j = 0; j < pieces_.size(); ++j) {
      const Piece& p = pieces_[j];
      const size_t k = j % slots_count_;
      const size_t bytes = static_cast<size_t>(p.numel) * 4;
      float* const slot = slots_[k].as<float>();
      float* const host[3] = {state_.as<float>() + p.at, state_.as<float>() + numel_ + p.at,
                              state_.as<float>() + 2 * numel_ + p.at};
      if (j >= slots_count_) FERRY_RETURN_IF_ERROR(down_done_[k]->Synchronize());  // the slot's last piece is down
      for (int s = 0; s < 3; ++s) {
        FERRY_RETURN_IF_ERROR(device_.CopyAsync(slot + s * p.numel, host[s], bytes, CopyKind::kHostToDevice, *up_));
      }
      FERRY_RETURN_IF_ERROR(up_->Record(*up_done_[k]));
      FERRY_RETURN_IF_ERROR(update_->WaitFor(*up_done_[k]));
      AdamTensorArgs a;
      a.master = slot;
      a.exp_avg = slot + p.numel;
      a.exp_avg_sq = slot + 2 * p.numel;
      a.grad = p.grad;
      a.param = p.param;
      a.numel = p.numel;
      a.grad_dtype = a.param_dtype = DType::kBF16;
      FERRY_RETURN_IF_ERROR(device_.LaunchAdam({&a, 1}, {&scalars_, 1}, *update_));
      FERRY_RETURN_IF_ERROR(update_->Record(*update_done_[k]));
      FERRY_RETURN_IF_ERROR(down_->WaitFor(*update_done_[k]));
      for (int s = 0; s < 3; ++s) {
        FERRY_RETURN_IF_ERROR(device_.CopyAsync(host[s], slot + s * p.numel, bytes, CopyKind::kDeviceToHost, *down_));
      }
      FERRY_RETURN_IF_ERROR(down_->Record(*down_done_[k]));
    }
    return absl::OkStatus();
  }

  struct Piece {
    uint16_t* param;
    const uint16_t* grad;
    int64_t at;  // element offset in the host state
    int64_t numel;
  };
  explicit StreamedAdam(Device& device) : device_(device) {}
  Device& device_;
  int64_t numel_ = 0;
  size_t slots_count_ = 4;  // pieces in flight (device slots)
  std::unique_ptr<PinnedArena> arena_;
  HostSpan state_;  // [master | m | v], fp32
  std::vector<Piece> pieces_;
  std::vector<DeviceBuffer> slots_;
  std::vector<std::unique_ptr<Event>> up_done_, update_done_, down_done_;
  std::unique_ptr<Stream> up_, update_, down_;
  AdamScalars scalars_{};
  std::thread worker_;
  absl::Status status_;
};

}  // namespace ferry::bench

#endif  // FERRY_TESTS_BENCH_STREAMED_ADAM_H_
