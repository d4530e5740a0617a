"""State in and out of ferry.torch.Optimizer: torch's state_dict round trip (ferry -> ferry, torch AdamW
-> ferry, ferry -> torch AdamW), Ferry's checkpoints (a bit-identical resume), sync_from_model, params
without grads (skipped as torch skips them) and zero_grad's two modes."""
import io

import pytest
import torch

import ferry.torch
from conftest import clone_params, grads_for, groups_of, make_params, set_grads
from test_adamw_match import FP32_ULPS, ulps


def train(opt, params, steps, first=1, sched=None):
    for step in range(first, first + steps):
        set_grads(params, grads_for(params, step))
        opt.step()
        if sched is not None:
            sched.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_bit_identically(device, dtype):
    a = clone_params(make_params(device, seed=11), dtype)
    oa = ferry.torch.Optimizer(groups_of(a), policy="offload_fraction", policy_args={"fraction": 0.5})
    train(oa, a, 10)
    sd = roundtrip(oa.state_dict())
    assert sorted(sd["state"]) == list(range(len(a)))
    assert float(sd["state"][0]["step"]) == 10.0
    assert sd["state"][2]["exp_avg"].shape == a[2].shape and sd["state"][2]["exp_avg"].dtype == torch.float32
    assert ("master" in sd["state"][0]) == (dtype != torch.float32)
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3], [4]]
    assert sd["param_groups"][1]["lr"] == 3e-3 and sd["param_groups"][0]["weight_decay"] == 0.1

    b = clone_params(a)
    ob = ferry.torch.Optimizer(groups_of(b), policy=None)  # another placement: the state moves across
    ob.load_state_dict(sd)
    assert ob.state_dict()["state"][4]["exp_avg_sq"].equal(sd["state"][4]["exp_avg_sq"])
    train(oa, a, 10, first=11)
    train(ob, b, 10, first=11)
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach())


def test_loads_torch_adamw_state_dict_and_torch_loads_ferrys(device):
    ref_params = make_params(device, seed=12)
    ref = torch.optim.AdamW(groups_of(ref_params), foreach=False)
    train(ref, ref_params, 10)
    mine = clone_params(ref_params)
    opt = ferry.torch.Optimizer(groups_of(mine), policy="offload_all")
    opt.load_state_dict(roundtrip(ref.state_dict()))
    assert opt.engine.group_step("group1") == 10
    # And back: torch's AdamW continues from Ferry's state dict.
    back_params = clone_params(ref_params)
    back = torch.optim.AdamW(groups_of(back_params), foreach=False)
    back.load_state_dict(roundtrip(opt.state_dict()))
    for g in back.param_groups:
        g["foreach"] = False  # the same implementation as `ref` (torch 2.x may default to foreach on CUDA)
    for o, ps in ((ref, ref_params), (opt, mine), (back, back_params)):
        train(o, ps, 20, first=11)
    for x, y, z in zip(ref_params, mine, back_params):
        assert ulps(x, y).max().item() <= FP32_ULPS
        assert torch.equal(x.detach(), z.detach())  # torch -> ferry -> torch keeps every bit of the state


def test_load_state_dict_refuses_mismatches_and_changes_nothing(device):
    a = make_params(device, seed=13)
    opt = ferry.torch.Optimizer(groups_of(a))
    train(opt, a, 2)
    sd = opt.state_dict()
    bad = roundtrip(sd)
    bad["param_groups"] = bad["param_groups"][:2]
    with pytest.raises(ValueError, match="number of parameter groups"):
        opt.load_state_dict(bad)
    bad = roundtrip(sd)
    bad["param_groups"][2]["eps"] = 1e-5  # fixed at construction (lr, betas and weight decay are not)
    with pytest.raises(ValueError, match=r"param_groups\[2\]\['eps'\]"):
        opt.load_state_dict(bad)
    bad = roundtrip(sd)
    bad["state"][3]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match="elements"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for k in sd["state"]:
        assert torch.equal(after["state"][k]["exp_avg"], sd["state"][k]["exp_avg"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_resume_is_bit_identical(device, dtype, tmp_root):
    a = clone_params(make_params(device, seed=14), dtype)
    oa = ferry.torch.Optimizer(groups_of(a), policy="offload_fraction", policy_args={"fraction": 0.5})
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1.0 / (1 + s))
    train(oa, a, 10, sched=sa)
    d = oa.save_checkpoint(tmp_root, 10)
    oa.wait_checkpoint()
    # The schedule is the trainer's to save: the scheduler's state and the groups' current lrs (which
    # torch keeps in the optimizer's state_dict, Ferry's checkpoint does not).
    sched_state = roundtrip({"sched": sa.state_dict(), "lr": [g["lr"] for g in oa.param_groups]})
    train(oa, a, 10, first=11, sched=sa)

    b = clone_params(make_params(device, seed=99), dtype)  # other values: the checkpoint replaces them
    ob = ferry.torch.Optimizer(groups_of(b), policy="offload_fraction", policy_args={"fraction": 0.5})
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda s: 1.0 / (1 + s))
    assert ob.load_checkpoint(tmp_root) == d
    sb.load_state_dict(sched_state["sched"])
    for g, lr in zip(ob.param_groups, sched_state["lr"]):
        g["lr"] = lr
    assert ob.stats()["step"] == 10
    train(ob, b, 10, first=11, sched=sb)
    for x, y in zip(a, b):
        assert torch.equal(x.detach(), y.detach())
    ob.engine.verify_masters()


