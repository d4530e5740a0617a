"""Errors of ferry.torch.Optimizer: Python exceptions that name the param, group or file at fault,
raised before anything changed."""
import pytest
import torch

import ferry
import ferry.torch
from conftest import grads_for, groups_of, make_params, set_grads


def leaf(t):
    return t.detach().requires_grad_()


def test_non_contiguous_param(device):
    ok = make_params(device)
    bad = leaf(torch.randn(6, 4, device=device).t())
    with pytest.raises(ValueError, match=r"param 5 \(param_groups\[0\]\['params'\]\[5\]\) is not contiguous"):
        ferry.torch.Optimizer(ok + [bad])


def test_param_on_another_device(device):
    other = torch.device("meta") if device.type == "cpu" else torch.device("cpu")
    params = make_params(device) + [leaf(torch.empty(3, device=other))]
    with pytest.raises(ValueError, match=r"param 5 .* is on %s" % other.type):
        ferry.torch.Optimizer(params)
    with pytest.raises(ValueError, match=r"is on meta: Ferry takes CPU tensors"):
        ferry.torch.Optimizer([leaf(torch.empty(3, device="meta"))])


def test_unsupported_dtype(device):
    params = make_params(device) + [leaf(torch.randn(4, dtype=torch.float64, device=device))]
    with pytest.raises(TypeError, match=r"param 5 .* has dtype torch.float64"):
        ferry.torch.Optimizer(params)


def test_empty_and_bad_arguments(device):
    with pytest.raises(ValueError, match="empty parameter list"):
        ferry.torch.Optimizer([])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        ferry.torch.Optimizer(make_params(device), lr=-1.0)
    with pytest.raises(FileNotFoundError, match="no shipped policy 'no_such_policy'"):
        ferry.torch.Optimizer(make_params(device), policy="no_such_policy")


def test_policy_error_is_a_ferry_error_with_its_message(device, tmp_path):
    bad = tmp_path / "bad.lua"
    bad.write_text("return { place = function(groups, ctx) error('no room at the inn') end }\n")
    with pytest.raises(ferry.FerryError, match="no room at the inn") as info:
        ferry.torch.Optimizer(make_params(device), policy=str(bad))
    assert isinstance(info.value, RuntimeError) and info.value.code


def test_params_changed_after_construction(device):
    params = make_params(device)
    opt = ferry.torch.Optimizer(params)
    params[2].data = torch.randn(17, 5, device=device)  # new storage, as model.to() or re-init can do
    set_grads(params, grads_for(params, 1))
    with pytest.raises(RuntimeError, match=r"param 2 \(param_groups\[0\]\['params'\]\[2\]\) changed after"):
        opt.step()
    params = make_params(device)
    opt = ferry.torch.Optimizer(params)
    opt.param_groups[0]["params"].append(leaf(torch.randn(3, device=device)))
    with pytest.raises(RuntimeError, match="has 6 params, the optimizer was built with 5"):
        opt.step()
    with pytest.raises(RuntimeError, match="add_param_group after construction"):
        opt.add_param_group({"params": [leaf(torch.randn(3, device=device))]})


def test_fixed_group_settings_changed(device):
    params = make_params(device)
    opt = ferry.torch.Optimizer(groups_of(params))
    opt.param_groups[1]["eps"] = 1e-6
    set_grads(params, grads_for(params, 1))
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['eps'\] changed from 1e-08 to 1e-06"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    # betas and weight decay may change per step (schedulers), to values in their ranges only
    opt = ferry.torch.Optimizer(groups_of(params))
    for bad in ((1.0, 0.999), (0.9,), "x"):
        opt.param_groups[1]["betas"] = bad
        with pytest.raises(ValueError, match=r"param_groups\[1\]\['betas'\]"):
            opt.step()
    opt.param_groups[1]["betas"] = (0.9, 0.999)
    for bad in (-0.1, float("nan"), "x"):
        opt.param_groups[2]["weight_decay"] = bad
        with pytest.raises(ValueError, match=r"param_groups\[2\]\['weight_decay'\] must be a number >= 0, got"):
            opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


def test_engine_errors_map_to_python_exceptions(device, tmp_path):
    params = make_params(device)
    opt = ferry.torch.Optimizer(groups_of(params))
    opt.param_groups[2]["lr"] = float("nan")
    set_grads(params, grads_for(params, 1))
    with pytest.raises(ValueError, match="group 'group2'") as info:
        opt.step()
    assert isinstance(info.value, ferry.InvalidArgumentError) and info.value.code == "INVALID_ARGUMENT"
    assert opt.stats()["step"] == 0
    with pytest.raises(ValueError, match="loss_scale"):
        opt.param_groups[2]["lr"] = 1e-3
        opt.step(loss_scale=0.0)
    with pytest.raises(FileNotFoundError) as info:
        opt.load_checkpoint(str(tmp_path / "nothing-here"))
    assert isinstance(info.value, ferry.FerryError)
    with pytest.raises(ValueError, match="unknown state kind 'moment'"):
        opt.engine.read_state("p0", "moment", 0)


@pytest.mark.parametrize("field, value, message", [
    ("pin_cpu_threads", 2, "EngineOptions::pin_cpu_threads is 2"),
    ("pin_trainer_threads", -3, "EngineOptions::pin_trainer_threads is -3"),
    ("spare_state_fraction", 1.5, "EngineOptions::spare_state_fraction is 1.5"),
    ("local_rank", 1, "EngineOptions::local_rank is 1 and local_world_size is -1"),
    ("numa", "nearest", "EngineOptions::numa: unknown NUMA policy 'nearest'"),
    ("device_ordinal", -1, "EngineOptions::device_ordinal is -1"),
])
def test_engine_options_out_of_range_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ferry.Engine(device="host", **{field: value})


def test_engine_bias_correction_reaches_the_step():
    """ferry.Engine(bias_correction=False): the first step against float64 Adam without it (~3x the corrected one)."""
    import numpy as np
    g = 0.37
    for bias_correction in (False, True):
        p = np.ones(1, dtype=np.float32)
        grad = np.full(1, g, dtype=np.float32)
        e = ferry.Engine(device="host", lr=0.01, weight_decay=0.0, bias_correction=bias_correction,
                         cpu_threads_max=2, pin_cpu_threads=0, pin_trainer_threads=0)
        e.add_param("p", "p", [1], "f32", p.ctypes.data, grad.ctypes.data)
        e.finalize()
        e.step()
        m, v = 0.1 * g, 0.001 * g * g
        if bias_correction:
            m, v = m / 0.1, v / 0.001
        want = 1.0 - 0.01 * m / (v ** 0.5 + 1e-8)
        assert abs(float(p[0]) - want) < 1e-6, (bias_correction, float(p[0]), want)


@pytest.mark.parametrize("field", ["collective_timeout", "checkpoint_timeout"])
@pytest.mark.parametrize("value, text", [(-1.0, "-1"), (float("nan"), "nan"), (float("inf"), "inf")])
def test_engine_timeouts_out_of_range_are_refused(field, value, text):
    """0 is the engine's default; a negative or non-finite one fell back to it silently before."""
    with pytest.raises(ValueError, match="%s is %s s; it must be >= 0" % (field, text)):
        ferry.Engine(device="host", **{field: value})
    ferry.Engine(device="host", **{field: 0.0})
