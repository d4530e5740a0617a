// ferry._ferry: the C++ engine (ferry/engine.h) for Python, with pybind11.
//
// Tensors cross as raw addresses (torch's data_ptr()), shapes and dtype names, and the trainer's
// stream as an integer (torch.cuda.current_stream().cuda_stream; 0 on the host backend), so the
// module never links libtorch and one build serves every torch version. ferry/torch.py builds the
// torch.optim.Optimizer on it.
//
// Errors: every failed absl::Status raises a subclass of ferry.FerryError (a RuntimeError) carrying
// Ferry's message and the status code's name in `.code`; the subclasses also derive from the Python
// exception that fits the code (InvalidArgument and OutOfRange: ValueError; NotFound:
// FileNotFoundError; DeadlineExceeded: TimeoutError; ResourceExhausted: MemoryError; Unimplemented:
// NotImplementedError).
//
// Threads: the calls that wait (step, synchronize, checkpoints, state copies) release the GIL; an
// Engine object serializes its calls with a mutex (the C++ Engine is one thread at a time).
//
// Several ranks: Engine(comm=obj, rank=, world_size=) runs the engine's small collectives through
// `obj`, a Python object (ferry.distributed.TorchComm over torch.distributed): see py_comm.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ferry/comm.h"
#include "ferry/engine.h"
#include "ferry/version.h"
#include "py_comm.h"
#include "trace/trace_file.h"
#include "trace/trace_report.h"

namespace py = pybind11;

namespace ferry::python {
namespace {

// A failed Status on its way to Python (see the translator in the module's init).
struct StatusError {
  absl::Status status;
};

void Check(const absl::Status& s) {
  if (!s.ok()) throw StatusError{s};
}

template <typename T>
T Check(absl::StatusOr<T> s) {
  if (!s.ok()) throw StatusError{s.status()};
  return *std::move(s);
}

DType ParseDTypeOrThrow(const std::string& name) {
  if (name == "float32" || name == "f32") return DType::kF32;
  if (name == "bfloat16" || name == "bf16") return DType::kBF16;
  if (name == "float16" || name == "f16") return DType::kF16;
  throw StatusError{absl::InvalidArgumentError(
      "unsupported dtype '" + name + "': Ferry's params are float32, bfloat16 or float16")};
}

void* Ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

py::dict OptionsDict(const GroupOptions& o) {
  py::dict d;
  d["lr_scale"] = o.lr_scale.value_or(1.0f);
  d["weight_decay"] = o.weight_decay.value_or(0.0f);
  d["beta1"] = o.beta1.value_or(0.9f);
  d["beta2"] = o.beta2.value_or(0.999f);
  d["eps"] = o.eps.value_or(1e-8f);
  d["adamw"] = o.adamw.value_or(true);
  return d;
}

// One Engine, created from keyword options; see ferry/engine.h for every method's contract.
class PyEngine {
 public:
  PyEngine(const std::string& policy, const std::map<std::string, std::string>& policy_args, float lr, float beta1,
           float beta2, float eps, float weight_decay, bool adamw, const std::string& device, int device_ordinal,
           size_t transfer_chunk_bytes, size_t cpu_threads, const std::string& numa, const std::string& trace_path,
           py::object comm, int rank, int world_size, double collective_timeout_s, double checkpoint_timeout_s,
           int local_rank, int local_world_size, double spare_state_fraction, size_t trainer_threads,
           const std::string& state_later, size_t cpu_threads_max, int pin_cpu_threads, int pin_trainer_threads,
           bool bias_correction) {
    EngineOptions o;
    o.policy_path = policy;
    o.policy_args = policy_args;
    o.optimizer.lr = lr;
    o.optimizer.beta1 = beta1;
    o.optimizer.beta2 = beta2;
    o.optimizer.eps = eps;
    o.optimizer.weight_decay = weight_decay;
    o.optimizer.adamw = adamw;
    o.optimizer.bias_correction = bias_correction;
    o.device = device;
    o.device_ordinal = device_ordinal;
    if (transfer_chunk_bytes > 0) o.transfer_chunk_bytes = transfer_chunk_bytes;
    o.cpu_threads = cpu_threads;
    o.trainer_threads = trainer_threads;
    o.cpu_threads_max = cpu_threads_max;
    o.pin_cpu_threads = pin_cpu_threads;
    o.pin_trainer_threads = pin_trainer_threads;
    o.numa = numa;
    o.trace_path = trace_path;
    o.rank = rank;
    o.world_size = world_size;
    o.local_rank = local_rank;
    o.local_world_size = local_world_size;
    o.spare_state_fraction = spare_state_fraction;
    o.state_later = state_later;
    for (const auto& [name, seconds] : {std::pair<const char*, double>{"collective_timeout", collective_timeout_s},
                                        std::pair<const char*, double>{"checkpoint_timeout", checkpoint_timeout_s}}) {
      if (!(seconds >= 0.0 && std::isfinite(seconds))) {
        throw py::value_error(absl::StrCat(name, " is ", seconds, " s; it must be >= 0 (0: the engine's default)"));
      }
    }
    if (collective_timeout_s > 0) o.collective_timeout = absl::Seconds(collective_timeout_s);
    if (checkpoint_timeout_s > 0) o.checkpoint_timeout = absl::Seconds(checkpoint_timeout_s);
    if (!comm.is_none()) o.comm = Check(MakeCallbackComm(Check(MakePyCallbacks(std::move(comm), rank, world_size))));
    py::gil_scoped_release release;  // Create runs no collective, but keep the GIL free for other threads
    engine_ = Check(Engine::Create(o));
  }

