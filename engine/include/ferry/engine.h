// Ferry's engine: the facade a trainer embeds.
//
// A trainer keeps its model, forward/backward and collectives. Ferry owns, per parameter group, where
// the fp32 master weights and Adam moments live (GPU memory or pinned host memory, as the Lua policy's
// place() hook decides), the copies between GPU and host, the Adam/AdamW update, and checkpoints.
//
//   ferry::EngineOptions options;
//   options.policy_path = "scripts/policies/offload_fraction.lua";
//   options.policy_args = {{"fraction", "0.5"}};
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::Engine> engine, ferry::Engine::Create(options));
//   for (auto& t : tensors)
//     FERRY_RETURN_IF_ERROR(engine->AddParam({.name = t.name, .group = t.group, .shape = t.shape,
//                                             .dtype = ferry::DType::kBF16, .param = t.data,
//                                             .grad = t.grad}));
//   FERRY_RETURN_IF_ERROR(engine->Finalize());
//   for (...) { forward_backward(stream); FERRY_RETURN_IF_ERROR(engine->Step({.lr = lr}, stream)); }
#ifndef FERRY_ENGINE_H_
#define FERRY_ENGINE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ferry/comm.h"
#include "ferry/dtype.h"

namespace ferry {

// One parameter tensor the trainer owns, or this rank's shard of it. Pointers are device memory
// (cudaMalloc'd on the CUDA backend, host memory on the host backend) and must stay valid for the
// engine's lifetime.
//
// Local shards (several ranks, as FSDP/DTensor local shards and Megatron's distributed-optimizer
// ranges): `shape` is the global tensor's shape and this rank holds elements [shard_begin,
// shard_end) of the flattened global tensor; `param` and `grad` point to those elements only (they
// may be null when the range is empty). Across the ranks the ranges of a param tile the global
// tensor exactly (Finalize checks). The engine keeps masters and moments for the local range only.
struct ParamSpec {
  std::string name;                 // unique; must not contain ':' (used in checkpoint tensor names)
  std::string group;                // parameter group: the unit of placement; empty = the name
  std::vector<int64_t> shape;       // the global shape; every dimension > 0
  DType dtype = DType::kBF16;       // dtype of `param` (and of `grad` unless grad_dtype is set)
  void* param = nullptr;            // the local elements of `dtype`, updated in place by Step
  void* grad = nullptr;             // the local elements of `grad_dtype`, read by Step
  std::optional<DType> grad_dtype;  // defaults to `dtype`
  std::vector<std::string> tags;    // passed to the policy
  int64_t shard_begin = 0;          // this rank's first element of the flattened global tensor
  int64_t shard_end = -1;           // one past its last; -1: the end of the tensor (the whole of it)
};

// The optimizer's hyper-parameters: every group's defaults (see GroupOptions for a group's own).
struct OptimizerOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw = true;            // decoupled weight decay; false = Adam with L2
  bool bias_correction = true;
};

// One parameter group's own optimizer settings, as torch's param groups give them (no weight decay on
// biases and norms, a learning-rate scale per group, other betas). A field left unset takes the value
// of EngineOptions::optimizer. The step's learning rate (StepOptions::lr, else OptimizerOptions::lr)
// stays the global schedule: a group steps with it times lr_scale (rounded once to float; a scale of
// 1 gives exactly the global rate). For a torch-style fixed group lr, give lr_scale = lr / global lr.
struct GroupOptions {
  std::optional<float> lr_scale;      // >= 0 and finite (0 freezes the group's values; moments still update)
  std::optional<float> weight_decay;  // >= 0 and finite
  std::optional<float> beta1;         // in [0, 1)
  std::optional<float> beta2;         // in [0, 1)
  std::optional<float> eps;           // > 0 and finite
  std::optional<bool> adamw;          // decoupled weight decay; false = Adam with L2
};

// The option names SetGroupOption knows, in order: "lr_scale", "weight_decay", "beta1", "beta2",
// "eps", "adamw".
std::vector<std::string_view> GroupOptionNames();

// Sets the option called `name` (one of GroupOptionNames(); "adamw" takes 0 or 1) of `options` to
// `value`, for bindings that pass options by name (the C ABI, the Lua module). On error
// (InvalidArgument: an unknown name, listing the known ones, or a value out of the option's range)
// `options` is unchanged.
absl::Status SetGroupOption(GroupOptions& options, std::string_view name, double value);

