"""consumer.python.package: the installed `ferry` Python package imports from the install tree, finds
the installed policies, and trains a step with ferry.torch.Optimizer (host backend).

    PYTHONPATH=<prefix>/<site dir> python3 python_package.py PREFIX
"""
import os
import sys

import torch

import ferry
import ferry.torch


def main():
    prefix = os.path.realpath(sys.argv[1])
    for what, path in (("the package", ferry.__file__), ("the policies", ferry.policy_dir())):
        if not os.path.realpath(path).startswith(prefix + os.sep):
            raise SystemExit("%s come from %s, not from the install tree %s" % (what, path, prefix))
    p = torch.ones(10, requires_grad=True)
    opt = ferry.torch.Optimizer([p], lr=0.5, weight_decay=0.0, policy="offload_all")
    p.grad = torch.full_like(p, 2.0)  # a grad of this step (as a backward would produce)
    opt.step()
    # Adam's first step moves every param by lr against the sign of its grad.
    if not torch.allclose(p.detach(), torch.full((10,), 0.5)):
        raise SystemExit("unexpected params after one step: %s" % p)
    if not all(g["offloaded"] for g in opt.placement()):
        raise SystemExit("offload_all did not offload: %s" % opt.placement())
    print("ferry %s from %s: one offloaded step OK" % (ferry.__version__, os.path.dirname(ferry.__file__)))


if __name__ == "__main__":
    main()
