// A data-parallel C++ trainer with one GPU per rank, its collectives on NCCL and its optimizer sharded
// and offloaded by Ferry (ZeRO-1 style):
//
//   mpirun --bind-to none -np 4 build/ferry_nccl_trainer --check    (as root: --allow-run-as-root)
//   mpirun --bind-to none -np 4 build/ferry_nccl_trainer --bench
//
// Each rank runs on its own GPU (the device ordinal is the local rank, from OMPI_COMM_WORLD_LOCAL_RANK,
// MPI_LOCALRANKID or SLURM_LOCALID, else rank % device count) and keeps the whole model, a 2-layer MLP
// with bf16 params in one flat buffer (flat_layout.h), with its own CUDA forward/backward
// (nccl_model.cu). A step:
//   1. forward/backward of this rank's slice of the global batch: fixed-point int64 gradient sums;
//   2. NCCL reduce-scatter (ncclInt64, in place) of those sums: each rank gets its chunk of the global
//      gradient, turned into fp32 grads (the 1/B of the mean applied there);
//   3. Ferry steps this rank's chunk only: every tensor is registered with the part of it that lies in
//      the chunk (ParamSpec::shard_begin/shard_end, possibly empty), its fp32 master and Adam moments in
//      pinned host memory (policy offload_all), and the new bf16 params written in place into the
//      chunk of the full param buffer; Ferry's own small collectives (the gradient norm, Finalize's
//      checks) go over MPI (ferry::MakeMpiComm);
//   4. NCCL all-gather (in place) of the updated chunks into every rank's full params.
//
// Bit-identical on 1, 2 and 4 ranks (--check). The data is a function of each example's global index,
// so a rank's slice holds the same rows as the 1-rank batch; the forward of an example uses the full
// params (the same on every rank) and one thread per output with a fixed summation order. The only
// sum across ranks is the gradient's, and NCCL adds the ranks' partial sums in an order that changes
// with the world size, so in fp32 the bits would change with it. Here every per-example gradient term
// is rounded once to a 2^-40 fixed-point int64 and all the adding after that is integer (a rank's
// examples, then ncclSum over ncclInt64): associative, so the same integers whatever the split or the
// order (exact_math.h gives the bounds that rule out overflow). Ferry's update is elementwise and its
// gradient norm is an exact, order-independent sum, so the shards step as the whole would. --check
// trains K steps on the N ranks, then each rank trains the same global batch alone (a world of 1, on
// its own GPU) and compares every byte of the full params; the ranks agree on the verdict. The printed
// fingerprint lets separate runs (-np 1, 2, 4) be compared too.
//
// --bench prints each phase's median time per step and the all-gather's bus bandwidth beside that of a
// plain ncclAllGather loop on a buffer of the same size measured in the same run (target: >= 80%).
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "exact_math.h"
#include "ferry/comm.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "flat_layout.h"
#include "nccl_model.h"
#include "nccl_trainer_bench.h"

namespace nccl_trainer {
namespace {

constexpr absl::Duration kTimeout = absl::Minutes(5);

struct Options {
  Shape shape;
  int64_t steps = 20;
  bool check = false;
  bool bench = false;
  size_t cpu_threads = 0;  // 0: Ferry's choice, this rank's share of its host
  std::string policy_dir = std::string(FERRY_SOURCE_DIR) + "/scripts/policies";
};

struct Rank {
  int rank = 0;
  int world = 1;
  int ordinal = 0;  // CUDA device
};

absl::Status Usage(const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(
      why, "\nusage: ferry_nccl_trainer [--check] [--bench] [--steps K] [--in I] [--hidden H] [--out O] "
           "[--batch B] [--cpu-threads T] [--policy-dir DIR]\n  --batch is the global batch: a multiple of "
           "the world size, at most ", kMaxBatch, "; --bench defaults to --in 4096 --hidden 8192 --out 1024"));
}

absl::StatusOr<Options> ParseArgs(int argc, char** argv) {
  Options o;
  std::vector<std::string> args(argv + 1, argv + argc);
  o.bench = std::find(args.begin(), args.end(), "--bench") != args.end();
  if (o.bench) o.shape = {.in = 4096, .hidden = 8192, .out = 1024, .batch = 64};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--check") { o.check = true; continue; }
    if (a == "--bench") continue;
    if (i + 1 >= args.size()) return Usage(absl::StrCat("unknown flag or missing value: ", a));
    const std::string& v = args[++i];
    if (a == "--policy-dir") { o.policy_dir = v; continue; }
    int64_t n = 0;
    if (!absl::SimpleAtoi(v, &n) || n <= 0) return Usage(absl::StrCat(a, " needs a positive integer, got '", v, "'"));
    if (a == "--steps") o.steps = n;
    else if (a == "--in") o.shape.in = n;
    else if (a == "--hidden") o.shape.hidden = n;
    else if (a == "--out") o.shape.out = n;
    else if (a == "--batch") o.shape.batch = n;
    else if (a == "--cpu-threads") o.cpu_threads = static_cast<size_t>(n);
    else return Usage(absl::StrCat("unknown flag: ", a));
  }
  if (o.shape.batch > kMaxBatch) return Usage(absl::StrCat("--batch ", o.shape.batch, " is over ", kMaxBatch));
  return o;
}