// The offload pipeline's chunk for a process that has its host to itself: 8 MiB measured best on an
// H200 host (ferry bench step: the step costs 1.02x CPU Adam alone, vs 1.07x with 32 MiB chunks and
// 1.22x with 4 MiB). Two ranks on a 2 x H200 host (ZeRO-1, bench_train_dist.py): 4 MiB each 148.6 and
// 148.1 ms an iteration, 8 MiB each 156.6 and 153.3 ms (alternated, one lease).
inline constexpr size_t kHostChunkBytes = size_t{8} << 20;

// The offload pipeline's chunk of a rank among `local_world_size` on its host:
// EngineOptions::transfer_chunk_bytes `option` where set (> 0), else kHostChunkBytes / local_world_size,
// at least 1 MiB.
size_t TransferChunkBytes(size_t option, int local_world_size);

struct EngineOptions {
  std::string policy_path;                        // Lua policy file; empty = every group on the GPU
  std::map<std::string, std::string> policy_args;  // the policy's ctx.args
  OptimizerOptions optimizer;
  std::string device;                             // "", "host" or "cuda" (see FERRY_DEVICE)
  int device_ordinal = 0;
  // Chunk of the offload pipeline (grads down and params up, CPU Adam's unit of work); 0 (the
  // default): kHostChunkBytes for a process that has its host to itself, kHostChunkBytes /
  // local_world_size (at least 1 MiB) for each of the local ranks that share one, so that the chunks
  // the host's ranks have in flight together stay near kHostChunkBytes. EngineStats says which.
  size_t transfer_chunk_bytes = 0;
  // CPU Adam's worker threads; 0 = this rank's share of the host's CPUs (see local_rank), less
  // trainer_threads, less one CPU for the thread that runs a step (the trainer's, or the early-step
  // thread), which works beside them (larger shares keep an eighth free instead), and no more than
  // help (cpu_threads_max).
  // EngineStats::cpu_threads tells the count.
  size_t cpu_threads = 0;
  // CPUs of the share left to the trainer's own threads when cpu_threads is 0 (its Python or C++
  // loop, autograd, data loading); no worker runs there. See engine/EMBEDDING.md ("Big hosts and
  // ranks that share a host").
  size_t trainer_threads = 1;
  // The most workers cpu_threads = 0 takes. 0: the FERRY_CPU_THREADS_MAX environment variable, else
  // measured: past the host's memory-bandwidth knee more workers add nothing to CPU Adam and take the
  // CPUs the pipeline's copies and the trainer need, so the first Finalize that offloads a group, on
  // a share of more than 16 CPUs, times CPU Adam with 8, 12, 16, 24, 32, ... workers on scratch
  // memory (~0.5 s, once per process) and takes the fewest within 10% of the best (engine/EMBEDDING.md, "Big hosts and ranks that share a host").
  size_t cpu_threads_max = 0;
  // The spare state of early steps (GradsReady), as a fraction of the offloaded state's pinned bytes
  // (0 to 1): a speculative update writes a second set of state buffers, as much pinned memory again
  // as the offloaded state at 1 (the default). Below 1, params that fit get spare buffers and
  // speculate during the backward, spread evenly over the model in registration order (the forward's
  // order: the backward then has speculation to run from its first grads on, and the next forward
  // runs speculated layers between those it waits for); the others update once Step knows the step
  // (in place, deferred beside the next forward when the trainer waits per group). Params, not
  // groups: a model in one group speculates on part of itself. EngineStats::spare_state_bytes shows what was taken.
  // The policy's place() may bound it too (its "spare_state" key, e.g. memory_budget.lua's
  // host_budget): the smaller of the two applies. The spare state is allocated once, at the first
  // GradsReady after Finalize or after a placement change (a move rebuilds the offloaded state); a
  // bound that changes later (ReloadPolicy with the same placement) applies at that next allocation
  // and leaves a spare state already allocated as it is.
  double spare_state_fraction = 1.0;
  // The state later (engine/ARCHITECTURE.md, "The state later"): the early pass writes the new params
  // of part of a decided fp32 update first and its state in the CPU's idle time before the next
  // backward's first grads, from grads kept aside in host memory (not pinned). "off"; "auto" (a
  // buffer of a quarter of the offloaded fp32 grads' bytes, of which each step stages what the idle
  // time was measured to hold); or a fraction in (0, 1] of those bytes, staged every step. Empty: the
  // FERRY_STATE_LATER environment variable (the same values), else off. Bit-identical either way;
  // EngineStats::cpu_adam_later_bytes and state_later_*_bytes show what it did.
  std::string state_later;
  // Several ranks on one host (torchrun --nproc-per-node, mpirun -np): this process's place among
  // them, which gives its share of the host: a disjoint slice of the CPUs it may run on (whole
  // cores, on the NUMA node of its GPU where the host has several) for its workers, and 1 /
  // local_world_size of the default pinned budget. -1: from the launcher's environment (torchrun,
  // Open MPI, MPICH, Slurm); none found: rank 0 of 1. A process the launcher already bound to fewer
  // CPUs than are online (taskset, --bind-to) keeps all of them.
  int local_rank = -1;
  int local_world_size = -1;
  // Restrict the workers to the share's CPUs (less the trainer's): 1 always, 0 never, -1 (or as the
  // FERRY_PIN_CPU_THREADS environment variable says, 0 or 1) to them where more than 2 local ranks
  // divide the CPUs (4 ranks on 64 CPUs: the ZeRO-1 step 22% faster than free), else only to the CPUs
  // of the rank's NUMA node where the host of several nodes was split by node, else not at all: the
  // count of workers is the share's either way. Each worker may move among the CPUs it is restricted
  // to (one CPU per worker measured no better); left free on a one-node host, the offloaded loop of 2
  // ranks ran 2-13% faster.
  int pin_cpu_threads = -1;
  // Hold this process's other threads (the trainer's, autograd's, NCCL's, the pipeline's: every thread
  // but CPU Adam's workers, and the threads they start later) to the rank's share of the host: 1
  // wherever the local ranks divided the CPUs, 0 never, -1 (or as the FERRY_PIN_TRAINER_THREADS
  // environment variable says, 0 or 1) where the workers are held to their share by default (more than
  // 2 local ranks dividing slices of 4 CPUs or more). Free, they run on any CPU of the host, among
  // other ranks' workers: 4 FSDP2 ranks on a 64-CPU host waited for the one whose backward launched
  // late. Once per process, at the first Finalize that offloads a group; a process the launcher bound
  // keeps its binding. Threads and processes the trainer starts later (data loaders) inherit the share.
  int pin_trainer_threads = -1;
  std::string numa;                               // "", "interleave", "bind", "preferred", "local"
  // Trace of every step, save and load as Chrome/Perfetto trace-event JSON (`ferry trace FILE`
  // summarizes it), written at destruction (tmp + rename). Empty: the FERRY_TRACE environment
  // variable, else off (no cost). Several ranks: each rank writes FILE.rank-<r>.json (pid = rank).
  std::string trace_path;

