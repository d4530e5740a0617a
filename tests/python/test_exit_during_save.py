"""A process that ends (normally, or by an exception) while an asynchronous checkpoint save is in
flight: the save's writer thread is inside a Python callback of ferry.distributed's checkpoint
protocol when the main thread finishes. Before the fix, the interpreter finalized under it and the
process died of "Fatal Python error: PyThreadState_Get" (SIGABRT; seen when kill_rank.py's survivors
exited). Now ferry waits for the save at exit (atexit, before finalization): the process ends with
its own exit code, and the save is committed."""
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=int(sys.argv[3]), world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    import ferry.torch
    from ferry import distributed as fdist
    def slowed(name):
        orig = getattr(fdist.TorchComm, name)

        def slow(self, *a):  # the writer thread's exchange: still inside Python when the main thread ends
            if self._channel.endswith("d"):
                open(sys.argv[1] + "/in-callback-" + sys.argv[3], "w").close()
                time.sleep(1.5)  # releases the GIL; takes it back after the main thread is done
            return orig(self, *a)
        setattr(fdist.TorchComm, name, slow)
    for name in ("all_reduce", "all_gather", "broadcast", "barrier"):
        slowed(name)
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(s, generator=gen).requires_grad_() for s in ((64, 33), (17,))]
    opt = ferry.torch.Optimizer(ps, lr=1e-2, shard=True, policy=sys.argv[1] + "/async.lua", collective_timeout=30,
                                checkpoint_timeout=30)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.save_checkpoint(sys.argv[1] + "/ck", 1)  # asynchronous: returns at once
    if sys.argv[2] == "raise":
        raise RuntimeError("the trainer fails with a save in flight")
""")

POLICY = """
return {
  place = function(groups, ctx) local out = {} for _, g in ipairs(groups) do out[g.name] = "cpu" end return out end,
  checkpoint = function(info, ctx) return { skip = {}, async = true, keep_last = 0 } end,
}
"""


@pytest.mark.parametrize("end", ["return", "raise"])
def test_exit_with_async_save_in_flight_commits_it(tmp_path, end):
    """Two ranks (a save of one rank runs no exchange), each its own process ending normally."""
    (tmp_path / "async.lua").write_text(POLICY)
    (tmp_path / "child.py").write_text(CHILD)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(tmp_path), end, str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    want = 0 if end == "return" else 1
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert "Fatal Python error" not in out, out
        assert p.returncode == want, "rank %d: exit code %d, expected %d:\n%s" % (rank, p.returncode, want, out)
        assert "nothing committed" not in out, "rank %d: the save in flight was dropped at exit:\n%s" % (rank, out)
        assert os.path.exists(tmp_path / ("in-callback-%d" % rank)), "rank %d's writer never ran its exchange:\n%s" % (
            rank, out)
        if end == "raise":
            assert "the trainer fails with a save in flight" in out
    latest = (tmp_path / "ck" / "latest").read_text().strip()
    assert latest.endswith("step-00000001"), latest
    assert os.path.exists(tmp_path / "ck" / "step-00000001" / "manifest.json")