int EnvInt(std::initializer_list<const char*> names, int fallback) {
  for (const char* name : names) {
    int v = 0;
    const char* s = std::getenv(name);
    if (s != nullptr && absl::SimpleAtoi(s, &v) && v >= 0) return v;
  }
  return fallback;
}

absl::Status CudaStatus(cudaError_t e, const char* what, const Rank& r) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("rank ", r.rank, " (GPU ", r.ordinal, "): ", what, ": ", cudaGetErrorString(e)));
}

absl::Status NcclStatus(ncclResult_t e, const char* what, const Rank& r) {
  if (e == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("rank ", r.rank, " (GPU ", r.ordinal, "): ", what, ": ", ncclGetErrorString(e)));
}

absl::Status ModelStatus(bool ok, const std::string& error, const Rank& r) {
  if (ok) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("rank ", r.rank, " (GPU ", r.ordinal, "): ", error));
}

constexpr const char* kStateKinds[3] = {"master", "exp_avg", "exp_avg_sq"};

struct TrainResult {
  std::vector<uint16_t> tensors;  // every tensor's final bf16 bits, in order (TensorElements)
  // --check: Ferry's fp32 state of this rank's shards, [tensor][kind of kStateKinds] over the
  // elements ranges[tensor] = ShardOf(tensor, rank). bf16 params alone could hide a last-bit
  // difference of the grads; the masters and moments would not.
  std::vector<std::vector<std::vector<float>>> state;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  double first_loss = 0, last_loss = 0;
  std::vector<PhaseTimes> times;  // per step (--bench)
};