  // Several ranks. `comm` coordinates the ranks (null: a single process, world size 1); `rank` and
  // `world_size` must equal its own (they are checked). The collectives are small: one exchange of
  // the param specs at Finalize, one all-reduce per Step when grads are checked (check_finite, clipping),
  // a few per checkpoint save or load. Every one has a timeout: a rank that fails makes every other
  // rank's call return an error naming it; a rank that does not arrive makes them return
  // DeadlineExceeded. Nothing hangs.
  int rank = 0;
  int world_size = 1;
  std::shared_ptr<Comm> comm;
  absl::Duration collective_timeout = absl::Minutes(5);   // Finalize, Step, load decisions
  absl::Duration checkpoint_timeout = absl::Minutes(60);  // waiting for the other ranks' files
};

struct StepOptions {
  // This step's learning rate (the global schedule; default OptimizerOptions::lr); each group steps
  // with it times its GroupOptions::lr_scale.
  std::optional<float> lr;
  // This step's learning rate of the named groups, replacing lr times lr_scale for them: torch-style
  // absolute per-group rates, which a scheduler may change at every step (the Python binding sets
  // every group's). Each >= 0 and finite. Errors (nothing stepped): InvalidArgument naming an unknown
  // group, a group named twice or a bad value.
  std::vector<std::pair<std::string, float>> group_lr;
  // This step's (beta1, beta2) of the named groups, replacing their GroupOptions' for this step only:
  // schedulers that cycle momentum (torch's OneCycleLR and CyclicLR change beta1 at every step). The
  // bias corrections take this step's betas, as torch's AdamW does (1 - beta1^t). Each in [0, 1).
  // Errors as group_lr's. A group's own betas (checkpoints, Placement) stay its GroupOptions'.
  std::vector<std::pair<std::string, std::pair<float, float>>> group_betas;
  // This step's weight decay of the named groups (schedules that move it, as DINO's cosine one), for
  // this step only. Each >= 0 and finite. Errors as group_lr's.
  std::vector<std::pair<std::string, float>> group_weight_decay;
  // Mixed precision: the grads carry this loss scale and are divided by it (> 0, finite).
  float loss_scale = 1.0f;
  // > 0: clip the global L2 norm of the unscaled grads of every group to this, computed across all
  // groups (CPU and GPU) before any group is updated.
  float max_grad_norm = 0.0f;
  // Check every grad for NaN/Inf first; when one is found the step is skipped for every group and
  // reported (EngineStats::last_step_skipped), never applied. Needed by loss_scale and max_grad_norm.
  bool check_finite = true;
  // true: the trainer's stream waits in Step for every group's new params. false: Step returns with
  // the stream waiting only for what it enqueued itself (the GPU groups' update), and the trainer
  // calls WaitParams(groups, stream) before each group's params are first used (for example in a
  // forward pre-hook), so its next forward starts before the last upload has landed.
  bool wait_for_params = true;
  // Step only: discard the early work of every group announced by GradsReady for this step and
  // recompute those groups from their unchanged state and the grads as they are now (the result is
  // that of a Step without GradsReady). For a trainer that changed announced grads after all (a
  // binding that detects it: ferry.torch sees a second backward or an in-place change of the grads);
  // counted in EngineStats::early_groups_recomputed. Ignored by GradsReady.
  bool discard_early = false;
};

