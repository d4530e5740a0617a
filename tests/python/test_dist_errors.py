"""Failures across ranks (gloo, host backend): nothing hangs, and every rank's error names the rank at
fault. A rank raising inside step() (in the engine's all-reduce, or in the ZeRO-1 all-gather after
the engine's step) makes every other rank raise a FerryError naming it long before the timeout; a
rank that never arrives makes the others raise DeadlineExceededError naming it; registrations that
differ between ranks (a param missing, another shape, another dtype) are refused on every rank
naming the rank and the param."""
import time

import pytest
import torch

import dist_util

TIMEOUT = 20.0  # the optimizer's collective timeout in the abort tests: they must end far sooner


def params(rank, shapes=((40, 9), (33,), (6,)), dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def fill_grads(ps, step):
    with torch.no_grad():
        for i, p in enumerate(ps):
            gen = torch.Generator().manual_seed(100 * step + i)
            p.grad = torch.randn(p.shape, generator=gen)  # an assigned grad (in-place writes are not seen)


def timed_step(opt):
    """One clipped step: its time, and the error it raised (name, classes, message), if any."""
    start = time.monotonic()
    try:
        opt.step(max_grad_norm=1.0)
    except Exception as e:
        return {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e),
                "seconds": time.monotonic() - start}
    return {"seconds": time.monotonic() - start}


def raise_mid_step(rank, world, where, bad_rank, timeout):
    import ferry.torch
    ps = params(rank)
    opt = ferry.torch.Optimizer(ps, lr=1e-2, shard=True, policy="offload_all", collective_timeout=timeout)
    fill_grads(ps, 0)
    opt.step(max_grad_norm=1.0)  # one good step first
    if rank == bad_rank:
        if where == "engine":  # inside the C++ step: its grad-check all-reduce
            def boom(values, op, timeout_s):
                raise ValueError("injected failure in all_reduce")
            opt._zero.comm.all_reduce = boom
        else:  # after the engine's step, in the all-gather of the params
            def boom(*args):
                raise ValueError("injected failure in the all-gather")
            opt._zero._all_gather_flat = boom
    fill_grads(ps, 1)
    return timed_step(opt)


@pytest.mark.parametrize("where", ["engine", "gather"])
def test_rank_raising_in_step_fails_every_rank_naming_it(where):
    world, bad = 3, 1
    results = dist_util.run_ranks(world, raise_mid_step, where, bad, TIMEOUT, timeout=60)
    for rank, res in enumerate(results):
        assert "error" in res, "rank %d did not raise: %r" % (rank, res)
        assert res["seconds"] < TIMEOUT / 2, "rank %d waited %.1f s (the abort should be seen at once)" % (
            rank, res["seconds"])
        if rank != bad:
            assert "FerryError" in res["mro"], res
            assert "rank %d of %d failed" % (bad, world) in res["message"], res["message"]
            assert "injected failure" in res["message"], res["message"]
    # The failing rank raises its own error (from the engine's callback: a FerryError).
    assert "injected failure" in results[bad]["message"]
    assert ("FerryError" if where == "engine" else "ValueError") in results[bad]["mro"]


def late_rank(rank, world, late, timeout):
    import ferry.torch
    ps = params(rank)
    opt = ferry.torch.Optimizer(ps, lr=1e-2, shard=True, collective_timeout=timeout)
    fill_grads(ps, 0)
    if rank == late:
        time.sleep(timeout * 3)
    return timed_step(opt)


def test_rank_that_never_arrives_is_named_after_the_timeout():
    world, late, timeout = 3, 2, 4.0  # seconds; generous bounds below: CI runs this beside other tests
    results = dist_util.run_ranks(world, late_rank, late, timeout, timeout=60)
    for rank, res in enumerate(results):
        assert "error" in res, "rank %d did not raise: %r" % (rank, res)
        assert "FerryError" in res["mro"], res
        if rank != late:
            assert "DeadlineExceededError" in res["mro"] and "TimeoutError" in res["mro"], res
            assert "rank %d of %d did not arrive" % (late, world) in res["message"], res["message"]
            assert timeout * 0.9 <= res["seconds"] < timeout + 15, res["seconds"]
        else:
            # It comes late: the others gave up and said so; it fails at once naming them.
            assert res["seconds"] < timeout, res["seconds"]
            assert "rank 0 of 3 failed" in res["message"] and "rank 1 of 3 failed" in res["message"], res["message"]


def mismatched(rank, world, case):
    import ferry.torch
    shapes = [(40, 9), (33,), (6,)]
    dtypes = [torch.float32] * 3
    if rank == 1:
        if case == "missing":
            shapes = shapes[:2]
        elif case == "shape":
            shapes[1] = (34,)
        elif case == "dtype":
            dtypes[1] = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen).to(d).requires_grad_() for s, d in zip(shapes, dtypes)]
    groups = [{"params": [p]} for p in ps]  # a group per param: a dtype may differ per group
    ferry.torch.Optimizer(groups, lr=1e-2, shard=True, collective_timeout=TIMEOUT)
    return "constructed"


@pytest.mark.parametrize("case,param", [("missing", "p2"), ("shape", "p1"), ("dtype", "p1")])
def test_mismatched_registration_refused_on_every_rank(case, param):
    results = dist_util.run_ranks(2, mismatched, case, timeout=60)
    for rank, res in enumerate(results):
        assert isinstance(res, dict) and "error" in res, "rank %d accepted a mismatched registration" % rank
        assert "FerryError" in res["mro"], res
        assert "rank 1" in res["message"] and "'%s'" % param in res["message"], res["message"]