// K steps on `r.world` ranks: `comm` is Ferry's (null: one rank alone), `nccl` the trainer's.
absl::StatusOr<TrainResult> Train(const Options& o, const Rank& r, const std::shared_ptr<ferry::Comm>& comm,
                                  ncclComm_t nccl, bool verbose) {
  const FlatLayout layout = MakeLayout(o.shape, r.world);
  std::string error;
  std::unique_ptr<Model> model = Model::Create(o.shape, layout, r.rank, &error);
  FERRY_RETURN_IF_ERROR(ModelStatus(model != nullptr, error, r));
  FERRY_RETURN_IF_ERROR(ModelStatus(model->SetParams(InitialParams(layout), &error), error, r));
  cudaStream_t stream = model->stream();

  ferry::EngineOptions options;
  options.policy_path = o.policy_dir + "/offload_all.lua";
  options.optimizer.lr = 2e-3f;
  options.optimizer.weight_decay = 0.01f;
  options.device = "cuda";
  options.device_ordinal = r.ordinal;
  options.rank = r.rank;
  options.world_size = r.world;
  options.comm = comm;
  // 0: this rank's share of the host's CPUs, which Ferry works out from the launcher's local rank.
  options.cpu_threads = o.cpu_threads;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::Engine> engine, ferry::Engine::Create(options));
  const int64_t chunk_begin = layout.chunk_begin(r.rank);
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const TensorSlot& s = layout.tensors[t];
    const auto [begin, end] = layout.ShardOf(t, r.rank);
    const bool empty = begin == end;
    // The shard's elements sit at s.offset + begin of the full params, and at that minus the chunk's
    // start in this rank's grad chunk.
    FERRY_RETURN_IF_ERROR(engine->AddParam(
        {.name = s.name, .group = s.group, .shape = s.shape, .dtype = ferry::DType::kBF16,
         .param = empty ? nullptr : model->params() + s.offset + begin,
         .grad = empty ? nullptr : model->grad_shard() + (s.offset + begin - chunk_begin),
         .grad_dtype = ferry::DType::kF32, .shard_begin = begin, .shard_end = end}));
  }
  FERRY_RETURN_IF_ERROR(engine->Finalize());  // collective: the ranks' ranges must tile every tensor
  if (verbose) {
    const ferry::EngineStats stats = engine->Stats();
    std::printf("rank 0: Ferry's CPU Adam on %zu workers (%s)\n", stats.cpu_threads, stats.host_share.c_str());
  }

  TrainResult result;
  StepEvents events;
  if (o.bench) FERRY_RETURN_IF_ERROR(CudaStatus(events.Create(), "cudaEventCreate", r));
  for (int64_t step = 1; step <= o.steps; ++step) {
    const auto wall_start = std::chrono::steady_clock::now();
    if (o.bench) FERRY_RETURN_IF_ERROR(CudaStatus(events.Record(0, stream), "cudaEventRecord", r));
    FERRY_RETURN_IF_ERROR(ModelStatus(model->ForwardBackward(&error), error, r));
    if (o.bench) FERRY_RETURN_IF_ERROR(CudaStatus(events.Record(1, stream), "cudaEventRecord", r));
    FERRY_RETURN_IF_ERROR(NcclStatus(ncclReduceScatter(model->grad_terms(), model->grad_terms() + chunk_begin,
                                                       static_cast<size_t>(layout.chunk), ncclInt64, ncclSum, nccl,
                                                       stream), "ncclReduceScatter (grads)", r));
    FERRY_RETURN_IF_ERROR(ModelStatus(model->DequantizeShard(&error), error, r));
    if (o.bench) FERRY_RETURN_IF_ERROR(CudaStatus(events.Record(2, stream), "cudaEventRecord", r));
    const float lr = 2e-3f * (1.0f - 0.5f * static_cast<float>(step - 1) / static_cast<float>(o.steps));
    FERRY_RETURN_IF_ERROR(engine->Step({.lr = lr, .max_grad_norm = 1.0f}, stream));  // this rank's chunk
    if (o.bench) FERRY_RETURN_IF_ERROR(CudaStatus(events.Record(3, stream), "cudaEventRecord", r));
    // bf16 params: ncclBfloat16 (an all-gather only moves bytes; any 2-byte type would do).
    FERRY_RETURN_IF_ERROR(NcclStatus(ncclAllGather(model->params() + chunk_begin, model->params(),
                                                   static_cast<size_t>(layout.chunk), ncclBfloat16, nccl, stream),
                                     "ncclAllGather (params)", r));
    if (o.bench) {
      FERRY_RETURN_IF_ERROR(CudaStatus(events.Record(4, stream), "cudaEventRecord", r));
      PhaseTimes t;
      FERRY_RETURN_IF_ERROR(CudaStatus(events.Read(&t), "cudaEventElapsedTime", r));
      t.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall_start).count();
      result.times.push_back(t);
    }
    if (step == 1 || step == o.steps || step % 10 == 0) {
      std::vector<double> se(1);
      FERRY_RETURN_IF_ERROR(ModelStatus(model->ReadSquaredError(&se[0], &error), error, r));
      if (comm != nullptr) FERRY_RETURN_IF_ERROR(comm->AllReduce(absl::MakeSpan(se), ferry::ReduceOp::kSum, kTimeout));
      const double loss = se[0] / (2.0 * static_cast<double>(o.shape.batch));
      if (step == 1) result.first_loss = loss;
      result.last_loss = loss;
      if (verbose) std::printf("step %3lld  loss %.6f\n", static_cast<long long>(step), loss);
    }
  }
  std::vector<uint16_t> flat;
  FERRY_RETURN_IF_ERROR(ModelStatus(model->ReadParams(&flat, &error), error, r));
  result.tensors = TensorElements(layout, flat);
  FERRY_RETURN_IF_ERROR(engine->Synchronize());
  if (o.check) {
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      const auto [begin, end] = layout.ShardOf(t, r.rank);
      result.ranges.emplace_back(begin, end);
      result.state.emplace_back();
      for (const char* kind : kStateKinds) {
        std::vector<float> values(static_cast<size_t>(end - begin));
        if (!values.empty()) FERRY_RETURN_IF_ERROR(engine->ReadState(layout.tensors[t].name, kind, values.data()));
        result.state.back().push_back(std::move(values));
      }
    }
  }
  return result;
}