// Where a group's optimizer state lives after Finalize, and in which precision.
struct GroupPlacement {
  std::string group;
  bool offloaded = false;  // true: master + m + v in pinned host memory, updated by CPU Adam
  int64_t numel = 0;         // elements this rank holds
  int64_t num_params = 0;
  int64_t global_numel = 0;  // elements of the group's global tensors (= numel for one rank)
  // The group's optimizer settings, every field set: AddGroup's, else EngineOptions::optimizer's.
  GroupOptions options;
  // The precision of its state, as the policy's place() chose: the master (kF32, or kBF16 for bf16
  // params) and the moments (kF32 or kBF16); bf16 values rounded to nearest even, or stochastically
  // (deterministic: a counter-based hash of the param, its global element, the step and the kind).
  DType master_dtype = DType::kF32;
  DType moments_dtype = DType::kF32;
  bool stochastic_rounding = false;
  // Bytes of its state on this rank (its aligned layout): in pinned host memory when offloaded, in
  // device memory otherwise (the other is 0). 12 per element with fp32 state, 8 with bf16 moments.
  int64_t host_state_bytes = 0;
  int64_t device_state_bytes = 0;
};

struct EngineStats {
  int64_t step = 0;                 // optimizer steps taken
  uint64_t host_registrations = 0;  // Device::RegisterHost calls on this engine's device so far
  // Pin/register/host-alloc calls of the whole process's pinned arenas (mmap + register). Flat after
  // warm-up (Finalize, the first checkpoint save) across any number of steps, saves and loads.
  uint64_t pinned_host_calls = 0;
  int64_t skipped_steps = 0;        // steps skipped because a grad was NaN/Inf
  bool last_step_skipped = false;
  double last_grad_norm = 0.0;      // global L2 norm of the unscaled grads at the last checked step
  size_t pinned_bytes = 0;          // pinned host memory reserved (offloaded state and the staging ring)
  // Of pinned_bytes, those huge pages back (read once per arena, after its pages were faulted in):
  // below pinned_bytes with transparent huge pages, the kernel could not find them all (fragmented
  // memory), and CPU Adam pays in TLB misses.
  size_t pinned_huge_bytes = 0;
  size_t gpu_state_bytes = 0;       // device memory held for GPU groups' state (master, m, v)
  // Offloaded state that steps copied aside because they overtook an asynchronous save's writer
  // (copy-on-write; the rest was written in place), summed over all saves.
  uint64_t checkpoint_copied_aside_bytes = 0;
  // GradsReady: offloaded groups whose early update Step kept, and those it recomputed (clipping
  // triggered, other StepOptions, or the early work failed), summed over all steps.
  int64_t early_groups_kept = 0;
  int64_t early_groups_recomputed = 0;
  // Steps that returned before their offloaded update had finished (StepOptions::wait_for_params
  // false after announcements, the step not skipped: the update completes while the trainer's next
  // forward runs, each layer waiting for its own groups with WaitParams or params with WaitParamsOf;
  // a clipped step too, its update then run with the step's own scalars).
  int64_t deferred_steps = 0;
  size_t spare_state_bytes = 0;   // pinned bytes of the early steps' spare state (EngineOptions::spare_state_fraction
                                  // and the policy's bound)
  // The offloaded update's CPU Adam, summed over all steps: the wall time its rounds ran (early passes,
  // deferred updates and Step's own alike; rounds back to back counted once) and the bytes they read
  // and wrote (state, grads, params). Their ratio is the update's memory bandwidth, to set beside the
  // host's (STREAM) or `ferry bench adam`'s; divided by the steps, the update's time per step.
  double cpu_adam_busy_seconds = 0.0;
  uint64_t cpu_adam_bytes = 0;
  // Of cpu_adam_bytes, those of updates that read the state and wrote its spare copy (early steps'
  // speculation, out of place: 86-99% of the in-place rate in `ferry bench adam` on H200 hosts); the
  // rest updated in place (Step's own update, a decided step's deferred update, a param without spare
  // state).
  uint64_t cpu_adam_spare_bytes = 0;
  // Of cpu_adam_bytes, those of the rounds that wrote the state of pieces whose params went up first
  // (EngineOptions::state_later; engine/ARCHITECTURE.md, "The state later"); 0 when it is off.
  uint64_t cpu_adam_later_bytes = 0;
  // The state later's buffer of kept grads (host memory, not pinned; allocated at the first early
  // pass that splits a piece), and the bytes of it a cycle may stage now: the whole buffer with a
  // fraction, the limit measured so far with "auto". Both 0 when it is off.
  size_t state_later_kept_bytes = 0;
  size_t state_later_limit_bytes = 0;

