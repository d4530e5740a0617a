// The NCCL trainer's model on CUDA: one thread per output element in each kernel (exact_math.h), so
// every value depends only on its inputs and the run is deterministic; the gradients leave as
// fixed-point int64 sums, which NCCL adds exactly.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "exact_math.h"
#include "nccl_model.h"

namespace nccl_trainer {
namespace {

constexpr int kThreads = 256;

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// x [count, in] of global examples first..first+count-1.
__global__ void InputKernel(float* x, int64_t first, int64_t count, int64_t in) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count * in) return;
  x[t] = Input(first + t / in, t % in);
}

__global__ void TargetKernel(const float* x, float* y, int64_t count, int64_t in, int64_t out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count * out) return;
  const int64_t b = t / out;
  y[t] = Target(x + b * in, in, t % out);
}

// Thread t computes h[b, j] with b = t % count: a warp's threads share W1's row j.
__global__ void HiddenKernel(const uint16_t* w1, const uint16_t* b1, const float* x, float* h, int64_t count,
                             int64_t in, int64_t hidden) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count * hidden) return;
  const int64_t b = t % count, j = t / count;
  h[b * hidden + j] = Hidden(w1, b1, x, in, b, j);
}

// The unnormalized output error dout = out - y (the loss's 1/B is applied in Dequantize) and its square.
__global__ void OutputKernel(const uint16_t* w2, const uint16_t* b2, const float* h, const float* y, float* dout,
                             float* squared_error, int64_t count, int64_t hidden, int64_t out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count * out) return;
  const int64_t b = t % count, o = t / count;
  const float d = Output(w2, b2, h, hidden, b, o) - y[b * out + o];
  dout[b * out + o] = d;
  squared_error[b * out + o] = d * d;
}

__global__ void HiddenDeltaKernel(const float* dout, const uint16_t* w2, const float* h, float* dz, int64_t count,
                                  int64_t hidden, int64_t out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count * hidden) return;
  dz[t] = HiddenDelta(dout, w2, h, hidden, out, t / hidden, t % hidden);
}

// gw[r, c] for t < rows * cols, then gb[r] for the next `rows` threads, as fixed-point sums.
__global__ void LayerGradKernel(const float* dy, const float* a, int64_t* gw, int64_t* gb, int64_t count,
                                int64_t rows, int64_t cols) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < rows * cols) {
    gw[t] = WeightGradTerms(dy, a, count, rows, cols, t / cols, t % cols);
  } else if (t < rows * cols + rows) {
    gb[t - rows * cols] = BiasGradTerms(dy, count, rows, t - rows * cols);
  }
}

__global__ void DequantizeKernel(const int64_t* sums, float* grad, int64_t n, int64_t batch) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) grad[t] = Dequantize(sums[t], batch);
}

bool Check(cudaError_t e, const char* what, std::string* error) {
  if (e == cudaSuccess) return true;
  *error = std::string(what) + ": " + cudaGetErrorString(e);
  return false;
}

