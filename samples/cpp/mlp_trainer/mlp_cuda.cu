// The MLP on the CUDA backend: the trainer's own device memory (cudaMalloc) and stream, one thread per
// output element in each kernel (mlp_math.h), so every sum has a fixed order and the run is
// deterministic. Ferry's Step is ordered on the same stream, between one backward and the next
// forward; Forward and Backward only enqueue (a trainer's GradsReady and WaitParams go between their
// kernels, on the same stream), and only ReadLoss and ReadParams wait for the stream.
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mlp.h"
#include "mlp_math.h"
#include "mlp_random.h"

namespace mlp {
namespace {

constexpr int kThreads = 128;

int Blocks(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

__global__ void HiddenKernel(const uint16_t* w1, const uint16_t* b1, const float* x, float* h, int64_t batch,
                             int64_t in, int64_t hidden) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * hidden) return;
  h[t] = Hidden(w1, b1, x, in, t / hidden, t % hidden);
}

__global__ void OutputKernel(const uint16_t* w2, const uint16_t* b2, const float* h, const float* y, float* dout,
                             float* squared_error, int64_t batch, int64_t hidden, int64_t out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * out) return;
  const float o = Output(w2, b2, h, hidden, t / out, t % out);
  dout[t] = OutputGrad(o, y[t], batch, &squared_error[t]);
}

// gW[r, c] for t < rows * cols, then gb[r] for the next `rows` threads.
__global__ void LayerGradKernel(const float* dy, const float* a, float* gw, float* gb, int64_t batch, int64_t rows,
                                int64_t cols) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < rows * cols) {
    gw[t] = WeightGrad(dy, a, batch, rows, cols, t / cols, t % cols);
  } else if (t < rows * cols + rows) {
    gb[t - rows * cols] = BiasGrad(dy, batch, rows, t - rows * cols);
  }
}

__global__ void HiddenGradKernel(const float* dout, const uint16_t* w2, const float* h, float* dh, int64_t batch,
                                 int64_t hidden, int64_t out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= batch * hidden) return;
  dh[t] = HiddenGrad(dout, w2, h, hidden, out, t / hidden, t % hidden);
}

bool Check(cudaError_t e, const char* what, std::string* error) {
  if (e == cudaSuccess) return true;
  *error = std::string(what) + ": " + cudaGetErrorString(e);
  return false;
}