  // This rank's share of its host (EngineOptions::local_rank).
  int local_rank = 0;
  int local_world_size = 1;
  size_t transfer_chunk_bytes = 0;  // the offload pipeline's chunk (EngineOptions::transfer_chunk_bytes)
  size_t cpu_threads = 0;      // CPU Adam's workers (the thread running a step works beside them)
  std::string cpu_list;        // the CPUs they are pinned to, "0-15,32-47"; empty: not pinned
  std::string host_share;      // how the share and the worker count were chosen
  int numa_node = -1;          // the node the offloaded state's pages were placed on; -1: not bound
  // The NUMA policy the offloaded state's pages follow: the policy's place() result `numa` (kept by
  // on_step moves), else EngineOptions::numa, else "preferred" (its GPU's node) on a host of several
  // nodes; empty: none (the kernel's first touch).
  std::string numa_policy;
  size_t pinned_limit_bytes = 0;  // the process's pinned budget (split among the local ranks)
};

// How LoadCheckpoint treats a checkpoint that fails verification.
struct LoadOptions {
  // When the checkpoint (the one `latest` names, or the directory given) is corrupt, truncated or
  // incomplete (DataLoss or NotFound), load the newest older committed checkpoint of the same root
  // that verifies instead (logged as a warning). A checkpoint that does not match the registered
  // params (InvalidArgument) is never skipped this way.
  bool fall_back_to_previous = false;
};

