"""consumer.python.ctypes: Python's ctypes loads the installed libferry and trains through the C ABI.

    python3 ctypes_step.py LIBFERRY_SO POLICY_DIR VERSION

On Ferry's host backend device memory is host memory, so ctypes float arrays are the tensors. Checks
the version, one Adam step against its closed form (the first step of Adam moves every param by lr
against the sign of its grad), the placement, and an error reported through ferry_last_error.
"""
import ctypes
import sys


class Options(ctypes.Structure):
    _fields_ = [
        ("policy_path", ctypes.c_char_p),
        ("policy_arg_keys", ctypes.POINTER(ctypes.c_char_p)),
        ("policy_arg_values", ctypes.POINTER(ctypes.c_char_p)),
        ("num_policy_args", ctypes.c_size_t),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("adamw", ctypes.c_int),
        ("device", ctypes.c_char_p),
        ("transfer_chunk_bytes", ctypes.c_size_t),
        ("comm_kind", ctypes.c_int),
        ("comm_callbacks", ctypes.c_void_p),
        ("collective_timeout_s", ctypes.c_double),
        ("checkpoint_timeout_s", ctypes.c_double),
        # The fields after these (bias_correction, ..., trace_path) are left out on purpose: a mirror of an
        # older ferry_engine_options goes through the _sized calls, which read and write only its fields and
        # give the others their defaults.
    ]


FERRY_F32 = 0
FERRY_OK = 0
FERRY_ALREADY_EXISTS = 6


def main():
    lib_path, policy_dir, version = sys.argv[1:4]
    lib = ctypes.CDLL(lib_path)
    lib.ferry_version.restype = ctypes.c_char_p
    lib.ferry_last_error.restype = ctypes.c_char_p
    lib.ferry_engine_options_init_sized.argtypes = [ctypes.POINTER(Options), ctypes.c_size_t]
    lib.ferry_engine_create_sized.argtypes = [ctypes.POINTER(Options), ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    lib.ferry_engine_destroy.argtypes = [ctypes.c_void_p]
    lib.ferry_add_param.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                    ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_void_p]
    lib.ferry_finalize.argtypes = [ctypes.c_void_p]
    lib.ferry_step.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    lib.ferry_group_offloaded.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    lib.ferry_verify_masters.argtypes = [ctypes.c_void_p]

    def check(status, what):
        if status != FERRY_OK:
            raise SystemExit("%s failed (status %d): %s" % (what, status, lib.ferry_last_error().decode()))

    lib.ferry_engine_options_size.restype = ctypes.c_size_t
    if lib.ferry_engine_options_size() < ctypes.sizeof(Options):
        raise SystemExit("ferry_engine_options is %d bytes in libferry, %d in this mirror: the mirror is newer"
                         % (lib.ferry_engine_options_size(), ctypes.sizeof(Options)))
    got = lib.ferry_version().decode()
    if got != version:
        raise SystemExit("ferry_version() is %r, the project version is %r" % (got, version))

    opts = Options()
    lib.ferry_engine_options_init_sized(ctypes.byref(opts), ctypes.sizeof(Options))
    keys = (ctypes.c_char_p * 1)(b"fraction")
    values = (ctypes.c_char_p * 1)(b"0.5")
    policy = (policy_dir + "/offload_fraction.lua").encode()
    opts.policy_path = policy
    opts.policy_arg_keys = keys
    opts.policy_arg_values = values
    opts.num_policy_args = 1
    opts.device = b"host"
    opts.lr = 0.125
    engine = ctypes.c_void_p()
    check(lib.ferry_engine_create_sized(ctypes.byref(opts), ctypes.sizeof(Options), ctypes.byref(engine)),
          "ferry_engine_create_sized")

    n = 64
    shape = (ctypes.c_int64 * 1)(n)
    params = [(ctypes.c_float * n)(*[0.25 * (i % 7) for i in range(n)]) for _ in range(2)]
    grads = [(ctypes.c_float * n)(*[(-1.0) ** i * (1 + i % 3) for i in range(n)]) for _ in range(2)]
    for k, name in enumerate(("a", "b")):
        check(lib.ferry_add_param(engine, name.encode() + b".w", name.encode(), shape, 1, FERRY_F32,
                                  ctypes.cast(params[k], ctypes.c_void_p), ctypes.cast(grads[k], ctypes.c_void_p)),
              "ferry_add_param")
    status = lib.ferry_add_param(engine, b"a.w", b"a", shape, 1, FERRY_F32, ctypes.cast(params[0], ctypes.c_void_p),
                                 ctypes.cast(grads[0], ctypes.c_void_p))
    if status != FERRY_ALREADY_EXISTS or b"a.w" not in lib.ferry_last_error():
        raise SystemExit("a duplicate param: status %d, %r" % (status, lib.ferry_last_error()))
    check(lib.ferry_finalize(engine), "ferry_finalize")
    offloaded = []
    for name in (b"a", b"b"):
        flag = ctypes.c_int(-1)
        check(lib.ferry_group_offloaded(engine, name, ctypes.byref(flag)), "ferry_group_offloaded")
        offloaded.append(flag.value)
    if sorted(offloaded) != [0, 1]:
        raise SystemExit("expected one of the two groups offloaded, got %r" % offloaded)

    before = [list(p) for p in params]
    check(lib.ferry_step(engine, -1.0, None), "ferry_step")
    for k in range(2):
        for i in range(n):
            g = grads[k][i]
            want = before[k][i] - 0.125 * (1.0 if g > 0 else -1.0)
            if abs(params[k][i] - want) > 1e-5:
                raise SystemExit("param %d of group %d: %r after one step, expected %r" % (i, k, params[k][i], want))
    check(lib.ferry_verify_masters(engine), "ferry_verify_masters")
    lib.ferry_engine_destroy(engine)
    print("libferry %s through ctypes: one step on the host backend, groups offloaded %r: OK" % (got, offloaded))


if __name__ == "__main__":
    main()
