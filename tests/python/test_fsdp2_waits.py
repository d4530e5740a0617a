"""attach(model) over FSDP2 (ferry/_attach.py, Fsdp2Waits), on any torch: the parts of FSDP2 that
attach() reads stand in as fakes, with the attribute names of torch's FSDPState (2.4 to 2.11): a
module fully_shard was applied to has `_get_fsdp_state()`; the state has `_fsdp_param_groups` (a list,
torch >= 2.10; `_fsdp_param_group` before), each with `fsdp_params` whose `sharded_param` is the
module's param; `_states_to_forward_prefetch` (set_modules_to_forward_prefetch); and
`_comm_ctx.all_gather_copy_in_stream`. FSDP2's own pre-forward hook, registered with prepend=True
when fully_shard runs, stands in as a hook that records which buckets were still waiting for their
upload when it would all-gather. The real FSDP2 runs in test_dist_fsdp2.py (torch >= 2.4).

Checked: Ferry's hooks run before FSDP2's; each FSDP2 module's hook waits for the buckets of its own
params and of the modules it prefetches, and no others; a state of either torch layout works; a
state of several modules (fully_shard([a, b])) waits at whichever of them runs first; the training
is bit-identical to the same optimizer unattached; attach() warns when the root's unit holds the
head (a tenth or more of the offloaded params), and not when the head has its own unit or is not
offloaded.
"""
import pytest
import torch

import ferry.torch
from ferry import _attach, _zero

STEPS = 4


class _FsdpParam:
    def __init__(self, p):
        self.sharded_param = p


class _Group:
    def __init__(self, params):
        self.fsdp_params = [_FsdpParam(p) for p in params]


class _CommCtx:
    all_gather_copy_in_stream = None  # CPU: no streams


class _State:
    def __init__(self, params, plural):
        groups = [_Group(params)] if params else []
        if plural:
            self._fsdp_param_groups = groups
        else:
            self._fsdp_param_group = groups[0] if groups else None
        self._states_to_forward_prefetch = []
        self._comm_ctx = _CommCtx()


_HAS_PREPEND = "prepend" in torch.nn.Module.register_forward_pre_hook.__code__.co_varnames


def _register_pre_hook(module, hook, prepend=False):
    """register_forward_pre_hook(hook, prepend=...) on any torch: torch 1.13 has no `prepend` (FSDP2
    needs torch >= 2.4, which has), so there the hook is moved to the front of the module's hooks."""
    if _HAS_PREPEND:
        return torch.nn.Module.register_forward_pre_hook(module, hook, prepend=prepend)
    handle = _ORIGINAL_REGISTER(module, hook)
    if prepend:
        module._forward_pre_hooks.move_to_end(handle.id, last=False)
    return handle


_ORIGINAL_REGISTER = torch.nn.Module.register_forward_pre_hook


class Net(torch.nn.Module):
    """Three layers, each "fully_shard"ed, and the root (no params of its own); l1 prefetches l2."""

    def __init__(self, plural, seen):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = torch.nn.Linear(6, 9), torch.nn.Linear(9, 5), torch.nn.Linear(5, 2)
        self.states = {}
        for name, module in (("l1", self.l1), ("l2", self.l2), ("l3", self.l3), ("root", self)):
            state = _State(list(module.parameters(recurse=False)), plural)
            self.states[name] = state
            module._get_fsdp_state = (lambda s: (lambda: s))(state)
            _register_pre_hook(module, self._fsdp_pre_forward(name, seen), prepend=True)
        self.states["l1"]._states_to_forward_prefetch = [self.states["l2"]]

    def _fsdp_pre_forward(self, name, seen):
        def hook(_module, _inputs):
            opt = self.opt
            if opt is not None:
                seen.append((name, frozenset(opt._pending)))
        return hook

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def train(attach, plural, monkeypatch):
    seen = []
    net = Net(plural, seen)
    net.opt = None
    opt = ferry.torch.Optimizer(list(net.parameters()), lr=1e-2, weight_decay=0.1, policy="offload_all",
                                overlap=True, bucket_mb=1e-6)  # a bucket per param
    if attach:
        with monkeypatch.context() as m:
            m.setattr(_zero, "is_dtensor", lambda t: True)  # FSDP2's params are DTensors
            if not _HAS_PREPEND:
                m.setattr(torch.nn.Module, "register_forward_pre_hook", _register_pre_hook)
            opt.attach(net)
        assert isinstance(opt._waits, _attach.Fsdp2Waits)
    net.opt = opt
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    net.opt = None
    opt.wait_params()
    units = {name: {opt._unit_of[k] for k, p in enumerate(opt._params)
                    if any(p is q for q in getattr(net, name).parameters())} for name in ("l1", "l2", "l3")}
    return {"params": [p.detach().clone() for p in net.parameters()], "seen": seen, "units": units,
            "deferred": opt.stats()["deferred_steps"], "hooks": len(opt._waits.handles) if opt._waits else 0}


