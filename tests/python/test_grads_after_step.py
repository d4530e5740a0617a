"""What a trainer may do with the grads after a deferred step (ferry.torch.Optimizer.attach()): the
step's update reads each bucket's grads beside the next forward, until that forward's pre-hook waits
for the bucket.

  * the ways to zero that leave the grads alone until then (opt.zero_grad() in place and with
    set_to_none=True, model.zero_grad(set_to_none=True), opt.wait_params() before an in-place zero,
    and no zeroing at all, the next backward accumulating) give the bits of the same loop without
    attach(), every step, every step deferred;
  * an in-place change before the wait (model.zero_grad(set_to_none=False), torch 1.13's default;
    one p.grad.mul_) raises at the wait of the module whose params changed, naming those params and
    no other: the update may have read the changed values.

Fresh random batches every step; each param is a bucket of its own (bucket_mb tiny), one param group
as model.parameters() gives it.
"""
import pytest
import torch

import ferry.torch
from nets import assert_same_bits

STEPS = 5
DIMS = (10, 24, 24, 3)


def make(device, attach):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in zip(DIMS[:-1], DIMS[1:])]
    model = torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1], torch.nn.Tanh(), layers[2]).to(device)
    opt = ferry.torch.Optimizer(model.parameters(), lr=1e-2, weight_decay=0.1, policy="offload_all",
                                overlap=True, bucket_mb=1e-7, transfer_chunk_bytes=1024)
    return model, opt.attach(model) if attach else opt


def loss_of(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, DIMS[0], generator=gen), torch.randn(16, DIMS[-1], generator=gen)
    return torch.nn.functional.mse_loss(model(x.to(model[0].weight.device)), y.to(model[0].weight.device))


def zero(how, model, opt):
    if how == "opt":
        opt.zero_grad()
    elif how == "opt_none":
        opt.zero_grad(set_to_none=True)
    elif how == "model_none":
        model.zero_grad(set_to_none=True)
    elif how == "wait_then_in_place":
        opt.wait_params()
        model.zero_grad(set_to_none=False)
    else:
        assert how == "none"  # the next backward adds to these grads, as in torch


@pytest.mark.parametrize("how", ["opt", "opt_none", "model_none", "wait_then_in_place", "none"])
def test_zeroing_that_leaves_the_grads_to_the_update_keeps_the_bits(device, how):
    (model, opt), (ref, ref_opt) = make(device, attach=True), make(device, attach=False)
    for step in range(STEPS):
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_of(m, step).backward()
            o.step()
            zero(how, m, o)
        opt.wait_params()
        assert_same_bits(model, ref, "%s, step %d" % (how, step))
    assert opt.stats()["deferred_steps"] == STEPS and ref_opt.stats()["deferred_steps"] == 0


def first_error(model, opt, change):
    """Steps until the forward after `change` (called after the second step) raises; its message."""
    for step in range(3):
        try:
            loss_of(model, step).backward()
        except RuntimeError as e:
            assert step == 2, "step %d raised: %s" % (step, e)
            return str(e)
        opt.step()
        opt.zero_grad()
        if step == 1:
            change(model)
    raise AssertionError("no error after the change")


def test_a_grad_changed_in_place_before_its_wait_is_named(device):
    model, opt = make(device, attach=True)
    message = first_error(model, opt, lambda m: m.zero_grad(set_to_none=False))
    assert message.startswith("ferry.torch.Optimizer: the grads of param 0 (param_groups[0]['params'][0]), "
                              "param 1 (param_groups[0]['params'][1]) were changed in place after step()"), message
    assert "set_to_none" in message and "opt.wait_params()" in message and "param 2 " not in message, message
    # One grad only, of the last layer: the first two layers' waits pass, the last one's names it alone.
    model, opt = make(device, attach=True)
    message = first_error(model, opt, lambda m: m[4].weight.grad.mul_(0.5))
    assert message.startswith("ferry.torch.Optimizer: the grad of param 4 (param_groups[0]['params'][4]) "
                              "was changed in place after step()"), message
    assert "param 5" not in message and "param 0" not in message, message


def test_a_backward_into_grads_the_update_may_read_waits_first(device):
    """A forward that skips a module's pre-hook after a deferred step (as code torch.compile compiled
    without the hooks runs) and no zeroing: the backward's accumulation into that module's grads,
    which the update may still read, waits for the update first (the param's grad hook), so no grad
    changes under it and no error is raised; step() warns that the forward may have read params
    before their update (test_overlap.py checks that warning)."""
    from test_overlap import Functional
    net = Functional().to(device)
    opt = ferry.torch.Optimizer(list(net.parameters()), lr=1e-2, policy="offload_all", overlap=True,
                                bucket_mb=1e-7, transfer_chunk_bytes=1024).attach(net)
    net.b.weight.requires_grad_(False)  # b's forward never runs: only a's params step
    gen = torch.Generator().manual_seed(4)
    with pytest.warns(RuntimeWarning, match="may have read"):
        for step in range(3):
            net.bypass = step == 2
            net(torch.randn(16, 8, generator=gen).to(device)).square().mean().backward()
            opt.step()
    assert opt.stats()["deferred_steps"] == 2
