// The MLP on Ferry's host backend: there "device memory" is host memory, so the trainer's tensors are
// plain vectors and forward/backward are loops on the calling thread (the host backend's stream for
// Engine::Step(options, nullptr)), so Forward and Backward have run when they return.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mlp.h"
#include "mlp_math.h"
#include "mlp_random.h"

namespace mlp {
namespace {

class HostModel final : public Model {
 public:
  explicit HostModel(const Shape& s)
      : s_(s),
        w1_(s.hidden * s.in), b1_(s.hidden), w2_(s.out * s.hidden), b2_(s.out),
        gw1_(w1_.size()), gb1_(b1_.size()), gw2_(w2_.size()), gb2_(b2_.size()),
        x_(s.batch * s.in), h_(s.batch * s.hidden), out_(s.batch * s.out), dout_(out_.size()), dh_(h_.size()) {}

  std::vector<Tensor> Tensors() override {
    return {{"fc1.weight", "fc1", {s_.hidden, s_.in}, w1_.data(), gw1_.data()},
            {"fc1.bias", "fc1", {s_.hidden}, b1_.data(), gb1_.data()},
            {"fc2.weight", "fc2", {s_.out, s_.hidden}, w2_.data(), gw2_.data()},
            {"fc2.bias", "fc2", {s_.out}, b2_.data(), gb2_.data()}};
  }

  bool Init(uint64_t seed, std::string* error) override {
    std::vector<uint16_t> bits = InitialParams(s_, seed);
    size_t at = 0;
    for (std::vector<uint16_t>* p : {&w1_, &b1_, &w2_, &b2_}) {
      std::memcpy(p->data(), bits.data() + at, p->size() * sizeof(uint16_t));
      at += p->size();
    }
    return true;
  }

  bool Forward(const float* x, const float* y, const LayerHook& before_layer, std::string* error) override {
    const int64_t B = s_.batch, I = s_.in, H = s_.hidden, O = s_.out;
    x_.assign(x, x + B * I);  // read again by fc1's backward
    if (before_layer && !before_layer("fc1", error)) return false;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < H; ++j) h_[b * H + j] = Hidden(w1_.data(), b1_.data(), x_.data(), I, b, j);
    if (before_layer && !before_layer("fc2", error)) return false;
    double sum = 0.0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t o = 0; o < O; ++o) {
        float se = 0.0f;
        out_[b * O + o] = Output(w2_.data(), b2_.data(), h_.data(), H, b, o);
        dout_[b * O + o] = OutputGrad(out_[b * O + o], y[b * O + o], B, &se);
        sum += se;
      }
    }
    loss_ = sum / (2.0 * static_cast<double>(B));
    return true;
  }

  bool Backward(const LayerHook& after_layer, std::string* error) override {
    const int64_t B = s_.batch, I = s_.in, H = s_.hidden, O = s_.out;
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t j = 0; j < H; ++j) gw2_[o * H + j] = WeightGrad(dout_.data(), h_.data(), B, O, H, o, j);
      gb2_[o] = BiasGrad(dout_.data(), B, O, o);
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < H; ++j) dh_[b * H + j] = HiddenGrad(dout_.data(), w2_.data(), h_.data(), H, O, b, j);
    if (after_layer && !after_layer("fc2", error)) return false;
    for (int64_t j = 0; j < H; ++j) {
      for (int64_t i = 0; i < I; ++i) gw1_[j * I + i] = WeightGrad(dh_.data(), x_.data(), B, H, I, j, i);
      gb1_[j] = BiasGrad(dh_.data(), B, H, j);
    }
    return !after_layer || after_layer("fc1", error);
  }

  bool ReadLoss(double* loss, std::string* error) override {
    *loss = loss_;
    return true;
  }

  bool ReadParams(std::vector<uint16_t>* bits, std::string* error) override {
    bits->clear();
    for (const std::vector<uint16_t>* p : {&w1_, &b1_, &w2_, &b2_}) bits->insert(bits->end(), p->begin(), p->end());
    return true;
  }

  void* stream() const override { return nullptr; }

 private:
  const Shape s_;
  std::vector<uint16_t> w1_, b1_, w2_, b2_;    // bf16 params
  std::vector<float> gw1_, gb1_, gw2_, gb2_;    // fp32 grads
  std::vector<float> x_, h_, out_, dout_, dh_;  // the batch's input, activations and their grads
  double loss_ = 0.0;                           // the last batch's
};

}  // namespace

std::unique_ptr<Model> MakeHostModel(const Shape& shape) { return std::make_unique<HostModel>(shape); }

}  // namespace mlp