@pytest.mark.parametrize("plural", [True, False], ids=["param_groups_list", "param_group"])
def test_hooks_wait_before_fsdp2_all_gathers_own_and_prefetched(monkeypatch, plural):
    run = train(True, plural, monkeypatch)
    assert run["deferred"] == STEPS, "every step returned before its update"
    # A pre-hook per FSDP2 module (l1, l2, l3, the root), a grad hook per param (6), and a state_dict and
    # a load_state_dict hook on the root and each module owning params (l1, l2, l3).
    assert run["hooks"] == 4 + 6 + 2 * 4
    u = run["units"]
    assert all(len(u[n]) == 2 for n in u), u  # a weight and a bias each, a bucket each
    forwards = [run["seen"][i:i + 4] for i in range(0, len(run["seen"]), 4)]
    assert len(forwards) == STEPS
    for step, f in enumerate(forwards):
        assert [name for name, _ in f] == ["root", "l1", "l2", "l3"], f
        if step == 0:
            assert all(not pending for _, pending in f), "nothing pends before the first step"
            continue
        pending = dict(f)
        # When FSDP2 all-gathers l1 (and prefetches l2 from l1's pre-forward), their buckets were
        # waited for already; l3's not yet (its own forward waits for them).
        assert not (pending["l1"] & (u["l1"] | u["l2"])), (step, pending["l1"], u)
        assert u["l3"] <= pending["l1"], (step, pending["l1"], u)
        assert not (pending["l3"] & u["l3"]), (step, pending["l3"], u)
        # The root holds no param: its hook waits for nothing.
        assert u["l1"] | u["l2"] | u["l3"] <= pending["root"]


class SharedNet(torch.nn.Module):
    """fully_shard([l2, l3]): one state for l2 and l3, whose all-gather runs at the pre-forward of
    whichever of them runs first, here l3 (the forward calls l3 before l2)."""

    def __init__(self, seen):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = torch.nn.Linear(6, 9), torch.nn.Linear(5, 2), torch.nn.Linear(9, 5)
        shared = _State(list(self.l2.parameters()) + list(self.l3.parameters()), True)
        for name, module, state in (("l1", self.l1, _State(list(self.l1.parameters()), True)),
                                    ("l2", self.l2, shared), ("l3", self.l3, shared),
                                    ("root", self, _State([], True))):
            module._get_fsdp_state = (lambda s: (lambda: s))(state)
            _register_pre_hook(module, self._fsdp_pre_forward(name, seen), prepend=True)
        self.opt = None

    def _fsdp_pre_forward(self, name, seen):
        def hook(_module, _inputs):
            if self.opt is not None:
                seen.append((name, frozenset(self.opt._pending)))
        return hook

    def forward(self, x):
        return self.l2(torch.tanh(self.l3(torch.tanh(self.l1(x)))))


def test_a_state_of_several_modules_waits_at_the_first_to_run(monkeypatch):
    seen = []
    net = SharedNet(seen)
    opt = ferry.torch.Optimizer(list(net.parameters()), lr=1e-2, policy="offload_all", overlap=True, bucket_mb=1e-6)
    with monkeypatch.context() as m:
        m.setattr(_zero, "is_dtensor", lambda t: True)
        if not _HAS_PREPEND:
            m.setattr(torch.nn.Module, "register_forward_pre_hook", _register_pre_hook)
        opt.attach(net)
    net.opt = opt
    shared = {opt._unit_of[k] for k, p in enumerate(opt._params)
              if any(p is q for q in list(net.l2.parameters()) + list(net.l3.parameters()))}
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    net.opt = None
    assert opt.stats()["deferred_steps"] == 3
    at_l3 = [pending for name, pending in seen if name == "l3"]
    assert len(at_l3) == 3
    for step, pending in enumerate(at_l3[1:], 1):
        assert not (pending & shared), "step %d: l3 ran first and its state's all-gather found %s pending" % (
            step, sorted(pending & shared))


