"""Ferry for Python: the optimizer-offload engine behind ``ferry.torch.Optimizer``.

    import ferry.torch
    opt = ferry.torch.Optimizer(model.parameters(), lr=3e-4, weight_decay=0.1, policy="offload_all")

``ferry.Engine`` is the C++ ``ferry::Engine`` itself (raw addresses, names and dtype strings; see
ferry/engine.h); ``ferry.torch`` builds a ``torch.optim.Optimizer`` on it. Errors of the engine are
``ferry.FerryError`` (a RuntimeError) or one of its subclasses, which also derive from the fitting
builtin: ``InvalidArgumentError`` and ``OutOfRangeError`` (ValueError), ``NotFoundError``
(FileNotFoundError), ``DeadlineExceededError`` (TimeoutError), ``ResourceExhaustedError``
(MemoryError), ``UnimplementedError`` (NotImplementedError). Each carries Ferry's message and, in
``.code``, the status code's name.
"""
import os

from ._ferry import (  # noqa: F401  (the package's API)
    DeadlineExceededError,
    Engine,
    FerryError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    ResourceExhaustedError,
    UnimplementedError,
    __version__,
)
from . import _config


def policy_dir():
    """The directory of Ferry's shipped Lua policies: $FERRY_POLICY_DIR, else where this package was
    built or installed with them."""
    return os.environ.get("FERRY_POLICY_DIR") or _config.POLICY_DIR


def policy_path(policy):
    """The file of `policy`: a path to a Lua file as it is, or the name of a shipped policy
    ("offload_all", "offload_fraction.lua", ...). None or "" gives "" (every group on the device)."""
    if not policy:
        return ""
    policy = os.fspath(policy)
    if os.sep in policy or os.path.exists(policy):
        return policy
    name = policy if policy.endswith(".lua") else policy + ".lua"
    path = os.path.join(policy_dir(), name)
    if not os.path.exists(path):
        shipped = sorted(f[:-4] for f in os.listdir(policy_dir()) if f.endswith(".lua")) if os.path.isdir(policy_dir()) else []
        raise FileNotFoundError("no policy file '%s' and no shipped policy '%s' in %s (shipped: %s)"
                                % (policy, name[:-4], policy_dir(), ", ".join(shipped)))
    return path