  // The engine's destructor waits for an asynchronous save, whose writer thread may need the GIL for
  // its collectives: destroyed without the GIL.
  ~PyEngine() {
    py::gil_scoped_release release;
    engine_.reset();
  }

  void AddParam(const std::string& name, const std::string& group, const std::vector<int64_t>& shape,
                const std::string& dtype, uintptr_t param, uintptr_t grad, const std::optional<std::string>& grad_dtype,
                const std::vector<std::string>& tags, int64_t shard_begin, int64_t shard_end) {
    ParamSpec spec{.name = name, .group = group, .shape = shape, .dtype = ParseDTypeOrThrow(dtype),
                   .param = Ptr(param), .grad = Ptr(grad)};
    if (grad_dtype) spec.grad_dtype = ParseDTypeOrThrow(*grad_dtype);
    spec.tags = tags;
    spec.shard_begin = shard_begin;
    spec.shard_end = shard_end;
    std::lock_guard<std::mutex> lock(mu_);
    Check(engine_->AddParam(spec));
  }

  void AddGroup(const std::string& name, std::optional<float> lr_scale, std::optional<float> weight_decay,
                std::optional<float> beta1, std::optional<float> beta2, std::optional<float> eps,
                std::optional<bool> adamw) {
    GroupOptions o{.lr_scale = lr_scale, .weight_decay = weight_decay, .beta1 = beta1, .beta2 = beta2,
                   .eps = eps, .adamw = adamw};
    std::lock_guard<std::mutex> lock(mu_);
    Check(engine_->AddGroup(name, o));
  }

  void Finalize() { Locked([&] { return engine_->Finalize(); }); }

  // Returns (skipped, grad_norm) of this step.
  std::pair<bool, double> Step(StepOptions options, uintptr_t stream) {
    Locked([&] {
      const auto start = std::chrono::steady_clock::now();
      absl::Status s = engine_->Step(options, Ptr(stream));
      last_step_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      return s;
    });
    EngineStats s = engine_->Stats();
    return {s.last_step_skipped, s.last_grad_norm};
  }

  void GradsReady(const std::vector<std::string>& groups, StepOptions options, uintptr_t stream) {
    Locked([&] { return engine_->GradsReady(groups, options, Ptr(stream)); });
  }

  void GradsReadyParams(const std::vector<std::string>& params, StepOptions options, uintptr_t stream) {
    Locked([&] { return engine_->GradsReadyParams(params, options, Ptr(stream)); });
  }
  void WaitParamsOf(const std::vector<std::string>& params, uintptr_t stream) {
    Locked([&] { return engine_->WaitParamsOf(params, Ptr(stream)); });
  }
  void WaitParams(const std::vector<std::string>& groups, uintptr_t stream) {
    Locked([&] { return engine_->WaitParams(groups, Ptr(stream)); });
  }