def test_attached_bit_identical_to_unattached(monkeypatch):
    a = train(True, True, monkeypatch)
    b = train(False, True, monkeypatch)
    assert b["deferred"] == 0
    for i, (x, y) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), "param %d differs" % i
    assert not torch.equal(a["params"][0], Net(True, []).l1.weight.detach()), "the training moved the params"


class HeadNet(torch.nn.Module):
    """l1 a unit of its own; the head in the root's unit (`own_unit=False`, fully_shard(model) after
    the blocks only, as torch's FSDP2 example writes it) or in a unit of its own (torchtitan's)."""

    def __init__(self, own_unit):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.head = torch.nn.Linear(6, 4), torch.nn.Linear(4, 30)  # the head: 150 of 178 params
        units = [("l1", self.l1, list(self.l1.parameters()))]
        if own_unit:
            units.append(("head", self.head, list(self.head.parameters())))
        units.append(("root", self, [] if own_unit else list(self.head.parameters())))
        for _, module, params in units:
            module._get_fsdp_state = (lambda s: (lambda: s))(_State(params, True))

    def forward(self, x):
        return self.head(torch.tanh(self.l1(x)))


def attach_warnings(monkeypatch, net, policy):
    opt = ferry.torch.Optimizer([{"params": list(net.l1.parameters())}, {"params": list(net.head.parameters())}],
                                lr=1e-2, policy=policy, overlap=True)
    with monkeypatch.context() as m, _Recorder() as seen:
        m.setattr(_zero, "is_dtensor", lambda t: True)
        if not _HAS_PREPEND:
            m.setattr(torch.nn.Module, "register_forward_pre_hook", _register_pre_hook)
        opt.attach(net)
    return [str(w.message) for w in seen if "root unit" in str(w.message)]


class _Recorder:
    """warnings.catch_warnings(record=True) that records every warning, each time."""

    def __enter__(self):
        import warnings
        self._cm = warnings.catch_warnings(record=True)
        seen = self._cm.__enter__()
        warnings.simplefilter("always")
        return seen

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_a_root_unit_holding_the_head_is_warned_about(monkeypatch):
    got = attach_warnings(monkeypatch, HeadNet(own_unit=False), "offload_all")
    assert len(got) == 1, got
    # The head's 150 params (weight 120, bias 30) of the 178 offloaded: 84%, the largest named first.
    assert "fully_shard(HeadNet)" in got[0] and "holds 84% of the offloaded params (head.weight, head.bias)" in got[0]
    assert "fully_shard([model.norm, model.head])" in got[0]
    # fully_shard swaps the model's class for FSDP<its class> (torch 2.4+): the warning names the user's.
    net = HeadNet(own_unit=False)
    net.__class__ = type("FSDPHeadNet", (HeadNet,), {})
    got = attach_warnings(monkeypatch, net, "offload_all")
    assert len(got) == 1 and "fully_shard(HeadNet)" in got[0], got


def test_no_warning_when_the_head_has_its_own_unit_or_nothing_is_offloaded(monkeypatch):
    assert attach_warnings(monkeypatch, HeadNet(own_unit=True), "offload_all") == []
    assert attach_warnings(monkeypatch, HeadNet(own_unit=False), "all_gpu") == []
    # Only the offloaded params count: the head's group on the GPU, l1's offloaded (offload_fraction
    # 0.5 from the start offloads the first group), so the root holds none of what is offloaded.
    net = HeadNet(own_unit=False)
    with pytest.warns(UserWarning, match="a param group is placed whole"):  # 16% offloaded of 0.5 asked
        opt = ferry.torch.Optimizer([{"params": list(net.l1.parameters())}, {"params": list(net.head.parameters())}],
                                    lr=1e-2, policy="offload_fraction",
                                    policy_args={"fraction": "0.5", "from": "start"}, overlap=True)
    assert [d["offloaded"] for d in opt.placement()] == [True, False]
    with monkeypatch.context() as m, _Recorder() as seen:
        m.setattr(_zero, "is_dtensor", lambda t: True)
        if not _HAS_PREPEND:
            m.setattr(torch.nn.Module, "register_forward_pre_hook", _register_pre_hook)
        opt.attach(net)
    assert not [w for w in seen if "root unit" in str(w.message)]