// What the last successful LoadCheckpoint loaded.
struct LoadReport {
  std::string dir;  // the checkpoint directory (with fall_back_to_previous, maybe an older one)
  // One line for every optimizer setting of a loaded group that the checkpoint records with another
  // value than this engine runs with, e.g. "group 'bias': weight_decay 0.01 in the checkpoint, 0 in
  // this engine". The engine keeps its own settings; each line is also logged as a warning.
  // Checkpoints of the format before per-group settings record none: nothing is compared.
  std::vector<std::string> optimizer_differences;
  // One line for every group whose state the checkpoint stores in another dtype than this engine
  // keeps it in, e.g. "group 'fc1': exp_avg bf16 in the checkpoint, fp32 in this engine: converted".
  // Loading converts explicitly (bf16 -> fp32 exactly, fp32 -> bf16 rounded to nearest even); each
  // line is also logged as a warning.
  std::vector<std::string> state_conversions;
};

// Engine: one thread at a time (a trainer drives it from its training loop).
class Engine {
 public:
  virtual ~Engine() = default;

  // Creates an engine: picks the device (CUDA when present, else the host backend), loads the policy.
  // Errors: a field of `options` out of its range (InvalidArgument naming the field and its value,
  // checked before anything else, so a refused Create changes nothing of the process), the policy file
  // cannot be loaded (file:line), the device cannot be opened.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);

  // Registers a parameter. Errors (nothing registered): after Finalize, duplicate or empty name,
  // null pointers, zero-size or negative dimensions, bad characters in the name, a group whose
  // params mix dtypes.
  virtual absl::Status AddParam(const ParamSpec& spec) = 0;

  // Gives parameter group `group` its own optimizer settings (its params are added by AddParam with
  // ParamSpec::group = `group`, before or after this call). Groups not given here use
  // EngineOptions::optimizer. Errors (nothing changed): after Finalize, an empty name, a group given
  // twice, a value out of range (a negative weight decay or lr_scale, betas outside [0, 1), eps not
  // > 0, anything not finite). Finalize refuses a group given here that no param joined.
  // Several ranks: every rank must give every group the same settings (Finalize checks, naming the
  // rank and the group).
  virtual absl::Status AddGroup(const std::string& group, const GroupOptions& options) = 0;

  // Calls the policy's place() hook, allocates the fp32 master and moments where it says, and
  // initialises the masters from the current params (m = v = 0). On error nothing is allocated and
  // Finalize may be called again (for example after fixing the policy).
  // Several ranks: collective. The ranks exchange their specs once; ranks that registered different
  // params (names, groups, global shapes, dtypes) or ranges that overlap or leave elements of a
  // tensor to nobody are refused on every rank, naming the rank and the param. Each rank's policy
  // places its own shards (ctx.rank, ctx.world_size; groups report numel and global_numel).
  virtual absl::Status Finalize() = 0;

  // One optimizer step of every group from the grads. `stream` is the trainer's stream (a
  // cudaStream_t; nullptr = the legacy default stream, or, on the host backend, the calling thread):
  // Step starts after the work already on it and the trainer's later work on it sees the new params.
  // REQUIRES: Finalize succeeded.
  // Several ranks: with check_finite (or clipping) collective: the found-inf and the global norm come
  // from one all-reduce of an exact sum of squares, so every rank takes the same decision and the
  // params are bit-identical for any world size over the same global tensors.
  virtual absl::Status Step(const StepOptions& options = {}, void* stream = nullptr) = 0;

  // Starting the step during backward. The trainer announces that the grads of `groups` are final on
  // `stream` (as for Step) and that its backward no longer reads their params, typically from a
  // post-accumulate-grad hook or after a layer's backward; `options` are the coming Step's. Ferry
  // starts those groups' work at once, in the background: for offloaded groups the D2H of their
  // grads, CPU Adam and the upload of their new params. GPU groups are recorded and update in Step.
  // The early work assumes the step neither clips nor finds a NaN/Inf, and does not change the
  // optimizer state until Step has checked that: Step keeps an offloaded group's early update when
  // its learning rate, step, loss scale and gradient multiplier are the same bits as the step's
  // (no clip triggered, the same StepOptions), and otherwise recomputes the group from its
  // unchanged state; when the step is skipped (NaN/Inf) it rewrites the params from the masters.
  // So the params and state after Step are bit-identical to a Step without GradsReady, in every
  // case. Groups never announced step in Step as before (or, with wait_for_params = false, after it,
  // beside the trainer's next forward; so does a step whose speculation failed). The first call
  // allocates as much pinned host memory again as the offloaded state (the early update's buffers),
  // once; EngineOptions::spare_state_fraction and the policy's place() bound it.
  // Errors (nothing started, the step in progress unchanged): before Finalize, an empty list, an
  // unknown group (NotFound), a group announced twice in one step (InvalidArgument), options Step
  // would refuse. Between the first GradsReady of a step and its Step, SaveCheckpoint,
  // LoadCheckpoint, SyncFromModel, ReloadPolicy and VerifyMasters return FailedPrecondition (call
  // Step first); a Step that fails drops the early work and restores the params (nothing changed).
  // Several ranks: not collective; ranks may announce different groups (Step decides globally).
  // REQUIRES: the announced grads stay unchanged until Step.
  virtual absl::Status GradsReady(const std::vector<std::string>& groups, const StepOptions& options = {},
                                  void* stream = nullptr) = 0;