class _NeverDone:
    """A collective that never completes and never fails: NCCL's, when a peer has died."""

    def is_completed(self):
        return False

    def wait(self):
        raise AssertionError("waited on a collective that never completes")


def wait_for_a_dead_peer(rank, world, timeout):
    import torch.distributed as dist
    import ferry.torch
    opt = ferry.torch.Optimizer(params(rank), lr=1e-2, shard=True, collective_timeout=timeout)
    dist.barrier()
    if rank != 0:
        return "left"  # this process exits: rank 0's collective can no longer complete
    start = time.monotonic()
    try:
        opt._zero.comm.run("an all-gather on the GPU", lambda: _NeverDone(), timeout)
    except Exception as e:
        return {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e),
                "seconds": time.monotonic() - start}
    return {"seconds": time.monotonic() - start}


def test_a_collective_that_never_fails_names_a_dead_peer_long_before_the_timeout():
    # An NCCL collective waits forever when a peer dies; the host's poll looks the peers' processes up.
    world, timeout = 2, 30.0
    results = dist_util.run_ranks(world, wait_for_a_dead_peer, timeout, timeout=60)
    assert results[1] == "left"
    res = results[0]
    assert "error" in res, res
    assert "FerryError" in res["mro"], res
    assert "rank 1 of 2 is gone" in res["message"], res["message"]
    assert res["seconds"] < 5.0, res["seconds"]  # a quarter second's poll, and the exit's own time


class _DoneAt:
    """A collective that completes at a given time (its peer did its part, then exited)."""

    def __init__(self, at):
        self.at = at

    def is_completed(self):
        return time.monotonic() >= self.at

    def wait(self):
        pass


def peer_leaves_after_its_part(rank, world):
    import torch.distributed as dist
    import ferry.torch
    opt = ferry.torch.Optimizer(params(rank), lr=1e-2, shard=True, collective_timeout=30.0)
    dist.barrier()
    if rank != 0:
        return "left"
    time.sleep(1.0)  # the peer has exited (its process is gone) before this rank's work completes
    start = time.monotonic()
    # Completes after the first look for lost peers (0.25 s), within the grace that look gives it.
    opt._zero.comm.run("a collective the peer finished", lambda: _DoneAt(start + 0.3), 30.0)
    return {"seconds": time.monotonic() - start}


def test_a_peer_that_exits_after_its_part_is_not_called_lost():
    results = dist_util.run_ranks(2, peer_leaves_after_its_part, timeout=60)
    assert results[1] == "left"
    assert "error" not in results[0], results[0]
    assert 0.29 <= results[0]["seconds"] < 5.0, results[0]


def grad_check_on(rank, world, on_trainers_group, steps=4):
    """Clipped ZeRO-1 steps; the gradient check's all-reduce on Ferry's gloo group or on the trainer's
    (reduce_on, as an NCCL group of CUDA params gets; here the world's gloo group on the CPU). Returns
    the params' bits, the norms, and the groups the float64 all-reduces ran on."""
    import torch.distributed as dist
    import ferry.torch
    ps = params(rank)
    opt = ferry.torch.Optimizer(ps, lr=1e-2, shard=True, policy="offload_all", collective_timeout=TIMEOUT)
    comm = opt._zero.comm
    if on_trainers_group:
        comm.reduce_on(dist.group.WORLD, torch.device("cpu"))
    seen, orig = [], dist.all_reduce

    def spy(t, *a, group=None, **k):
        if t.dtype == torch.float64:
            seen.append("trainer" if group in (None, dist.group.WORLD) else
                        "ferry" if group is comm.group else "other")
        return orig(t, *a, group=group, **k)
    dist.all_reduce = spy
    norms = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own grads
        with torch.no_grad():
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen) * (1 + step)
        opt.step(max_grad_norm=45.0)  # reached at some steps (norms about 20, 40, 55, 80), not at others
        norms.append(opt.stats()["last_grad_norm"])
        dist.all_reduce(torch.zeros(3))  # a collective of the trainer's between the engine's
    dist.all_reduce = orig
    return {"bits": [p.detach().view(torch.int32).clone() for p in ps], "norms": norms, "seen": seen,
            "on": comm.reduces_on}


def test_the_grad_check_on_the_trainers_group_is_exact():
    world = 3
    mine = dist_util.run_ranks(world, grad_check_on, False, timeout=60)
    theirs = dist_util.run_ranks(world, grad_check_on, True, timeout=60)
    for rank in range(world):
        assert mine[rank]["seen"] == ["ferry"] * 4 and mine[rank]["on"] == "gloo", mine[rank]
        assert theirs[rank]["seen"] == ["trainer"] * 4 and theirs[rank]["on"] == "cpu", theirs[rank]
        assert theirs[rank]["norms"] == mine[rank]["norms"] == mine[0]["norms"]
        for a, b in zip(theirs[rank]["bits"], mine[rank]["bits"]):
            assert torch.equal(a, b)
    # Some steps clipped: the reduced norm decided the multiplier.
    assert min(mine[0]["norms"]) < 45.0 < max(mine[0]["norms"]), mine[0]["norms"]