class CudaModel final : public Model {
 public:
  CudaModel(const Shape& shape, const FlatLayout& layout, int rank)
      : s_(shape), layout_(layout), rank_(rank), count_(shape.batch / layout.world) {}
  ~CudaModel() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (void* p : allocations_) cudaFree(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  bool Open(std::string* error) {
    if (!Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate", error)) return false;
    const int64_t B = count_, I = s_.in, H = s_.hidden, O = s_.out;
    if (!Alloc(&params_, layout_.total(), error) || !Alloc(&grad_terms_, layout_.total(), error) ||
        !Alloc(&grad_shard_, layout_.chunk, error) || !Alloc(&x_, B * I, error) || !Alloc(&y_, B * O, error) ||
        !Alloc(&h_, B * H, error) || !Alloc(&dz_, B * H, error) || !Alloc(&dout_, B * O, error) ||
        !Alloc(&squared_error_, B * O, error)) {
      return false;
    }
    // The padding between and after the tensors stays zero: the kernels write only tensor elements.
    return Check(cudaMemsetAsync(grad_terms_, 0, layout_.total() * sizeof(int64_t), stream_), "cudaMemset (grads)",
                 error) &&
           Check(cudaMemsetAsync(grad_shard_, 0, layout_.chunk * sizeof(float), stream_), "cudaMemset (grad shard)",
                 error) &&
           Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (open)", error);
  }

  bool SetParams(const std::vector<uint16_t>& flat, std::string* error) override {
    if (static_cast<int64_t>(flat.size()) != layout_.total()) {
      *error = "SetParams: " + std::to_string(flat.size()) + " elements, expected " + std::to_string(layout_.total());
      return false;
    }
    return Check(cudaMemcpyAsync(params_, flat.data(), flat.size() * sizeof(uint16_t), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync (params)", error) &&
           Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (params)", error);
  }

  bool ForwardBackward(std::string* error) override {
    const int64_t B = count_, I = s_.in, H = s_.hidden, O = s_.out;
    const uint16_t* w1 = params_ + layout_.tensors[0].offset;
    const uint16_t* b1 = params_ + layout_.tensors[1].offset;
    const uint16_t* w2 = params_ + layout_.tensors[2].offset;
    const uint16_t* b2 = params_ + layout_.tensors[3].offset;
    InputKernel<<<Blocks(B * I), kThreads, 0, stream_>>>(x_, rank_ * B, B, I);
    if (!Check(cudaGetLastError(), "InputKernel", error)) return false;
    TargetKernel<<<Blocks(B * O), kThreads, 0, stream_>>>(x_, y_, B, I, O);
    if (!Check(cudaGetLastError(), "TargetKernel", error)) return false;
    HiddenKernel<<<Blocks(B * H), kThreads, 0, stream_>>>(w1, b1, x_, h_, B, I, H);
    if (!Check(cudaGetLastError(), "HiddenKernel", error)) return false;
    OutputKernel<<<Blocks(B * O), kThreads, 0, stream_>>>(w2, b2, h_, y_, dout_, squared_error_, B, H, O);
    if (!Check(cudaGetLastError(), "OutputKernel", error)) return false;
    HiddenDeltaKernel<<<Blocks(B * H), kThreads, 0, stream_>>>(dout_, w2, h_, dz_, B, H, O);
    if (!Check(cudaGetLastError(), "HiddenDeltaKernel", error)) return false;
    LayerGradKernel<<<Blocks(O * H + O), kThreads, 0, stream_>>>(
        dout_, h_, grad_terms_ + layout_.tensors[2].offset, grad_terms_ + layout_.tensors[3].offset, B, O, H);
    if (!Check(cudaGetLastError(), "LayerGradKernel (fc2)", error)) return false;
    LayerGradKernel<<<Blocks(H * I + H), kThreads, 0, stream_>>>(
        dz_, x_, grad_terms_ + layout_.tensors[0].offset, grad_terms_ + layout_.tensors[1].offset, B, H, I);
    return Check(cudaGetLastError(), "LayerGradKernel (fc1)", error);
  }

  bool DequantizeShard(std::string* error) override {
    DequantizeKernel<<<Blocks(layout_.chunk), kThreads, 0, stream_>>>(
        grad_terms_ + layout_.chunk_begin(rank_), grad_shard_, layout_.chunk, s_.batch);
    return Check(cudaGetLastError(), "DequantizeKernel", error);
  }

  bool ReadSquaredError(double* sum, std::string* error) override {
    std::vector<float> se(static_cast<size_t>(count_ * s_.out));
    if (!Check(cudaMemcpyAsync(se.data(), squared_error_, se.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (loss)", error) ||
        !Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (loss)", error)) {
      return false;
    }
    *sum = 0.0;
    for (float v : se) *sum += v;
    return true;
  }

  bool ReadParams(std::vector<uint16_t>* flat, std::string* error) override {
    flat->resize(static_cast<size_t>(layout_.total()));
    return Check(cudaMemcpyAsync(flat->data(), params_, flat->size() * sizeof(uint16_t), cudaMemcpyDeviceToHost,
                                 stream_), "cudaMemcpyAsync (read params)", error) &&
           Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (read params)", error);
  }

  uint16_t* params() override { return params_; }
  int64_t* grad_terms() override { return grad_terms_; }
  float* grad_shard() override { return grad_shard_; }
  cudaStream_t stream() const override { return stream_; }

 private:
  template <typename T>
  bool Alloc(T** p, int64_t n, std::string* error) {
    void* raw = nullptr;
    if (!Check(cudaMalloc(&raw, static_cast<size_t>(n > 0 ? n : 1) * sizeof(T)), "cudaMalloc", error)) return false;
    allocations_.push_back(raw);
    *p = static_cast<T*>(raw);
    return true;
  }

  const Shape s_;
  const FlatLayout layout_;
  const int rank_;
  const int64_t count_;  // this rank's examples
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
  uint16_t* params_ = nullptr;
  int64_t* grad_terms_ = nullptr;
  float* grad_shard_ = nullptr;
  float *x_ = nullptr, *y_ = nullptr, *h_ = nullptr, *dz_ = nullptr, *dout_ = nullptr, *squared_error_ = nullptr;
};

}  // namespace

std::unique_ptr<Model> Model::Create(const Shape& shape, const FlatLayout& layout, int rank, std::string* error) {
  auto model = std::make_unique<CudaModel>(shape, layout, rank);
  if (!model->Open(error)) return nullptr;
  return model;
}

}  // namespace nccl_trainer