  // GradsReady for parts of groups (buckets): the grads of `params` (names, of any groups) are final
  // on `stream`. Overlap then does not depend on how the trainer groups its params: a trainer with one
  // group, or with two (decay / no decay), announces buckets of params as its backward finishes them
  // (a few to tens of MiB of grads each: every announcement costs an event and at least one pipeline
  // chunk), and Ferry starts their offloaded update at once, as for a group. A group is announced
  // once all its params are (GradsReady of a group announces those of its params not announced
  // yet). At Step, the params of an offloaded group that was announced in part start too (their
  // grads are final by then). Exact, as GradsReady, with the same contract and the same errors
  // (NotFound naming an unknown param, InvalidArgument for a param announced twice in one step or
  // an empty list). Params whose local range is empty (several ranks) are accepted and ignored.
  virtual absl::Status GradsReadyParams(const std::vector<std::string>& params, const StepOptions& options = {},
                                        void* stream = nullptr) = 0;

  // After a Step with wait_for_params = false: makes `stream` wait until the params of `groups` (all
  // when empty) hold the step's values. Cheap (one stream wait per group). Errors: NotFound for an
  // unknown group, FailedPrecondition between GradsReady and Step.
  virtual absl::Status WaitParams(const std::vector<std::string>& groups, void* stream = nullptr) = 0;

  // WaitParams for single params: after a Step with wait_for_params = false, makes `stream` wait until
  // the params named hold the step's values. After a deferred Step it waits only for the part of
  // the update that holds each param (the announcement it was in, or the bucket of its group that
  // the step started), not for its whole group, so the first layers of a model in one group start
  // their forward while the later ones still update. Errors: NotFound naming an unknown param,
  // FailedPrecondition between GradsReady and Step.
  virtual absl::Status WaitParamsOf(const std::vector<std::string>& params, void* stream = nullptr) = 0;

  // Blocks until all work the engine has enqueued has finished.
  virtual absl::Status Synchronize() = 0;