  // `steps` Steps with the same options in a C++ loop, each followed by Synchronize, without the
  // GIL: the C++ step time of this engine, for comparing with the Python call. Returns each step's
  // seconds.
  std::vector<double> RunSteps(int64_t steps, StepOptions options, uintptr_t stream) {
    std::vector<double> seconds;
    Locked([&]() -> absl::Status {
      for (int64_t i = 0; i < steps; ++i) {
        const auto start = std::chrono::steady_clock::now();
        absl::Status s = engine_->Step(options, Ptr(stream));
        if (s.ok()) s = engine_->Synchronize();
        if (!s.ok()) return s;
        seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      return absl::OkStatus();
    });
    return seconds;
  }

  void Synchronize() { Locked([&] { return engine_->Synchronize(); }); }

  std::string SaveCheckpoint(const std::string& root, int64_t step) {
    std::string dir;
    Locked([&]() -> absl::Status {
      absl::StatusOr<std::string> d = engine_->SaveCheckpoint(root, step);
      if (d.ok()) dir = *d;
      return d.status();
    });
    return dir;
  }

  void WaitCheckpoint() { Locked([&] { return engine_->WaitCheckpoint(); }); }

  // False while an asynchronous save is in flight, True once none is (raises its error, once).
  bool PollCheckpoint() {
    std::optional<absl::Status> s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      s = engine_->PollCheckpoint();
    }
    if (!s) return false;
    Check(*s);
    return true;
  }

  void LoadCheckpoint(const std::string& path, bool fall_back_to_previous) {
    Locked([&] { return engine_->LoadCheckpoint(path, LoadOptions{.fall_back_to_previous = fall_back_to_previous}); });
  }

  py::dict LastLoad() {
    std::lock_guard<std::mutex> lock(mu_);
    LoadReport r = engine_->LastLoad();
    py::dict d;
    d["dir"] = r.dir;
    d["optimizer_differences"] = r.optimizer_differences;
    return d;
  }

  void SyncFromModel(const std::vector<std::string>& groups, bool reset_optimizer) {
    Locked([&] { return engine_->SyncFromModel(groups, reset_optimizer); });
  }
  void VerifyMasters() { Locked([&] { return engine_->VerifyMasters(); }); }
  void ReloadPolicy(const std::string& path, const std::map<std::string, std::string>& args) {
    Locked([&] { return engine_->ReloadPolicy(path, args); });
  }
  void ReadState(const std::string& param, const std::string& kind, uintptr_t host) {
    Locked([&] { return engine_->ReadState(param, kind, static_cast<float*>(Ptr(host))); });
  }
  void WriteState(const std::string& param, const std::string& kind, uintptr_t host) {
    Locked([&] { return engine_->WriteState(param, kind, static_cast<const float*>(Ptr(host))); });
  }
  int64_t GroupStep(const std::string& group) {
    std::lock_guard<std::mutex> lock(mu_);
    return Check(engine_->GroupStep(group));
  }
  void SetGroupStep(const std::string& group, int64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    Check(engine_->SetGroupStep(group, step));
  }

  py::list Placement() {
    std::vector<GroupPlacement> groups;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      groups = engine_->Placement();
    }
    py::list out;
    for (const GroupPlacement& g : groups) {
      py::dict d;
      d["group"] = g.group;
      d["offloaded"] = g.offloaded;
      d["numel"] = g.numel;
      d["num_params"] = g.num_params;
      d["global_numel"] = g.global_numel;
      d["host_state_bytes"] = g.host_state_bytes;
      d["device_state_bytes"] = g.device_state_bytes;
      d["options"] = OptionsDict(g.options);
      out.append(d);
    }
    return out;
  }

