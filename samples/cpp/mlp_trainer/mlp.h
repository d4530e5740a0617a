// The sample trainer's model: a 2-layer MLP, out = W2 tanh(W1 x + b1) + b2, trained by mean squared
// error. Its params are bf16 and its grads fp32, in the trainer's device memory; Ferry keeps the fp32
// masters and Adam moments and updates the params in place.
//
// Two implementations of the same math (mlp_math.h): plain loops on the host backend, where device
// memory is host memory (mlp_host.cc), and CUDA kernels on the trainer's own stream (mlp_cuda.cu,
// built when the Ferry package was built with CUDA). Both are deterministic: every output element is
// computed by one thread, summing in a fixed order, so a resumed run repeats the uninterrupted one
// bit for bit.
//
// Plain C++17 with no Abseil or Ferry types, so that nvcc compiles the CUDA side without them.
#ifndef FERRY_SAMPLES_MLP_TRAINER_MLP_H_
#define FERRY_SAMPLES_MLP_TRAINER_MLP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mlp {

struct Shape {
  int64_t batch = 64;
  int64_t in = 32;
  int64_t hidden = 64;
  int64_t out = 8;
};

// One registered tensor: a bf16 param and its fp32 grad, both in device memory.
struct Tensor {
  std::string name;   // "fc1.weight", ...
  std::string group;  // "fc1" or "fc2": Ferry's unit of placement
  std::vector<int64_t> shape;
  void* param = nullptr;
  void* grad = nullptr;
};

// Called between the layers of a pass with the group of a layer ("fc1", "fc2"), in stream order: a
// trainer makes its stream wait there for the group's params (Engine::WaitParams) or announces the
// group's grads (Engine::GradsReady). Returns false with *error set to stop the pass.
using LayerHook = std::function<bool(const std::string& group, std::string* error)>;

// The model's tensors and its forward and backward passes. One thread at a time.
class Model {
 public:
  virtual ~Model() = default;
  // w1, b1, w2, b2 with their grads. Valid for the model's lifetime.
  virtual std::vector<Tensor> Tensors() = 0;
  // Sets every param to a deterministic function of `seed` (bf16 bits, written in stream order).
  virtual bool Init(uint64_t seed, std::string* error) = 0;
  // Forward and backward of one batch: x [batch, in] and y [batch, out], row-major host arrays.
  // Enqueued on stream() after the work already on it (the previous Step); the grads hold the
  // gradient of the batch's loss when it has run. Writes the batch's loss to *loss (waits for it).
  bool ForwardBackward(const float* x, const float* y, double* loss, std::string* error) {
    return Forward(x, y, nullptr, error) && Backward(nullptr, error) && ReadLoss(loss, error);
  }

  // The same pass in parts that never wait for the device, for a trainer whose host runs ahead of it.
  // Forward enqueues the batch's copy (x and y may be reused at once), fc1, then fc2 and the loss's
  // grad, calling before_layer (when set) with each layer's group before the layer first reads its
  // params. Backward enqueues fc2's grads and the hidden grad (the last read of fc2's params), calls
  // after_layer("fc2"), then enqueues fc1's grads and calls after_layer("fc1"): after each call the
  // group's grads are final on stream() and the pass no longer reads its params.
  virtual bool Forward(const float* x, const float* y, const LayerHook& before_layer, std::string* error) = 0;
  virtual bool Backward(const LayerHook& after_layer, std::string* error) = 0;
  // The loss of the last batch Forward enqueued (waits for it).
  virtual bool ReadLoss(double* loss, std::string* error) = 0;
  // Every param's bf16 bits, in Tensors() order, once the work on stream() has finished.
  virtual bool ReadParams(std::vector<uint16_t>* bits, std::string* error) = 0;
  // The stream the model runs on, for Engine::Step: a cudaStream_t, or nullptr on the host.
  virtual void* stream() const = 0;
};

std::unique_ptr<Model> MakeHostModel(const Shape& shape);
#ifdef FERRY_SAMPLE_CUDA
// nullptr (with *error set) when no CUDA device can be used.
std::unique_ptr<Model> MakeCudaModel(const Shape& shape, std::string* error);
#endif

}  // namespace mlp

#endif  // FERRY_SAMPLES_MLP_TRAINER_MLP_H_