  // Saves params, fp32 masters and moments as <root>/step-<step>/ (the policy's checkpoint() hook may
  // skip parts and chooses async and keep_last), atomically. Returns the checkpoint directory.
  // Every save first waits for the previous asynchronous save; if that one failed, its error is
  // returned here and nothing new is saved. Device-resident tensors (params, state of GPU groups)
  // are copied into a pinned staging buffer kept across saves (grown when needed; every save copies
  // fresh values); offloaded state is written straight from pinned host memory, never copied.
  // Synchronous saves return once committed. With the policy's `async = true` the call returns at
  // once and writer threads write and commit in the background: the device copies are ordered
  // after the last Step on the device, and the next Step is ordered after them on the device (the
  // host does not wait); the next Step's CPU update of an offloaded param waits until the writer
  // has written that param's state. Code of the trainer that writes registered params itself
  // (outside Step) must call Synchronize() first. The returned directory exists only once
  // WaitCheckpoint returns OK (or PollCheckpoint returns OK).
  // Several ranks: collective. The policy's checkpoint() runs on rank 0 and its plan holds for every
  // rank; each rank writes its own file (rank-<r>.safetensors) of its shards; rank 0 commits (manifest,
  // rename, `latest`, then keep_last) only once every rank's file is fsynced, and every rank gets
  // the same directory or the same error (naming the ranks whose writes failed). Asynchronous saves
  // run the exchange on a duplicate of the comm (Comm::Duplicate); without one they are synchronous.
  virtual absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, int64_t step) = 0;

  // Blocks until the asynchronous save in flight (if any) has committed; returns the error of a
  // finished save not yet reported (once), else OK. Errors are never lost: one not collected here
  // is returned by the next SaveCheckpoint (or logged when the engine is destroyed).
  virtual absl::Status WaitCheckpoint() = 0;

  // Without blocking: nullopt while an asynchronous save is in flight, else what WaitCheckpoint
  // would return.
  virtual std::optional<absl::Status> PollCheckpoint() = 0;

  // Loads a checkpoint directory (or the `latest` of a root): params into the trainer's tensors and
  // state into the engine, verified by checksum. The policy's after_load() hook decides which masters
  // are re-synced from the loaded params. A corrupt or mismatching checkpoint is refused before
  // anything is changed.
  // Checkpoints saved with any world size load: each rank reads only the chunks that overlap its
  // ranges, each verified by its checksum. Waits for an asynchronous save in flight first.
  // Several ranks: collective (every rank calls it); rank 0 resolves `latest`, and the load is
  // applied only when every rank has read and verified its part (else every rank fails, naming
  // the ranks at fault, and nothing changed).
  virtual absl::Status LoadCheckpoint(const std::string& path) = 0;
  // The same, with `options` (e.g. falling back to the previous complete checkpoint).
  virtual absl::Status LoadCheckpoint(const std::string& path, const LoadOptions& options) = 0;
  // What the last successful LoadCheckpoint loaded, with the optimizer settings the checkpoint
  // records differently (see LoadReport). Empty before any load.
  virtual LoadReport LastLoad() const = 0;

  // Refreshes the fp32 masters of `groups` (all when empty) from the params' current values; with
  // `reset_optimizer`, also zeroes their moments and step. For a trainer that loaded weights itself.
  virtual absl::Status SyncFromModel(const std::vector<std::string>& groups, bool reset_optimizer) = 0;

  // One param's optimizer state as fp32, for bindings that export or import it (torch's state_dict):
  // `kind` is "master", "exp_avg" or "exp_avg_sq"; `host` is host memory of the param's local
  // elements (the whole tensor on one rank; nothing for an empty local range). Synchronous: waits for
  // the engine's work. Errors: before Finalize, an unknown param or kind (InvalidArgument, nothing
  // read or written).
  virtual absl::Status ReadState(const std::string& param, std::string_view kind, float* host) = 0;
  // Replaces that state from `host`; the param itself is unchanged (SyncFromModel goes the other way).
  // Waits for an asynchronous save still reading the state.
  virtual absl::Status WriteState(const std::string& param, std::string_view kind, const float* host) = 0;
  // The number of optimizer steps group `group` has taken (its bias correction's step), and setting it
  // (>= 0). Errors: before Finalize, an unknown group (NotFound), a negative step (InvalidArgument).
  virtual absl::StatusOr<int64_t> GroupStep(const std::string& group) const = 0;
  virtual absl::Status SetGroupStep(const std::string& group, int64_t step) = 0;

  // Checks that every param equals its fp32 master rounded to the param's dtype; the first mismatch is
  // reported as FailedPrecondition naming the group, tensor and element.
  virtual absl::Status VerifyMasters() = 0;

  // Replaces the policy between steps (hot reload): loads `path` with `args`, runs its place() hook,
  // and moves the state of every group whose placement changed between pinned host memory and the
  // GPU without changing any value (the continued run is bit-identical to one that never moved). On
  // any error (the file, the hook, the move) the old policy and placement stay in force. The new
  // place()'s bound on the spare state (EngineOptions::spare_state_fraction) applies at the spare
  // state's next allocation; one already allocated keeps its size unless the placement changes.
  // REQUIRES: Finalize succeeded.
  virtual absl::Status ReloadPolicy(const std::string& path, const std::map<std::string, std::string>& args) = 0;

  virtual std::vector<GroupPlacement> Placement() const = 0;
  virtual EngineStats Stats() const = 0;
  // The device in words, e.g. "host (emulated device memory)" or "NVIDIA H200 (cuda:0, ...)".
  virtual std::string DeviceName() const = 0;
  // True when the engine runs on the CUDA backend.
  virtual bool OnGpu() const = 0;
};

}  // namespace ferry

#endif  // FERRY_ENGINE_H_
