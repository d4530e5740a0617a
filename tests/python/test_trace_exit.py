"""The trace of an optimizer that is never destroyed is still written: at the interpreter's exit, and
when the script ends by an exception. Each case runs a fresh interpreter (the exit is what is tested)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, sys, torch, ferry.torch
    device = torch.device(sys.argv[2])
    params = [torch.randn(300, 7, device=device).requires_grad_(), torch.randn(11, device=device).requires_grad_()]
    opt = ferry.torch.Optimizer(params, lr=1e-3, policy="offload_all", trace_path=sys.argv[1])
    # A reference nothing ever drops (as a hook held by C++ autograd state can be): the optimizer and
    # its engine outlive the interpreter's shutdown, so no destructor writes the trace.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(opt))
    for step in range(2):
        opt.zero_grad()
        ((params[0] * torch.randn_like(params[0])).sum() + (params[1] ** 2).sum()).backward()
        opt.step()
    if sys.argv[3] == "raise":
        raise RuntimeError("the training script failed")
    """)


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_trace_is_written_when_the_optimizer_outlives_the_interpreter(tmp_path, device, how):
    path = str(tmp_path / ("trace-%s.json" % how))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), path, str(device), how], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    if how == "raise":
        assert done.returncode == 1 and "the training script failed" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr
    assert "trace written at exit" in done.stderr, done.stderr
    with open(path) as f:
        trace = json.load(f)
    steps = [e for e in trace["traceEvents"] if e.get("name") == "step" and e.get("ph") == "X"]
    assert len(steps) == 2