// Whether a run on several ranks left this rank with the bits of a 1-rank run: the full params, and
// Ferry's state of the rank's shards against the same elements of the 1-rank state.
absl::Status CompareWithOneRank(const TrainResult& run, const TrainResult& alone, const FlatLayout& layout, int rank,
                                int64_t steps) {
  const std::string prefix = absl::StrCat("rank ", rank, ": after ", steps, " steps, ");
  if (alone.tensors.size() != run.tensors.size()) return absl::InternalError(prefix + "the runs' sizes differ");
  for (size_t k = 0; k < run.tensors.size(); ++k) {
    if (run.tensors[k] != alone.tensors[k]) {
      return absl::InternalError(absl::StrCat(prefix, "the full params differ from a 1-rank run of the same global "
                                              "batch, first at element ", k, " of ", run.tensors.size(), " (bf16 bits ",
                                              run.tensors[k], " vs ", alone.tensors[k], ")"));
    }
  }
  for (size_t t = 0; t < run.state.size(); ++t) {
    const auto [begin, end] = run.ranges[t];
    for (size_t kind = 0; kind < 3; ++kind) {
      const std::vector<float>& mine = run.state[t][kind];
      const std::vector<float>& whole = alone.state[t][kind];
      for (int64_t k = 0; k < end - begin; ++k) {
        if (std::memcmp(&mine[k], &whole[begin + k], sizeof(float)) != 0) {
          return absl::InternalError(absl::StrCat(prefix, "Ferry's ", kStateKinds[kind], " of '",
                                                  layout.tensors[t].name, "' element ", begin + k, " is ", mine[k],
                                                  " here and ", whole[begin + k], " on 1 rank"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Run(const Options& o) {
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::Comm> mpi, ferry::MakeMpiComm());
  std::shared_ptr<ferry::Comm> comm = std::move(mpi);
  Rank r{.rank = comm->rank(), .world = comm->world_size()};
  if (o.shape.batch % r.world != 0) {
    return Usage(absl::StrCat("--batch ", o.shape.batch, " is not a multiple of the world size ", r.world));
  }

  // Each rank on its own GPU, and NCCL's id from rank 0 over Ferry's comm. Every rank learns of any
  // rank's failure here (AgreeStatus), rather than waiting in NCCL's init for a rank that is gone.
  ncclComm_t nccl = nullptr;
  absl::Status setup = [&]() -> absl::Status {
    int devices = 0;
    FERRY_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceCount(&devices), "cudaGetDeviceCount", r));
    if (devices < 1) return absl::UnavailableError(absl::StrCat("rank ", r.rank, ": no CUDA device"));
    r.ordinal = EnvInt({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}, r.rank) % devices;
    return CudaStatus(cudaSetDevice(r.ordinal), "cudaSetDevice", r);
  }();
  FERRY_RETURN_IF_ERROR(ferry::AgreeStatus(*comm, setup, "choosing each rank's GPU", kTimeout));
  std::string id_blob(sizeof(ncclUniqueId), '\0');
  if (r.rank == 0) {
    ncclUniqueId id;
    setup = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId", r);
    std::memcpy(id_blob.data(), &id, sizeof id);
  }
  FERRY_RETURN_IF_ERROR(ferry::AgreeStatus(*comm, setup, "creating NCCL's id", kTimeout));
  FERRY_RETURN_IF_ERROR(comm->Broadcast(&id_blob, 0, kTimeout));
  ncclUniqueId id;
  std::memcpy(&id, id_blob.data(), sizeof id);
  FERRY_RETURN_IF_ERROR(NcclStatus(ncclCommInitRank(&nccl, r.world, id, r.rank), "ncclCommInitRank", r));
  struct NcclCloser {  // a destructor has no one to tell of a failure
    ncclComm_t c;
    ~NcclCloser() { ncclCommDestroy(c); }
  } closer{nccl};

  char bus[32];
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, r.ordinal) != cudaSuccess) std::snprintf(bus, sizeof bus, "bus id unknown");
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> where,
                         comm->AllGather(absl::StrCat("rank ", r.rank, ": GPU ", r.ordinal, " (", bus, ")"), kTimeout));
  const FlatLayout layout = MakeLayout(o.shape, r.world);
  if (r.rank == 0) {
    std::printf("%d ranks (%s); %lld params in bf16, a chunk of %lld per rank; global batch %lld; %lld steps\n",
                r.world, absl::StrJoin(where, ", ").c_str(), static_cast<long long>(layout.used),
                static_cast<long long>(layout.chunk), static_cast<long long>(o.shape.batch),
                static_cast<long long>(o.steps));
  }

  absl::StatusOr<TrainResult> run = Train(o, r, comm, nccl, r.rank == 0);
  FERRY_RETURN_IF_ERROR(ferry::AgreeStatus(*comm, run.status(), "training", kTimeout));
  const uint64_t print = Fingerprint(run->tensors.data(), run->tensors.size() * sizeof(uint16_t));
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> prints, comm->AllGather(absl::StrCat(print), kTimeout));
  for (int k = 0; k < r.world; ++k) {
    if (prints[k] != prints[0]) {
      return absl::InternalError(absl::StrCat("the full params differ between rank 0 and rank ", k, " after ", o.steps,
                                              " steps (fingerprints ", prints[0], " and ", prints[k], ")"));
    }
  }
  if (r.rank == 0) {
    std::printf("params fingerprint %016llx after %lld steps on %d ranks (loss %.6f -> %.6f)\n",
                static_cast<unsigned long long>(print), static_cast<long long>(o.steps), r.world, run->first_loss,
                run->last_loss);
  }
  if (o.bench) FERRY_RETURN_IF_ERROR(ReportBench(*comm, r.rank, r.world, layout, nccl, run->times));

  if (o.check) {
    // The same global batch on one rank: a world of 1 on this rank's GPU, its own NCCL comm and engine.
    absl::StatusOr<TrainResult> alone = [&]() -> absl::StatusOr<TrainResult> {
      ncclComm_t solo = nullptr;
      FERRY_RETURN_IF_ERROR(NcclStatus(ncclCommInitAll(&solo, 1, &r.ordinal), "ncclCommInitAll (1 rank)", r));
      NcclCloser solo_closer{solo};
      Rank one = r;
      one.rank = 0;
      one.world = 1;
      return Train(o, one, nullptr, solo, false);
    }();
    absl::Status same = alone.ok() ? CompareWithOneRank(*run, *alone, layout, r.rank, o.steps) : alone.status();
    FERRY_RETURN_IF_ERROR(ferry::AgreeStatus(*comm, same, "--check", kTimeout));
    if (!(run->last_loss < run->first_loss)) {
      return absl::InternalError(absl::StrCat("--check: the loss did not fall (", run->first_loss, " -> ",
                                              run->last_loss, ")"));
    }
    if (r.rank == 0) {
      std::printf("--check: every rank's full params after %lld steps on %d ranks are bit-identical to a 1-rank run "
                  "of the same global batch (%zu bf16 values), and so is Ferry's fp32 state of each shard\n", static_cast<long long>(o.steps), r.world,
                  run->tensors.size());
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace nccl_trainer

int main(int argc, char** argv) {
  absl::StatusOr<nccl_trainer::Options> options = nccl_trainer::ParseArgs(argc, argv);
  absl::Status s = options.ok() ? nccl_trainer::Run(*options) : options.status();
  if (!s.ok()) {
    std::fprintf(stderr, "nccl_trainer: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