def test_sync_from_model(device):
    a = clone_params(make_params(device, seed=15), torch.bfloat16)
    opt = ferry.torch.Optimizer(groups_of(a), policy="offload_all")
    train(opt, a, 3)
    new = clone_params(make_params(device, seed=16), torch.bfloat16)
    with torch.no_grad():
        for p, n in zip(a, new):
            p.copy_(n)  # as model.load_state_dict does
    opt.sync_from_model(reset_optimizer=True)
    fresh = clone_params(new)
    of = ferry.torch.Optimizer(groups_of(fresh), policy="offload_all")
    train(opt, a, 2, first=50)
    train(of, fresh, 2, first=50)
    for x, y in zip(a, fresh):
        assert torch.equal(x.detach(), y.detach())


def test_params_without_grads_are_skipped_as_torch_does(device):
    mine = make_params(device, seed=17)
    ref_params = clone_params(mine)
    opt = ferry.torch.Optimizer(groups_of(mine), policy="offload_fraction", policy_args={"fraction": 0.5})
    ref = torch.optim.AdamW(groups_of(ref_params), foreach=False)
    for step in range(1, 31):
        for ps in (mine, ref_params):
            grads = grads_for(ps, step)
            set_grads(ps, grads)
            if 5 <= step < 9:  # group 1 (params 2, 3) has no grads: skipped whole
                for p in ps[2:4]:
                    p.grad = None
        before = mine[2].detach().clone()
        opt.step()
        ref.step()
        if 5 <= step < 9:
            assert torch.equal(mine[2].detach(), before)
    assert opt.engine.group_step("group1") == 26 and opt.engine.group_step("group0") == 30
    for x, y in zip(mine, ref_params):
        assert ulps(x, y).max().item() <= FP32_ULPS
    # Part of a group: the param keeps its value and moments; the others step.
    sd = opt.state_dict()
    set_grads(mine, grads_for(mine, 40))
    mine[0].grad = None
    kept = mine[0].detach().clone()
    opt.step()
    assert torch.equal(mine[0].detach(), kept)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    assert not torch.equal(opt.state_dict()["state"][1]["exp_avg"], sd["state"][1]["exp_avg"])
    # Nothing has a grad: no step at all.
    opt.zero_grad(set_to_none=True)
    opt.step()
    assert opt.stats()["step"] == 31


def test_zero_grad_modes_and_backward(device):
    """Backward accumulates into the optimizer's buffers; zero_grad() zeroes them in place;
    zero_grad(set_to_none=True) gives torch's None grads, copied into the buffers at step()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    twin.load_state_dict(model.state_dict())
    o1 = ferry.torch.Optimizer(model.parameters(), lr=1e-2)
    o2 = ferry.torch.Optimizer(twin.parameters(), lr=1e-2)
    buffers = [p.grad for p in model.parameters()]
    x = torch.randn(32, 8, device=device)
    y = torch.randn(32, 1, device=device)
    for _ in range(5):
        for m, o, none in ((model, o1, False), (twin, o2, True)):
            o.zero_grad(set_to_none=none)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
    assert all(p.grad is b for p, b in zip(model.parameters(), buffers))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.detach(), q.detach())
    o1.zero_grad()
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
    # step(closure) as torch: the closure's loss is returned.
    def closure():
        o1.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    assert float(o1.step(closure)) > 0.0
