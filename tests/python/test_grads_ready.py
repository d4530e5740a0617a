"""ferry.torch.Optimizer.grads_ready: starting the step of param groups during backward gives the same
bits as step() alone, with clipping triggered in some steps, a NaN grad in one, an lr schedule and
groups announced in reverse order or not at all; misuses are clear errors."""
import pytest
import torch

import ferry.torch

from conftest import clone_params, grads_for, groups_of, make_params, set_grads


def make_pair(device, policy, dtype=torch.bfloat16):
    a = clone_params(make_params(device, seed=9), dtype)
    b = clone_params(a)
    opts = [ferry.torch.Optimizer(groups_of(p), policy=policy, max_grad_norm=80.0, transfer_chunk_bytes=1024)
            for p in (a, b)]
    return a, b, opts


@pytest.mark.parametrize("policy", ["offload_all", "all_gpu"])
def test_grads_ready_is_bit_identical_to_step_alone(device, policy):
    early_params, plain_params, (early, plain) = make_pair(device, policy)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s)) for o in (early, plain)]
    for step in range(1, 31):
        grads = grads_for(early_params, step)
        scale = 8.0 if step % 3 == 0 else 1.0  # every third step clips (norm ~ 48 * scale vs 80)
        grads = [g * scale for g in grads]
        if step == 7:
            grads[1].view(-1)[0] = float("nan")  # the whole step is skipped
        set_grads(early_params, grads)
        set_grads(plain_params, grads)
        if step % 5 != 0:  # and sometimes nothing is announced
            for gi in reversed(range(len(early.param_groups))):
                if (gi + step) % 4 != 0:  # some groups left to step()
                    early.grads_ready(gi)
        early.step()
        plain.step()
        for s in scheds:
            s.step()
        for a, b in zip(early_params, plain_params):
            assert torch.equal(a.detach().cpu(), b.detach().cpu()), "step %d" % step
    assert early.stats()["skipped_steps"] == plain.stats()["skipped_steps"] == 1
    if policy == "offload_all":
        stats = early.stats()
        assert stats["early_groups_kept"] > 0 and stats["early_groups_recomputed"] > 0, stats


def test_grads_ready_misuses(device):
    params, _, (opt, _) = make_pair(device, "offload_all")
    set_grads(params, grads_for(params, 1))
    with pytest.raises(IndexError):
        opt.grads_ready(7)
    opt.grads_ready(0)
    with pytest.raises(ValueError, match="already announced"):
        opt.grads_ready(0)
    with pytest.raises(RuntimeError, match="call Step first"):
        opt.save_checkpoint("/nonexistent-root-not-used", 1)
    opt.step()  # completes the step; announcing again begins the next one
    opt.grads_ready()
    opt.step()
    params[0].grad = None
    with pytest.raises(RuntimeError, match="has no grad"):
        opt.grads_ready(0)
