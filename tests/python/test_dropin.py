"""ferry.torch.Optimizer as a drop-in for torch.optim.AdamW: params without a grad of this step are
skipped as torch skips them (frozen params, a step before any backward, a layer a step did not reach
with the default zero_grad()), and the misuses a trial run found are refused at once with errors that
name the argument, param or state entry (shared memory, a state_dict of another shape, copying or
pickling the optimizer, bad cpu_threads / betas), or warned about once (a step skipped for NaN/Inf)."""
import copy
import io
import os
import warnings

import pytest
import torch

import ferry.torch
from conftest import grads_for, make_params, set_grads
from nets import assert_close_to, ulps, FP32_ULPS


class FineTune(torch.nn.Module):
    """A frozen backbone layer passed in model.parameters(), as fine-tuning scripts do."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.backbone = torch.nn.Linear(8, 16).requires_grad_(False)
        self.head_a = torch.nn.Linear(16, 1)
        self.head_b = torch.nn.Linear(16, 1)

    def groups(self, per_layer):
        """model.parameters() as one group, or a group per layer."""
        if not per_layer:
            return list(self.parameters())
        return [{"params": list(m.parameters())} for m in (self.backbone, self.head_a, self.head_b)]

    def forward(self, x, heads):
        h = torch.tanh(self.backbone(x))
        return sum(getattr(self, "head_" + name)(h) for name in heads)


def run(model, opt, steps, heads_of, set_to_none, device):
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=gen).to(device)
        y = torch.randn(16, 1, generator=gen).to(device)
        torch.nn.functional.mse_loss(model(x, heads_of(step)), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("policy", ["offload_all", None])
def test_frozen_params_and_params_without_grad_are_skipped_as_torch(device, per_layer, set_to_none, policy):
    """3 steps at lr 0.1, weight decay 0.1 (the trial's): the frozen backbone is untouched (torch too);
    head_b gets no grad on step 2 and must not move on its momentum or decay there. With one param
    group, head_b's later bias correction uses its group's step count (one more than torch's per-param
    count: documented), so it is compared with torch only with a group per layer."""
    model = FineTune().to(device)
    twin = FineTune().to(device)
    frozen = model.backbone.weight.detach().clone()
    opt = ferry.torch.Optimizer(model.groups(per_layer), lr=0.1, weight_decay=0.1, policy=policy)
    ref = torch.optim.AdamW(twin.groups(per_layer), lr=0.1, weight_decay=0.1, foreach=False)
    heads = lambda step: "a" if step == 2 else "ab"  # noqa: E731
    run(model, opt, 1, heads, set_to_none, device)
    run(twin, ref, 1, heads, True, device)
    before_b = model.head_b.weight.detach().clone()
    # Step 2: head_b has no grad.
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 8, generator=gen).to(device), torch.randn(16, 1, generator=gen).to(device)
    for m, o in ((model, opt), (twin, ref)):
        torch.nn.functional.mse_loss(m(x, "a"), y).backward()
        o.step()
        o.zero_grad(set_to_none=set_to_none if o is opt else True)
    assert torch.equal(model.head_b.weight.detach(), before_b)
    for step in (3,):
        for m, o in ((model, opt), (twin, ref)):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=gen).to(device), torch.randn(16, 1, generator=gen).to(device)
            torch.nn.functional.mse_loss(m(x, "ab"), y).backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none if o is opt else True)
    assert torch.equal(model.backbone.weight.detach(), frozen)
    assert model.backbone.weight.grad is None  # torch leaves a frozen param's grad None; so does Ferry
    if per_layer:
        assert_close_to(model, twin, scale=0.1)  # lr 0.1: each update is rounded at that size
        assert [opt.engine.group_step(g) for g in ("group0", "group1", "group2")] == [0, 3, 2]
    else:
        for name in ("backbone.weight", "backbone.bias", "head_a.weight", "head_a.bias"):
            x, y = model.get_parameter(name), twin.get_parameter(name)
            assert (x - y).abs().max().item() <= FP32_ULPS * 2.0 ** -23 * 0.1, name  # ulps at lr's scale


@pytest.mark.parametrize("policy", ["offload_all", None])
def test_step_before_any_backward_changes_nothing(device, policy):
    model = FineTune().to(device).requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    opt = ferry.torch.Optimizer(model.parameters(), lr=0.1, weight_decay=0.1, policy=policy)
    ref = torch.optim.AdamW(FineTune().to(device).parameters(), lr=0.1, weight_decay=0.1)
    opt.step()
    ref.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    assert opt.stats()["step"] == 0 and opt.state_dict()["state"] == {} and ref.state_dict()["state"] == {}
    # After zero_grad and again without backward: still nothing.
    opt.zero_grad()
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_grads_written_in_place_without_backward_warn(device):
    params = make_params(device)
    opt = ferry.torch.Optimizer(params)
    for p, g in zip(params, grads_for(params, 1)):
        p.grad.copy_(g)  # not a produced grad: no backward ran, p.grad not assigned
    with pytest.warns(UserWarning, match="written into p.grad in place"):
        opt.step()
    assert opt.stats()["step"] == 0


def test_unfrozen_later_steps_again(device):
    """A param frozen at construction and unfrozen later (gradual unfreezing) steps once it has grads."""
    model = FineTune().to(device)
    opt = ferry.torch.Optimizer(model.parameters(), lr=0.1, weight_decay=0.1)
    frozen = model.backbone.weight.detach().clone()
    run(model, opt, 1, lambda s: "ab", False, device)
    assert torch.equal(model.backbone.weight.detach(), frozen)
    model.backbone.requires_grad_(True)
    run(model, opt, 2, lambda s: "ab", False, device)
    assert not torch.equal(model.backbone.weight.detach(), frozen)
    assert opt._tracker.hooked(0)


def test_same_param_twice_or_overlapping_views_are_refused(device):
    params = make_params(device)
    # torch 1.13 only warns about a duplicate in one group (newer torch may refuse it itself).
    with pytest.raises(ValueError, match=r"param 1 .* and param 5 .* are the same tensor|duplicate"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ferry.torch.Optimizer(params + [params[1]])
    with pytest.raises(ValueError):  # in two groups: torch refuses it itself
        ferry.torch.Optimizer([{"params": params[:2]}, {"params": params[1:]}])
    base = torch.randn(40, device=device)
    a = base[0:20].detach().requires_grad_()
    b = base[10:30].detach().requires_grad_()
    with pytest.raises(ValueError, match=r"param 0 .* and param 1 .* share memory"):
        ferry.torch.Optimizer([a, b])
    # Neighbouring views of one storage do not overlap: accepted, and each steps once.
    c = base[20:40].detach().requires_grad_()
    ferry.torch.Optimizer([a, c])


def test_state_dict_of_another_shape_is_refused(device):
    params = make_params(device)
    opt = ferry.torch.Optimizer(params)
    set_grads(params, grads_for(params, 1))
    opt.step()
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"].reshape(33, 64)  # same numel, transposed shape
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has shape \(33, 64\).*"
                                         r"param 0 .* has shape \(64, 33\)"):
        opt.load_state_dict(bad)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])


def test_copying_or_pickling_the_optimizer_is_refused(device):
    params = make_params(device)
    opt = ferry.torch.Optimizer(params)
    with pytest.raises(TypeError, match="cannot be copied or pickled.*state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        torch.save(opt, io.BytesIO())
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.copy(opt)
    # The optimizer still works, and its state_dict saves.
    set_grads(params, grads_for(params, 1))
    opt.step()
    torch.save(opt.state_dict(), io.BytesIO())


def test_bad_arguments_name_the_argument(device):
    params = make_params(device)
    with pytest.raises(ValueError, match=r"cpu_threads must be an int >= 0 .*got -1"):
        ferry.torch.Optimizer(params, cpu_threads=-1)
    with pytest.raises(ValueError, match=r"trainer_threads must be an int >= 0 .*got -2"):
        ferry.torch.Optimizer(params, trainer_threads=-2)
    with pytest.raises(ValueError, match=r"trainer_threads must be an int >= 0 .*got 1.5"):
        ferry.torch.Optimizer(params, trainer_threads=1.5)
    with pytest.raises(ValueError, match=r"transfer_chunk_bytes must be an int >= 0"):
        ferry.torch.Optimizer(params, transfer_chunk_bytes=1.5)
    with pytest.raises(ValueError, match=r"betas must be a pair of numbers \(beta1, beta2\), got \(0.9,\)"):
        ferry.torch.Optimizer(params, betas=(0.9,))
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['betas'\] must be a pair"):
        ferry.torch.Optimizer([{"params": params[:2]}, {"params": params[2:], "betas": (0.9, 0.99, 0.5)}])
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1.0"):
        ferry.torch.Optimizer(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"overlap must be None"):
        ferry.torch.Optimizer(params, overlap="yes")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['weight_decay'\] must be a number >= 0"):
        ferry.torch.Optimizer([{"params": params, "weight_decay": -1.0}])


def test_a_step_skipped_for_nan_warns_once(device):
    params = make_params(device)
    opt = ferry.torch.Optimizer(params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            bad = grads_for(params, step)
            bad[1].view(-1)[0] = float("nan") if step == 1 else float("inf")
            set_grads(params, bad)
            opt.step()
    skipped = [w for w in caught if "NaN or Inf" in str(w.message)]
    assert len(skipped) == 1, [str(w.message) for w in caught]
    assert opt.stats()["skipped_steps"] == 2
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


def test_torch_adamw_with_frozen_layers_over_many_steps(device):
    """30 steps of a model with a frozen layer and a head unused every third step, against torch's
    AdamW (zero_grad(set_to_none=True)): within the fp32 bound of test_adamw_match."""
    model = FineTune(seed=4).to(device)
    twin = FineTune(seed=4).to(device)
    opt = ferry.torch.Optimizer(model.groups(True), lr=1e-2, weight_decay=0.1, policy="offload_all")
    ref = torch.optim.AdamW(twin.groups(True), lr=1e-2, weight_decay=0.1, foreach=False)
    heads = lambda step: "a" if step % 3 == 0 else "ab"  # noqa: E731
    run(model, opt, 30, heads, False, device)
    run(twin, ref, 30, heads, True, device)
    worst = max(ulps(p, q).max().item() for p, q in zip(model.parameters(), twin.parameters()))
    assert worst <= FP32_ULPS


def test_a_fraction_the_groups_cannot_give_warns_naming_the_share(device):
    """offload_fraction places whole param groups: one group with fraction 0.5 is offloaded whole
    (the warning names the share and the groups); four equal groups give the fraction, no warning."""
    layers = [torch.nn.Linear(32, 32).to(device) for _ in range(4)]
    params = [p for m in layers for p in m.parameters()]
    with pytest.warns(UserWarning, match=r"fraction=0.5, but 100% of the params are offloaded \(1 of 1 param groups\)"):
        opt = ferry.torch.Optimizer(params, policy="offload_fraction", policy_args={"fraction": 0.5})
    assert [g["offloaded"] for g in opt.placement()] == [True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = ferry.torch.Optimizer([{"params": list(m.parameters())} for m in layers], policy="offload_fraction",
                                    policy_args={"fraction": 0.5})
    assert [g["offloaded"] for g in opt.placement()] == [False, False, True, True]  # the last groups


def test_trainer_threads_leave_cpus_to_the_trainer(device):
    """The share's CPUs left to the trainer: 2 for CUDA params (Python's thread and autograd's device
    thread), 1 for CPU params, or as given; stats()["host_share"] says how many."""
    params = make_params(device)
    default = 2 if device.type == "cuda" else 1
    # One rank: the share is the process's CPUs, of which all but one at most are left to the trainer.
    cpus = len(os.sched_getaffinity(0))
    for given, left in ((None, default), (0, 0), (1, 1)):
        opt = ferry.torch.Optimizer(params, policy="offload_all", trainer_threads=given)
        share = opt.stats()["host_share"]
        expect = min(left, cpus - 1)
        if expect == 0:
            assert "left to the trainer" not in share, share
        else:
            assert "%d CPU%s of it left to the trainer's threads" % (expect, "" if expect == 1 else "s") in share, share


def test_pins_and_the_worker_cap_reach_the_engine(device):
    """pin_cpu_threads=True holds CPU Adam's workers to the rank's slice of the host (stats()["cpu_list"]),
    False leaves them free; pin_trainer_threads=False leaves this process's threads alone. Bad values name
    the argument. (cpu_threads_max changes nothing a host of 2 CPUs can show: one worker either way.)"""
    params = make_params(device)
    share = dict(policy="offload_all", local_rank=0, local_world_size=2, pin_trainer_threads=False, cpu_threads_max=1)
    held = ferry.torch.Optimizer(params, pin_cpu_threads=True, **share).stats()
    free = ferry.torch.Optimizer(params, pin_cpu_threads=False, **share).stats()
    assert held["cpu_list"] != "" and free["cpu_list"] == "", (held["cpu_list"], free["cpu_list"])
    assert held["local_world_size"] == 2 and held["cpu_threads"] == 1
    with pytest.raises(ValueError, match=r"pin_cpu_threads must be None \(the engine's rule\), True or False, not 2"):
        ferry.torch.Optimizer(params, pin_cpu_threads=2)
    with pytest.raises(ValueError, match=r"pin_trainer_threads must be None .*not 'yes'"):
        ferry.torch.Optimizer(params, pin_trainer_threads="yes")
    with pytest.raises(ValueError, match=r"cpu_threads_max must be an int >= 0 .*got -1"):
        ferry.torch.Optimizer(params, cpu_threads_max=-1)
