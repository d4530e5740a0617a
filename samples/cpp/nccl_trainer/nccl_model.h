// The NCCL trainer's model on one GPU: the flat buffers of FlatLayout in the trainer's own device
// memory and its forward/backward as CUDA kernels on its own stream (nccl_model.cu). Plain C++17 with
// no Abseil or Ferry types, so that nvcc compiles its implementation without them.
//
// Buffers (device memory, each 256-byte aligned, `layout.total()` elements unless said):
//   params       bf16 bits, the full model: every rank holds all of it; Ferry updates this rank's chunk
//                in place, and NCCL's in-place all-gather fills in the others
//   grad_terms   int64, this rank's fixed-point gradient sums (exact_math.h) at the tensors' offsets,
//                zero in the padding; NCCL's in-place reduce-scatter leaves the global sums of this
//                rank's chunk at chunk_begin(rank)
//   grad_shard   fp32, `layout.chunk` elements: this rank's chunk of the global gradient, what Ferry
//                reads as the grads of the rank's shards
// One thread at a time.
#ifndef FERRY_SAMPLES_NCCL_TRAINER_NCCL_MODEL_H_
#define FERRY_SAMPLES_NCCL_TRAINER_NCCL_MODEL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flat_layout.h"

namespace nccl_trainer {

class Model {
 public:
  // On the current CUDA device, for rank `rank` of layout.world, which trains on the global examples
  // [rank * b, (rank + 1) * b) of the batch, b = shape.batch / layout.world.
  // REQUIRES: layout.world divides shape.batch. nullptr with *error set on a CUDA failure.
  static std::unique_ptr<Model> Create(const Shape& shape, const FlatLayout& layout, int rank, std::string* error);
  virtual ~Model() = default;

  // Copies `flat` (layout.total() bf16 bits) into params and waits.
  virtual bool SetParams(const std::vector<uint16_t>& flat, std::string* error) = 0;
  // Enqueues this rank's examples (generated on the device from their global index, at every step as
  // a data loader would deliver them), forward, backward and the fixed-point gradient sums into
  // grad_terms. Does not wait.
  virtual bool ForwardBackward(std::string* error) = 0;
  // Enqueues grad_shard[k] = Dequantize(grad_terms[chunk_begin(rank) + k]). Does not wait.
  virtual bool DequantizeShard(std::string* error) = 0;
  // The sum of squared errors over this rank's examples of the last forward (waits for the stream).
  virtual bool ReadSquaredError(double* sum, std::string* error) = 0;
  // Every element of params (layout.total()), once the stream's work has finished (waits).
  virtual bool ReadParams(std::vector<uint16_t>* flat, std::string* error) = 0;

  virtual uint16_t* params() = 0;
  virtual int64_t* grad_terms() = 0;
  virtual float* grad_shard() = 0;
  virtual cudaStream_t stream() const = 0;
};

}  // namespace nccl_trainer

#endif  // FERRY_SAMPLES_NCCL_TRAINER_NCCL_MODEL_H_