  py::dict Stats() {
    EngineStats s;
    int64_t host_state = 0, device_state = 0;
    double last_step_seconds = 0.0;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      s = engine_->Stats();
      last_step_seconds = last_step_seconds_;
      for (const GroupPlacement& g : engine_->Placement()) {
        host_state += g.host_state_bytes;
        device_state += g.device_state_bytes;
      }
    }
    py::dict d;
    // This rank's optimizer state (masters and moments of the elements it holds), summed over groups.
    d["host_state_bytes"] = host_state;
    d["device_state_bytes"] = device_state;
    d["step"] = s.step;
    d["skipped_steps"] = s.skipped_steps;
    d["last_step_skipped"] = s.last_step_skipped;
    d["last_grad_norm"] = s.last_grad_norm;
    d["pinned_bytes"] = s.pinned_bytes;
    d["pinned_huge_bytes"] = s.pinned_huge_bytes;
    d["gpu_state_bytes"] = s.gpu_state_bytes;
    d["host_registrations"] = s.host_registrations;
    d["pinned_host_calls"] = s.pinned_host_calls;
    d["checkpoint_copied_aside_bytes"] = s.checkpoint_copied_aside_bytes;
    d["early_groups_kept"] = s.early_groups_kept;
    d["early_groups_recomputed"] = s.early_groups_recomputed;
    d["deferred_steps"] = s.deferred_steps;
    d["spare_state_bytes"] = s.spare_state_bytes;
    d["cpu_adam_busy_seconds"] = s.cpu_adam_busy_seconds;
    d["cpu_adam_bytes"] = s.cpu_adam_bytes;
    d["cpu_adam_spare_bytes"] = s.cpu_adam_spare_bytes;
    d["cpu_adam_later_bytes"] = s.cpu_adam_later_bytes;
    d["state_later_kept_bytes"] = s.state_later_kept_bytes;
    d["state_later_limit_bytes"] = s.state_later_limit_bytes;
    // This rank's share of its host (engine/EMBEDDING.md, "Big hosts and ranks that share a host").
    d["local_rank"] = s.local_rank;
    d["local_world_size"] = s.local_world_size;
    d["transfer_chunk_bytes"] = s.transfer_chunk_bytes;
    d["cpu_threads"] = s.cpu_threads;
    d["cpu_list"] = s.cpu_list;
    d["host_share"] = s.host_share;
    d["numa_node"] = s.numa_node;
    d["numa_policy"] = s.numa_policy;
    d["pinned_limit_bytes"] = s.pinned_limit_bytes;
    // The binding's own measure: the host wall time of the last Engine::Step call (without taking the
    // GIL and the engine's mutex; on CUDA, until Step returned, not until its stream finished).
    d["last_step_seconds"] = last_step_seconds;
    return d;
  }

  std::string DeviceName() const { return engine_->DeviceName(); }
  bool OnGpu() const { return engine_->OnGpu(); }

 private:
  // Runs `fn` under the engine's mutex with the GIL released; raises its error.
  template <typename Fn>
  void Locked(Fn&& fn) {
    absl::Status s;
    {
      py::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      s = fn();
    }
    Check(s);
  }

  std::mutex mu_;
  std::unique_ptr<Engine> engine_;
  double last_step_seconds_ = 0.0;  // Step's host wall time (see Stats); guarded by mu_
};

using GroupLrs = std::vector<std::pair<std::string, float>>;
using GroupBetas = std::vector<std::pair<std::string, std::pair<float, float>>>;

StepOptions MakeStepOptions(std::optional<float> lr, const GroupLrs& group_lr, const GroupBetas& group_betas,
                            const GroupLrs& group_weight_decay, float loss_scale, float max_grad_norm,
                            bool check_finite, bool wait_for_params = true, bool discard_early = false) {
  return StepOptions{.lr = lr, .group_lr = group_lr, .group_betas = group_betas,
                     .group_weight_decay = group_weight_decay, .loss_scale = loss_scale,
                     .max_grad_norm = max_grad_norm,
                     .check_finite = check_finite, .wait_for_params = wait_for_params,
                     .discard_early = discard_early};
}

// The Python exception class of each status code (see the file comment).
struct ErrorClasses {
  py::object base;
  std::map<absl::StatusCode, py::object> by_code;
};

ErrorClasses* Errors() {
  static ErrorClasses* errors = new ErrorClasses();  // lives as long as the interpreter
  return errors;
}

py::object NewError(py::module_& m, const char* name, py::tuple bases, const char* doc) {
  py::dict ns;
  ns["__doc__"] = doc;
  ns["__module__"] = "ferry";
  py::object cls = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyType_Type))(name, bases, ns);
  m.attr(name) = cls;
  return cls;
}

}  // namespace
}  // namespace ferry::python

