"""Shared fixtures of the ferry.torch suites.

FERRY_TEST_DEVICE selects the tensors' device: "cpu" (default: Ferry's host backend) or "cuda"
(skipped when torch sees no GPU). The same suites run on both.
"""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """FERRY_TEST_DEVICE=cuda (the python.cuda.* ctest variants) without a GPU: every test skips, the
    suites that start their own ranks included (they do not take the `device` fixture and would rerun
    their CPU cases)."""
    name = os.environ.get("FERRY_TEST_DEVICE", "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="FERRY_TEST_DEVICE=%s but torch sees no CUDA device" % name)
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    name = os.environ.get("FERRY_TEST_DEVICE", "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("FERRY_TEST_DEVICE=%s but torch sees no CUDA device" % name)
    return torch.device(name)


@pytest.fixture
def tmp_root(tmp_path):
    return str(tmp_path / "ckpt")


def make_params(device, dtype=torch.float32, seed=0, shapes=((64, 33), (33,), (17, 5), (5,), (40,))):
    """Fresh random params (leaf tensors that require grad)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def clone_params(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def grads_for(params, step, seed=1):
    """Step `step`'s grads: fresh normal values per param (never zeros), as the params' dtype."""
    out = []
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(seed * 1000003 + step * 101 + i)
        out.append(torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype))
    return out


def set_grads(params, grads):
    """Gives each param its grad of this step by assigning p.grad (a grad produced for the step, as a
    backward's is; ferry.torch does not see grads written into p.grad in place without a backward)."""
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = g.clone()


def groups_of(params):
    """Three param groups with their own lr and weight decay."""
    return [
        {"params": params[0:2], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[2:4], "lr": 3e-3, "weight_decay": 0.0},
        {"params": params[4:], "lr": 5e-3, "weight_decay": 0.02},
    ]
