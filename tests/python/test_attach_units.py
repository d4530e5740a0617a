"""attach(model, units=...): each unit's forward waits once for every param under it, the modules
outside the units each for their own; fewer hooks, the same bits as without attach(), the steps still
deferred. Units named wrongly are refused, naming the unit."""
import importlib

import pytest
import torch

import ferry.torch
from nets import Net, assert_same_bits, batches, loss_of, net_groups

STEPS = 5


def make(device, overlap):
    net = Net(seed=3).to(device)
    opt = ferry.torch.Optimizer(net_groups(net), lr=1e-2, weight_decay=0.1, policy="offload_all", overlap=overlap,
                                bucket_mb=1e-7, transfer_chunk_bytes=1024)
    opt._tracker.trace = []
    return net, opt


def train_step(net, opt, step):
    x, y = batches(net.head.weight.device, step)[0]
    loss_of(net, x, y, step).backward()
    opt.step()
    opt.zero_grad()


def pre_hooked(net):
    """The names of the modules of `net` that hold a forward pre-hook."""
    return sorted(name for name, m in net.named_modules() if m._forward_pre_hooks)


@pytest.mark.parametrize("overlap", [True, False])
def test_each_unit_waits_once_for_its_params_and_gives_the_same_bits(device, overlap):
    """Net's blocks as the units: one hook per block (blocks[1] and [2] hold `shared` and their fc), the
    modules outside them (frozen, spare, head) one each, where attach() alone puts one on every module
    owning params. Each step's waits before step(): every block's params at its first wait, blocks in
    forward order; the same bits as the optimizer unattached, every step deferred after the first."""
    net, opt = make(device, overlap)
    plain_net, plain = make(device, overlap)
    per_module, per_module_opt = make(device, overlap)
    per_module_opt.attach(per_module)
    assert pre_hooked(per_module) == ["blocks.0.fc", "blocks.1", "blocks.1.fc", "blocks.2", "blocks.2.fc",
                                      "blocks.3.fc", "frozen", "head", "spare"]
    assert opt.attach(net, units=net.blocks) is opt
    assert pre_hooked(net) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "frozen", "head", "spare"]
    index = {id(p): k for k, p in enumerate(opt._params)}
    under = [{index[id(p)] for p in b.parameters()} for b in net.blocks]
    for step in range(1, STEPS + 1):
        opt._tracker.trace.clear()
        train_step(net, opt, step)
        if step > 1:
            waits = [set(k for u in e[1] for k in opt._units[u]) for e in opt._tracker.trace if e[0] == "wait"]
            # The first four waits are the blocks', each for all of the block's params not waited for
            # yet (blocks[2]'s `shared` came with blocks[1]).
            assert waits[0] == under[0] and waits[1] == under[1], waits
            assert waits[2] == under[2] - under[1] and waits[3] == under[3], waits
        train_step(plain_net, plain, step)
        opt.engine.synchronize()
        assert_same_bits(net, plain_net, "step %d" % step)
    if overlap:
        assert opt.stats()["deferred_steps"] == STEPS, opt.stats()["deferred_steps"]
    opt.detach()
    assert pre_hooked(net) == []


def test_units_named_wrongly_are_refused(device):
    net, opt = make(device, True)
    other = Net(seed=4)
    cases = [
        (5, TypeError, "units= takes modules"),
        ([net.blocks[0], 7], TypeError, r"units\[1\] \(int\) is not a torch.nn.Module"),
        ([net.blocks], ValueError, r"units\[0\] \(ModuleList\) is a container whose forward never runs"),
        ([other.blocks[0]], ValueError, r"units\[0\] \(Block\) is not a module of Net"),
        ([net.blocks[1], net.blocks[1].fc], ValueError, r"units\[1\] \(Linear\) is inside units\[0\] \(Block\)"),
        ([net.blocks[2], net.blocks[2]], ValueError, r"units\[0\] \(Block\) is the same module as units\[1\]"),
    ]
    for units, error, message in cases:
        with pytest.raises(error, match=message):
            opt.attach(net, units=units)
        assert opt._waits is None and pre_hooked(net) == [], units  # nothing left behind
    opt.attach(net, units=net.head)  # one module: the unit is that module
    assert pre_hooked(net) == ["blocks.0.fc", "blocks.1", "blocks.1.fc", "blocks.2", "blocks.2.fc", "blocks.3.fc",
                               "frozen", "head", "spare"]


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch >= 2.0")
def test_units_under_torch_compile(device):
    """Compiled after attach(units=) (backend "eager": Dynamo's graphs run as they are): the units'
    hooks run between the graphs, every step is deferred, the same bits as the compiled model
    unattached."""
    importlib.import_module("torch._dynamo").reset()
    nets, opts, compiled = [], [], []
    for attach in (True, False):
        net, opt = make(device, True)
        if attach:
            opt.attach(net, units=net.blocks)
        nets.append(net)
        opts.append(opt)
        compiled.append(torch.compile(net, backend="eager"))
    for step in range(1, STEPS + 1):
        x, y = batches(device, step)[0]
        for c, opt in zip(compiled, opts):
            torch.nn.functional.mse_loss(c(x, step), y).backward()
            opt.step()
            opt.zero_grad()
        for opt in opts:
            opt.engine.synchronize()
        assert_same_bits(nets[0], nets[1], "step %d" % step)
    assert opts[0].stats()["deferred_steps"] == STEPS, opts[0].stats()["deferred_steps"]