PYBIND11_MODULE(_ferry, m) {
  using namespace ferry::python;
  namespace fp = ferry::python;
  m.doc() = "Ferry's C++ engine (ferry/engine.h); use ferry.torch.Optimizer";
  m.attr("__version__") = FERRY_VERSION_STRING;

  ErrorClasses* errors = Errors();
  errors->base = NewError(m, "FerryError", py::make_tuple(py::handle(PyExc_RuntimeError)),
                          "An error of Ferry's engine; .code is the status code's name.");
  const std::pair<absl::StatusCode, std::pair<const char*, PyObject*>> kinds[] = {
      {absl::StatusCode::kInvalidArgument, {"InvalidArgumentError", PyExc_ValueError}},
      {absl::StatusCode::kOutOfRange, {"OutOfRangeError", PyExc_ValueError}},
      {absl::StatusCode::kNotFound, {"NotFoundError", PyExc_FileNotFoundError}},
      {absl::StatusCode::kDeadlineExceeded, {"DeadlineExceededError", PyExc_TimeoutError}},
      {absl::StatusCode::kResourceExhausted, {"ResourceExhaustedError", PyExc_MemoryError}},
      {absl::StatusCode::kUnimplemented, {"UnimplementedError", PyExc_NotImplementedError}},
  };
  for (const auto& [code, what] : kinds) {
    errors->by_code[code] = NewError(m, what.first, py::make_tuple(errors->base, py::handle(what.second)),
                                     "An error of Ferry's engine (see FerryError).");
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const fp::StatusError& e) {
      ErrorClasses* errs = Errors();
      auto it = errs->by_code.find(e.status.code());
      py::object cls = it != errs->by_code.end() ? it->second : errs->base;
      py::object err = cls(std::string(e.status.message()));
      err.attr("code") = absl::StatusCodeToString(e.status.code());
      PyErr_SetObject(cls.ptr(), err.ptr());
    }
  });

  m.def(
      "trace_report",
      [](const std::vector<std::string>& paths, const std::string& ceilings) {
        // What `ferry trace FILE... --ceiling TEXT` prints, without measuring ceilings: trace/trace_report.h.
        ferry::TraceCeilings limits;
        limits.gbps = fp::Check(ferry::ParseTraceCeilings(ceilings));
        for (const auto& [k, v] : limits.gbps) limits.source[k] = "given";
        std::vector<std::pair<std::string, ferry::TraceFile>> read;
        for (const std::string& path : paths) read.emplace_back(path, fp::Check(ferry::ReadTraceFile(path)));
        return fp::Check(ferry::TraceReport(read, limits));
      },
      py::arg("paths"), py::arg("ceilings") = std::string(),
      "The report `ferry trace` prints for trace files (one per rank): Ferry's (EngineOptions::trace_path) or "
      "torch.profiler's; `ceilings` as --ceiling takes them (\"d2h=55,mem=120\").");

  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const std::string&, const std::map<std::string, std::string>&, float, float, float, float, float,
                    bool, const std::string&, int, size_t, size_t, const std::string&, const std::string&, py::object,
                    int, int, double, double, int, int, double, size_t, const std::string&, size_t, int, int, bool>(),
           py::kw_only(), py::arg("policy") = "", py::arg("policy_args") = std::map<std::string, std::string>{},
           py::arg("lr") = 1e-3f, py::arg("beta1") = 0.9f, py::arg("beta2") = 0.999f, py::arg("eps") = 1e-8f,
           py::arg("weight_decay") = 0.0f, py::arg("adamw") = true, py::arg("device") = "",
           py::arg("device_ordinal") = 0, py::arg("transfer_chunk_bytes") = 0, py::arg("cpu_threads") = 0,
           py::arg("numa") = "", py::arg("trace_path") = "", py::arg("comm") = py::none(), py::arg("rank") = 0,
           py::arg("world_size") = 1, py::arg("collective_timeout") = 0.0, py::arg("checkpoint_timeout") = 0.0,
           py::arg("local_rank") = -1, py::arg("local_world_size") = -1, py::arg("spare_state_fraction") = 1.0,
           py::arg("trainer_threads") = ferry::EngineOptions{}.trainer_threads, py::arg("state_later") = "",
           py::arg("cpu_threads_max") = 0, py::arg("pin_cpu_threads") = -1, py::arg("pin_trainer_threads") = -1,
           py::arg("bias_correction") = true,
           "comm (with rank, world_size): the ranks' collectives (see the module comment); timeouts in seconds, "
           "0: the engine's defaults; local_rank, local_world_size: this process's place among the ranks of "
           "its host (-1: from the launcher's environment); trainer_threads: CPUs of the share left to the "
           "trainer's own threads when cpu_threads is 0; state_later: 'off', 'auto' or a fraction of the offloaded "
           "fp32 grads' bytes ('': FERRY_STATE_LATER, else off); cpu_threads_max, pin_cpu_threads, "
           "pin_trainer_threads, bias_correction: EngineOptions' (engine/include/ferry/engine.h). A value out of "
           "range raises ValueError naming the EngineOptions field.")
      .def("add_param", &PyEngine::AddParam, py::arg("name"), py::arg("group"), py::arg("shape"), py::arg("dtype"),
           py::arg("param"), py::arg("grad"), py::arg("grad_dtype") = py::none(),
           py::arg("tags") = std::vector<std::string>{}, py::arg("shard_begin") = 0, py::arg("shard_end") = -1,
           "shape is the global shape; param and grad address elements [shard_begin, shard_end) of the "
           "flattened global tensor (-1: its end; 0 addresses for an empty range).")
      .def("add_group", &PyEngine::AddGroup, py::arg("name"), py::kw_only(), py::arg("lr_scale") = py::none(),
           py::arg("weight_decay") = py::none(), py::arg("beta1") = py::none(), py::arg("beta2") = py::none(),
           py::arg("eps") = py::none(), py::arg("adamw") = py::none())
      .def("finalize", &PyEngine::Finalize)
      .def(
          "step",
          [](PyEngine& e, std::optional<float> lr, const GroupLrs& group_lr, const GroupBetas& group_betas,
             const GroupLrs& group_weight_decay, float loss_scale, float max_grad_norm, bool check_finite,
             bool wait_for_params, bool discard_early, uintptr_t stream) {
            return e.Step(MakeStepOptions(lr, group_lr, group_betas, group_weight_decay, loss_scale, max_grad_norm,
                                          check_finite, wait_for_params, discard_early),
                          stream);
          },
          py::kw_only(), py::arg("lr") = py::none(), py::arg("group_lr") = GroupLrs{},
          py::arg("group_betas") = GroupBetas{}, py::arg("group_weight_decay") = GroupLrs{},
          py::arg("loss_scale") = 1.0f, py::arg("max_grad_norm") = 0.0f, py::arg("check_finite") = true,
          py::arg("wait_for_params") = true, py::arg("discard_early") = false, py::arg("stream") = 0,
          "One step; returns (skipped, grad_norm). group_lr / group_betas / group_weight_decay: [(group, lr)] / "
          "[(group, (beta1, beta2))] / [(group, weight_decay)] of this step. discard_early: recompute the groups "
          "announced by grads_ready (their grads changed after the announcement).")
      .def(
          "grads_ready",
          [](PyEngine& e, const std::vector<std::string>& groups, std::optional<float> lr, const GroupLrs& group_lr,
             const GroupBetas& group_betas, const GroupLrs& group_weight_decay, float loss_scale,
             float max_grad_norm, bool check_finite, uintptr_t stream) {
            e.GradsReady(groups,
                         MakeStepOptions(lr, group_lr, group_betas, group_weight_decay, loss_scale, max_grad_norm,
                                         check_finite),
                         stream);
          },
          py::arg("groups"), py::kw_only(), py::arg("lr") = py::none(), py::arg("group_lr") = GroupLrs{},
          py::arg("group_betas") = GroupBetas{}, py::arg("group_weight_decay") = GroupLrs{},
          py::arg("loss_scale") = 1.0f, py::arg("max_grad_norm") = 0.0f, py::arg("check_finite") = true,
          py::arg("stream") = 0,
          "The grads of `groups` are final on `stream`: their step starts now (Engine::GradsReady); the "
          "options are the coming step's.")
      .def(
          "grads_ready_params",
          [](PyEngine& e, const std::vector<std::string>& params, std::optional<float> lr, const GroupLrs& group_lr,
             const GroupBetas& group_betas, const GroupLrs& group_weight_decay, float loss_scale,
             float max_grad_norm, bool check_finite, uintptr_t stream) {
            e.GradsReadyParams(params,
                               MakeStepOptions(lr, group_lr, group_betas, group_weight_decay, loss_scale,
                                               max_grad_norm, check_finite),
                               stream);
          },
          py::arg("params"), py::kw_only(), py::arg("lr") = py::none(), py::arg("group_lr") = GroupLrs{},
          py::arg("group_betas") = GroupBetas{}, py::arg("group_weight_decay") = GroupLrs{},
          py::arg("loss_scale") = 1.0f, py::arg("max_grad_norm") = 0.0f, py::arg("check_finite") = true,
          py::arg("stream") = 0,
          "The grads of `params` (names, of any groups: a bucket) are final on `stream`: their part of the "
          "step starts now (Engine::GradsReadyParams).")
      .def("wait_params_of", &PyEngine::WaitParamsOf, py::arg("params"), py::kw_only(), py::arg("stream") = 0,
           "After a step with wait_for_params=False: `stream` waits for the new values of `params` (names), "
           "only for the part of the update holding each (Engine::WaitParamsOf).")
      .def("wait_params", &PyEngine::WaitParams, py::arg("groups") = std::vector<std::string>{}, py::kw_only(),
           py::arg("stream") = 0,
           "After a step with wait_for_params=False: `stream` waits for the new params of `groups` (all when empty).")
      .def(
          "run_steps",
          [](PyEngine& e, int64_t steps, std::optional<float> lr,
             const std::vector<std::pair<std::string, float>>& group_lr, float loss_scale, float max_grad_norm,
             bool check_finite, uintptr_t stream) {
            return e.RunSteps(steps, MakeStepOptions(lr, group_lr, {}, {}, loss_scale, max_grad_norm, check_finite),
                              stream);
          },
          py::arg("steps"), py::kw_only(), py::arg("lr") = py::none(),
          py::arg("group_lr") = std::vector<std::pair<std::string, float>>{}, py::arg("loss_scale") = 1.0f,
          py::arg("max_grad_norm") = 0.0f, py::arg("check_finite") = true, py::arg("stream") = 0,
          "`steps` steps in a C++ loop without the GIL, each then synchronized; returns each one's seconds.")
      .def("synchronize", &PyEngine::Synchronize)
      .def("save_checkpoint", &PyEngine::SaveCheckpoint, py::arg("root"), py::arg("step"))
      .def("wait_checkpoint", &PyEngine::WaitCheckpoint)
      .def("poll_checkpoint", &PyEngine::PollCheckpoint)
      .def("load_checkpoint", &PyEngine::LoadCheckpoint, py::arg("path"), py::kw_only(),
           py::arg("fall_back_to_previous") = false)
      .def("last_load", &PyEngine::LastLoad)
      .def("sync_from_model", &PyEngine::SyncFromModel, py::arg("groups") = std::vector<std::string>{},
           py::arg("reset_optimizer") = false)
      .def("verify_masters", &PyEngine::VerifyMasters)
      .def("reload_policy", &PyEngine::ReloadPolicy, py::arg("path"),
           py::arg("args") = std::map<std::string, std::string>{})
      .def("read_state", &PyEngine::ReadState, py::arg("param"), py::arg("kind"), py::arg("host"),
           "Copies the param's `kind` state (fp32) into host memory at address `host`.")
      .def("write_state", &PyEngine::WriteState, py::arg("param"), py::arg("kind"), py::arg("host"))
      .def("group_step", &PyEngine::GroupStep, py::arg("group"))
      .def("set_group_step", &PyEngine::SetGroupStep, py::arg("group"), py::arg("step"))
      .def("placement", &PyEngine::Placement)
      .def("stats", &PyEngine::Stats)
      .def_property_readonly("device_name", &PyEngine::DeviceName)
      .def_property_readonly("on_gpu", &PyEngine::OnGpu);
}
