"""Params the trainer writes itself (model.load_state_dict, a copy_ into a param) between steps:
ferry.torch.Optimizer refreshes the masters from them before the next step reads the masters, as
torch's AdamW, whose params are its masters, trains on what was loaded. The moments and steps stay.

  * a model-only load between steps (after construction, and after some steps), with overlap on
    and off, attached or not, fp32 params offloaded or on the GPU: the params stay within
    test_adamw_match's FP32_ULPS of torch.optim.AdamW given the same loads, fresh random batches;
    without the refresh the next step wrote the old masters back over the loaded weights;
  * bf16 params (fp32 masters): a param swapped out and back (an EMA's eval swap) keeps every master
    bit; one element written takes the new value as its master and the others keep theirs;
    state_dict() after a load, before any step, holds the loaded values as masters;
  * attach(): model.state_dict() right after a deferred step holds the step's new params (it waits
    for their upload, as torch.save reads them next); model.load_state_dict() waits for it before
    writing; any other write before the forward's wait raises there, naming the params (the upload
    may land on them).
"""
import pytest
import torch

import ferry.torch
from nets import assert_close_to

DIMS = (12, 32, 32, 4)


def make_model(device, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in zip(DIMS[:-1], DIMS[1:])]
    return torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1], torch.nn.Tanh(), layers[2]).to(device, dtype)


def batch(device, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randn(16, DIMS[0], generator=g).to(device, dtype),
            torch.randn(16, DIMS[-1], generator=g).to(device, dtype))


def train(model, opt, step, device):
    x, y = batch(device, step, model[0].weight.dtype)
    torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
    opt.step()
    opt.zero_grad()


def load(model, how, seed):
    other = make_model(model[0].weight.device, seed=seed, dtype=model[0].weight.dtype)
    if how == "load_state_dict":
        model.load_state_dict(other.state_dict())
    else:  # one param only, in place
        with torch.no_grad():
            model[2].weight.copy_(other[2].weight)


@pytest.mark.parametrize("policy", ["offload_all", "all_gpu"])
@pytest.mark.parametrize("overlap,attach", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("how", ["load_state_dict", "copy_"])
def test_a_model_load_between_steps_trains_on_the_loaded_weights(device, policy, overlap, attach, how):
    model, ref = make_model(device), make_model(device)
    opt = ferry.torch.Optimizer(model.parameters(), lr=1e-2, weight_decay=0.1, policy=policy, overlap=overlap,
                                bucket_mb=1e-7, transfer_chunk_bytes=1024)
    if attach:
        opt.attach(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(6):
        if step in (0, 3):  # right after construction, and between steps
            if how == "copy_":
                opt.wait_params()  # attach(): the last step's uploads before writing a param (a load waits itself)
            load(model, how, seed=step + 1)
            load(ref, how, seed=step + 1)
        train(model, opt, step, device)
        train(ref, ref_opt, step, device)
        opt.wait_params()
        assert_close_to(model, ref, "%s, step %d" % (how, step))
    # 6 params, or the one written, at each of the two loads (all_gpu keeps fp32 masters of its own too)
    assert opt.stats()["params_synced"] == (12 if how == "load_state_dict" else 2)


def masters(opt):
    return [v["master"].clone() for v in opt.state_dict()["state"].values()]


def test_bf16_masters_keep_their_bits_where_the_params_did(device):
    model = make_model(device, dtype=torch.bfloat16)
    opt = ferry.torch.Optimizer(model.parameters(), lr=1e-2, policy="offload_all")
    for step in range(2):
        train(model, opt, step, device)
    before = masters(opt)
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in before)  # more bits than the params
    # An EMA's eval swap: other values in, the same values back.
    saved = [p.detach().clone() for p in model.parameters()]
    load(model, "load_state_dict", seed=9)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    after = masters(opt)
    for k, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a, b), "param %d: a master changed though its param came back" % k
    # One element written: its master takes the value, every other element keeps its bits.
    with torch.no_grad():
        model[2].weight[3, 5] = 7.0
    after = masters(opt)
    assert after[2][3, 5].item() == 7.0
    rest = torch.ones_like(after[2], dtype=torch.bool)
    rest[3, 5] = False
    assert torch.equal(after[2][rest], before[2][rest])
    for k in (0, 1, 3, 4, 5):
        assert torch.equal(after[k], before[k]), k
    # A load before any step: state_dict() already holds the loaded values as masters.
    fresh = make_model(device, dtype=torch.bfloat16)
    opt = ferry.torch.Optimizer(fresh.parameters(), lr=1e-2, policy="offload_all")
    load(fresh, "load_state_dict", seed=4)
    for m, p in zip(masters(opt), fresh.parameters()):
        assert torch.equal(m, p.detach().float().cpu())


def test_attach_orders_model_state_dict_and_load_after_the_update_and_refuses_other_writes(device):
    model = make_model(device)
    opt = ferry.torch.Optimizer(model.parameters(), lr=1e-2, policy="offload_all", overlap=True,
                                bucket_mb=1e-7, transfer_chunk_bytes=1024).attach(model)
    other = make_model(device, seed=3).state_dict()
    for step in range(4):
        train(model, opt, step, device)
        # state_dict() right after a deferred step, copied as torch.save would read it: the new params
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt.wait_params()
        for k, v in model.state_dict().items():
            assert torch.equal(saved[k], v), "step %d: state_dict() read %s before its update" % (step, k)
    assert opt.stats()["deferred_steps"] == 4
    # A load right after a deferred step, no wait_params(): it waits for the upload, then writes.
    train(model, opt, 4, device)
    model.load_state_dict(other)
    opt.wait_params()
    for k, v in model.state_dict().items():
        assert torch.equal(v, other[k]), "%s: the step's upload landed on the loaded value" % k
    # Any other write before the forward's wait: refused there, naming the params.
    train(model, opt, 5, device)
    with torch.no_grad():
        model[0].weight.mul_(0.5)
        model[0].bias.zero_()
    x, _ = batch(device, 6)
    with pytest.raises(RuntimeError, match=r"param 0 \(param_groups\[0\]\['params'\]\[0\]\), param 1 .* were "
                                           r"changed in place after step\(\) .* opt.wait_params\(\)"):
        model(x)
