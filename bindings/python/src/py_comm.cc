// ferry._ferry's comm through Python (py_comm.h).
#include "py_comm.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

namespace py = pybind11;

namespace ferry::python {
namespace {

// Whether the interpreter is gone or finalizing: a thread of ours that takes the GIL then is made to
// exit on the spot (and its C++ frames abort the process), so the engine's threads must not try.
// ferry._state waits for asynchronous saves at exit, before finalization; this is the last guard.
bool PythonUnavailable() {
  if (!Py_IsInitialized()) return true;
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// A Python object whose last reference may be dropped without the GIL (the engine destroys its comm
// from whatever thread runs its destructor): the reference is released under the GIL.
struct PyRef {
  explicit PyRef(py::object o) : obj(std::move(o)) {}
  ~PyRef() {
    if (PythonUnavailable()) {
      obj.release();  // the interpreter is gone or finalizing: leak rather than touch it
      return;
    }
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  py::object obj;
};

// Calls `fn` (which uses the Python API) under the GIL; a Python exception becomes an error Status
// naming the callback and the exception.
template <typename Fn>
absl::Status CallPython(const char* what, Fn&& fn) {
  if (PythonUnavailable()) {
    return absl::UnavailableError(std::string(what) + ": the Python interpreter is exiting (or gone)");
  }
  py::gil_scoped_acquire gil;
  try {
    fn();
    return absl::OkStatus();
  } catch (py::error_already_set& e) {
    const bool timeout = e.matches(PyExc_TimeoutError);
    std::string message = std::string("Python ") + what + " raised " + e.what();
    return timeout ? absl::DeadlineExceededError(message) : absl::UnavailableError(message);
  } catch (const std::exception& e) {
    return absl::UnavailableError(std::string("Python ") + what + ": " + e.what());
  }
}

}  // namespace

absl::StatusOr<CommCallbacks> MakePyCallbacks(py::object obj, int rank, int world_size) {
  auto ref = std::make_shared<PyRef>(std::move(obj));
  CommCallbacks cb;
  cb.rank = rank;
  cb.world_size = world_size;
  cb.all_reduce = [ref](double* values, size_t n, ReduceOp op, double timeout_s) -> absl::Status {
    return CallPython("all_reduce", [&] {
      py::list in;
      for (size_t i = 0; i < n; ++i) in.append(values[i]);
      py::object out = ref->obj.attr("all_reduce")(in, std::string(ReduceOpName(op)), timeout_s);
      std::vector<double> result = out.cast<std::vector<double>>();
      if (result.size() != n) {
        throw std::runtime_error("all_reduce returned " + std::to_string(result.size()) + " values, expected " +
                                 std::to_string(n));
      }
      std::copy(result.begin(), result.end(), values);
    });
  };
  cb.all_gather = [ref, world_size](const void* mine, size_t bytes, void* out, double timeout_s) -> absl::Status {
    return CallPython("all_gather", [&] {
      py::bytes in(static_cast<const char*>(mine), bytes);
      std::string result = ref->obj.attr("all_gather")(in, timeout_s).cast<std::string>();
      if (result.size() != bytes * static_cast<size_t>(world_size)) {
        throw std::runtime_error("all_gather returned " + std::to_string(result.size()) + " bytes, expected " +
                                 std::to_string(bytes * world_size));
      }
      if (!result.empty()) std::memcpy(out, result.data(), result.size());
    });
  };
  py::gil_scoped_acquire gil;
  if (py::hasattr(ref->obj, "barrier")) {
    cb.barrier = [ref](double timeout_s) -> absl::Status {
      return CallPython("barrier", [&] { ref->obj.attr("barrier")(timeout_s); });
    };
  }
  if (py::hasattr(ref->obj, "broadcast")) {
    cb.broadcast = [ref](void* data, size_t bytes, int root, double timeout_s) -> absl::Status {
      return CallPython("broadcast", [&] {
        py::bytes in(static_cast<const char*>(data), bytes);
        std::string result = ref->obj.attr("broadcast")(in, root, timeout_s).cast<std::string>();
        if (result.size() != bytes) {
          throw std::runtime_error("broadcast returned " + std::to_string(result.size()) + " bytes, expected " +
                                   std::to_string(bytes));
        }
        if (!result.empty()) std::memcpy(data, result.data(), result.size());
      });
    };
  }
  if (py::hasattr(ref->obj, "duplicate")) {
    cb.duplicate = [ref, rank, world_size](double timeout_s) -> absl::StatusOr<CommCallbacks> {
      py::object dup;
      absl::Status s = CallPython("duplicate", [&] { dup = ref->obj.attr("duplicate")(timeout_s); });
      if (!s.ok()) return s;
      return MakePyCallbacks(std::move(dup), rank, world_size);  // takes the GIL itself
    };
  }
  return cb;
}

}  // namespace ferry::python
