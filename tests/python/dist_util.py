"""Several ranks in one test: `run_ranks(world, fn, *args)` forks `world` processes that join a gloo
process group (a FileStore in a temporary directory: nothing leaves the machine), run
fn(rank, world, *args) and hand back its (picklable) result, or the exception it raised as a dict
{"error": class name, "mro": [class names], "message": str}. Each rank is told that the others share
its host (LOCAL_RANK, LOCAL_WORLD_SIZE, as torchrun's workers are), unless the environment says so
already.

Bounded: the whole group gets `timeout` seconds; a rank still running then is killed and the test
fails naming it (a hang fails, it never blocks CI). Children end with os._exit after reporting, so
no process-group teardown can hang either.

The ranks are forked from a fork server (multiprocessing's "forkserver": a fresh single-threaded
process that imported torch, torch.distributed and ferry once), not from the runner: a fork of a
process whose earlier tests started threads can crash, and a rank spawned afresh imports torch
again (on the 2-CPU VM a case of 2 ranks that does nothing took 0.59 s spawned). Each rank takes the
runner's environment as it is at the call (a test's monkeypatch.setenv included), not the server's.
The parent must not have joined a process group: tests that use this module do all their ferry work
in the children. A rank dies with the server, which ends with the runner (PR_SET_PDEATHSIG): a
runner killed by its timeout leaves no rank running to slow what comes after it.
"""
import datetime
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
import traceback


def _die_with_parent():
    """Linux: SIGKILL this process when its parent (the fork server) exits."""
    parent = os.getppid()
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent was gone before prctl took effect
        os._exit(5)


def _child(fn, rank, world, store, out, args, env):
    _die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # The ranks share this host, as torchrun tells its workers: each engine takes its share of the
        # host's CPUs (and pinned budget), not all of them.
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        result = {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                  "message": str(e), "traceback": traceback.format_exc()}
        code = 3
    try:
        with open(os.path.join(out, "rank-%d.tmp" % rank), "wb") as f:
            pickle.dump(result, f)
        os.rename(os.path.join(out, "rank-%d.tmp" % rank), os.path.join(out, "rank-%d.pkl" % rank))
    except BaseException:  # noqa: BLE001
        code = 4
    os._exit(code)


_FORK_SERVER = None


def _context():
    """The fork server's context, made once per runner (the server starts at its first Process)."""
    global _FORK_SERVER
    if _FORK_SERVER is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "ferry", "ferry.torch"])
        _FORK_SERVER = ctx
    return _FORK_SERVER


def run_ranks(world, fn, *args, timeout=60.0):
    """[result of rank 0, ..., rank world-1] (see the module's documentation)."""
    tmp = tempfile.mkdtemp(prefix="ferry-dist-")
    try:
        ctx = _context()
        env = dict(os.environ)
        procs = [ctx.Process(target=_child, args=(fn, r, world, os.path.join(tmp, "store"), tmp, args, env),
                             daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        late = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if late:
            raise AssertionError("ranks %s of %d still running after %.0f s (killed): a hang" % (late, world, timeout))
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, "rank-%d.pkl" % r)
            if not os.path.exists(path):
                raise AssertionError("rank %d of %d exited with %s without a result" % (r, world, p.exitcode))
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ok(results):
    """The results, after checking that no rank raised (the first error's traceback otherwise)."""
    for r, res in enumerate(results):
        if isinstance(res, dict) and "error" in res and "mro" in res:
            raise AssertionError("rank %d raised %s: %s\n%s" % (r, res["error"], res["message"], res["traceback"]))
    return results