class CudaModel final : public Model {
 public:
  explicit CudaModel(const Shape& s) : s_(s) {}
  ~CudaModel() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (void* p : allocations_) cudaFree(p);
    for (int i = 0; i < 2; ++i) {
      if (x_host_[i] != nullptr) cudaFreeHost(x_host_[i]);
      if (y_host_[i] != nullptr) cudaFreeHost(y_host_[i]);
      if (staged_[i] != nullptr) cudaEventDestroy(staged_[i]);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // The params live in one allocation and the grads in another, each tensor at a 256-byte aligned
  // offset, as trainers that keep flat parameter buffers (llm.c, FSDP) do.
  bool Open(std::string* error) {
    if (!Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate", error)) return false;
    const int64_t sizes[4] = {s_.hidden * s_.in, s_.hidden, s_.out * s_.hidden, s_.out};
    uint16_t** params[4] = {&w1_, &b1_, &w2_, &b2_};
    float** grads[4] = {&gw1_, &gb1_, &gw2_, &gb2_};
    uint16_t* param_slab = nullptr;
    float* grad_slab = nullptr;
    if (!Alloc(&param_slab, Carve(sizes, sizeof(uint16_t), nullptr), error) ||
        !Alloc(&grad_slab, Carve(sizes, sizeof(float), nullptr), error)) {
      return false;
    }
    int64_t param_offsets[4], grad_offsets[4];
    Carve(sizes, sizeof(uint16_t), param_offsets);
    Carve(sizes, sizeof(float), grad_offsets);
    for (int i = 0; i < 4; ++i) {
      *params[i] = param_slab + param_offsets[i];
      *grads[i] = grad_slab + grad_offsets[i];
    }
    for (int i = 0; i < 2; ++i) {
      if (!Check(cudaMallocHost(reinterpret_cast<void**>(&x_host_[i]), s_.batch * s_.in * sizeof(float)),
                 "cudaMallocHost (x staging)", error) ||
          !Check(cudaMallocHost(reinterpret_cast<void**>(&y_host_[i]), s_.batch * s_.out * sizeof(float)),
                 "cudaMallocHost (y staging)", error) ||
          !Check(cudaEventCreateWithFlags(&staged_[i], cudaEventDisableTiming), "cudaEventCreate", error)) {
        return false;
      }
    }
    return Alloc(&x_, s_.batch * s_.in, error) && Alloc(&y_, s_.batch * s_.out, error) &&
           Alloc(&h_, s_.batch * s_.hidden, error) && Alloc(&dh_, s_.batch * s_.hidden, error) &&
           Alloc(&dout_, s_.batch * s_.out, error) && Alloc(&squared_error_, s_.batch * s_.out, error);
  }

  std::vector<Tensor> Tensors() override {
    return {{"fc1.weight", "fc1", {s_.hidden, s_.in}, w1_, gw1_},
            {"fc1.bias", "fc1", {s_.hidden}, b1_, gb1_},
            {"fc2.weight", "fc2", {s_.out, s_.hidden}, w2_, gw2_},
            {"fc2.bias", "fc2", {s_.out}, b2_, gb2_}};
  }

  bool Init(uint64_t seed, std::string* error) override {
    const std::vector<uint16_t> bits = InitialParams(s_, seed);
    const uint16_t* at = bits.data();
    for (const Tensor& t : Tensors()) {
      const size_t n = Numel(t);
      if (!Check(cudaMemcpyAsync(t.param, at, n * sizeof(uint16_t), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync (init)", error)) {
        return false;
      }
      at += n;
    }
    return Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (init)", error);
  }

  bool Forward(const float* x, const float* y, const LayerHook& before_layer, std::string* error) override {
    const int64_t B = s_.batch, I = s_.in, H = s_.hidden, O = s_.out;
    // The batch goes through pinned staging (a pageable source could make the copy wait for the
    // stream). Two slots: a slot is rewritten once the copy that read it, two batches ago, has run,
    // so the host does not wait for the batch in flight.
    const int slot = next_slot_;
    next_slot_ = 1 - next_slot_;
    if (!Check(cudaEventSynchronize(staged_[slot]), "cudaEventSynchronize (staging)", error)) return false;
    std::memcpy(x_host_[slot], x, static_cast<size_t>(B * I) * sizeof(float));
    std::memcpy(y_host_[slot], y, static_cast<size_t>(B * O) * sizeof(float));
    if (!Check(cudaMemcpyAsync(x_, x_host_[slot], B * I * sizeof(float), cudaMemcpyHostToDevice, stream_), "copy x",
               error) ||
        !Check(cudaMemcpyAsync(y_, y_host_[slot], B * O * sizeof(float), cudaMemcpyHostToDevice, stream_), "copy y",
               error) ||
        !Check(cudaEventRecord(staged_[slot], stream_), "cudaEventRecord (staging)", error)) {
      return false;
    }
    if (before_layer && !before_layer("fc1", error)) return false;
    HiddenKernel<<<Blocks(B * H), kThreads, 0, stream_>>>(w1_, b1_, x_, h_, B, I, H);
    if (!Check(cudaGetLastError(), "HiddenKernel", error)) return false;
    if (before_layer && !before_layer("fc2", error)) return false;
    OutputKernel<<<Blocks(B * O), kThreads, 0, stream_>>>(w2_, b2_, h_, y_, dout_, squared_error_, B, H, O);
    return Check(cudaGetLastError(), "OutputKernel", error);
  }

  bool Backward(const LayerHook& after_layer, std::string* error) override {
    const int64_t B = s_.batch, I = s_.in, H = s_.hidden, O = s_.out;
    LayerGradKernel<<<Blocks(O * H + O), kThreads, 0, stream_>>>(dout_, h_, gw2_, gb2_, B, O, H);
    if (!Check(cudaGetLastError(), "LayerGradKernel (fc2)", error)) return false;
    HiddenGradKernel<<<Blocks(B * H), kThreads, 0, stream_>>>(dout_, w2_, h_, dh_, B, H, O);
    if (!Check(cudaGetLastError(), "HiddenGradKernel", error)) return false;
    if (after_layer && !after_layer("fc2", error)) return false;
    LayerGradKernel<<<Blocks(H * I + H), kThreads, 0, stream_>>>(dh_, x_, gw1_, gb1_, B, H, I);
    if (!Check(cudaGetLastError(), "LayerGradKernel (fc1)", error)) return false;
    return !after_layer || after_layer("fc1", error);
  }

  bool ReadLoss(double* loss, std::string* error) override {
    const int64_t B = s_.batch, O = s_.out;
    std::vector<float> se(B * O);
    if (!Check(cudaMemcpyAsync(se.data(), squared_error_, se.size() * sizeof(float), cudaMemcpyDeviceToHost,
                               stream_), "copy loss", error) ||
        !Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (loss)", error)) {
      return false;
    }
    double sum = 0.0;
    for (float v : se) sum += v;
    *loss = sum / (2.0 * static_cast<double>(B));
    return true;
  }

  bool ReadParams(std::vector<uint16_t>* bits, std::string* error) override {
    bits->clear();
    for (const Tensor& t : Tensors()) {
      const size_t at = bits->size();
      bits->resize(at + Numel(t));
      if (!Check(cudaMemcpyAsync(bits->data() + at, t.param, Numel(t) * sizeof(uint16_t), cudaMemcpyDeviceToHost,
                                 stream_), "copy params", error)) {
        return false;
      }
    }
    return Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (params)", error);
  }

  void* stream() const override { return stream_; }

 private:
  static size_t Numel(const Tensor& t) {
    size_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<size_t>(d);
    return n;
  }
  // Element offsets of four tensors of `sizes` elements of `element_bytes` each in one buffer, each
  // starting 256-byte aligned (written to offsets when not null); returns the buffer's elements.
  static int64_t Carve(const int64_t (&sizes)[4], size_t element_bytes, int64_t* offsets) {
    const int64_t align = 256 / static_cast<int64_t>(element_bytes);
    int64_t at = 0;
    for (int i = 0; i < 4; ++i) {
      if (offsets != nullptr) offsets[i] = at;
      at += (sizes[i] + align - 1) / align * align;
    }
    return at;
  }
  template <typename T>
  bool Alloc(T** p, int64_t n, std::string* error) {
    void* raw = nullptr;
    if (!Check(cudaMalloc(&raw, static_cast<size_t>(n) * sizeof(T)), "cudaMalloc", error)) return false;
    allocations_.push_back(raw);
    *p = static_cast<T*>(raw);
    return true;
  }

  const Shape s_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
  uint16_t *w1_ = nullptr, *b1_ = nullptr, *w2_ = nullptr, *b2_ = nullptr;
  float *gw1_ = nullptr, *gb1_ = nullptr, *gw2_ = nullptr, *gb2_ = nullptr;
  float *x_ = nullptr, *y_ = nullptr, *h_ = nullptr, *dh_ = nullptr, *dout_ = nullptr, *squared_error_ = nullptr;
  // Pinned staging of the batch, two slots, and the event after each slot's copy.
  float* x_host_[2] = {nullptr, nullptr};
  float* y_host_[2] = {nullptr, nullptr};
  cudaEvent_t staged_[2] = {nullptr, nullptr};
  int next_slot_ = 0;
};

}  // namespace

std::unique_ptr<Model> MakeCudaModel(const Shape& shape, std::string* error) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    *error = "no CUDA device";
    return nullptr;
  }
  auto model = std::make_unique<CudaModel>(shape);
  if (!model->Open(error)) return nullptr;
  return model;
}

}  // namespace mlp
