"""torch's GradScaler stepping ferry.torch.Optimizer (ferry/_amp.py): no grad changed in place, the overlap
kept, the scale followed on the host.

Against a reference written out here: torch.optim.AdamW stepped by hand as GradScaler steps it (grads
times the scale's reciprocal, a NaN/Inf anywhere skips the step) with the scale's update rule (torch's
_amp_update_scale_ kernel, its double products rounded to float32, computed in float64 tensors), on
loops where chosen steps overflow: the same skipped steps, the same scale history (the real scaler's,
the reference's and Ferry's host mirror), fp32 params within test_adamw_match's FP32_ULPS, fp16 params
within one fp16 ulp of the reference's fp32 masters rounded.

The scaler is torch's own. On CUDA: torch.amp.GradScaler("cuda") (torch.cuda.amp.GradScaler on 1.13).
On CPU: torch.amp.GradScaler("cpu") where torch has GradScaler's CPU kernels (>= 2.3); else (1.13)
torch.cuda.amp.GradScaler enabled by hand on CPU tensors, with the pieces 1.13 has for CUDA only
supplied here: the two kernels (reference implementations of the same math), scale() and the
per-device replicator without their CUDA assertions. Every other line of step(), unscale_() and
update() is torch's.
"""
import collections
import contextlib
import inspect
import warnings

import pytest
import torch

import ferry.torch
from ferry import _amp
from nets import FP32_ULPS, ulps

FUTURE = "GradScaler is going to stop passing itself"  # torch 2.x's FutureWarning (filtered by ferry._amp)


# ---- the reference rule and torch's kernels for CPU ---------------------------------------------------

def ref_update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """torch's _amp_update_scale_ written out: the float32 scale times the double factor, rounded to
    float32 (float64 tensors here); growth only after `growth_interval` clean steps and only while
    finite. In place, as the op (one version bump of each tensor, whatever the values)."""
    s = torch.tensor(scale.item(), dtype=torch.float64)
    new_scale, new_tracker = s.float(), 0
    if found_inf.item():
        new_scale = (s * backoff_factor).float()
    elif int(tracker.item()) + 1 == growth_interval:
        grown = (s * growth_factor).float()
        if torch.isfinite(grown):
            new_scale = grown
    else:
        new_tracker = int(tracker.item()) + 1
    scale.fill_(new_scale.item())
    tracker.fill_(new_tracker)
    return scale


def ref_check_and_unscale_(grads, found_inf, inv_scale):
    """torch's _amp_foreach_non_finite_check_and_unscale_ written out (in place)."""
    for g in grads:
        if not bool(torch.isfinite(g).all()):
            found_inf.fill_(1.0)
        g.mul_(inv_scale.item())


class _Replicator:
    """torch.cuda.amp.grad_scaler._MultiDeviceReplicator without its CUDA assertion."""

    def __init__(self, master):
        self.master = master
        self._per_device_tensors = {}

    def get(self, device):
        if device not in self._per_device_tensors:
            self._per_device_tensors[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return self._per_device_tensors[device]


def cpu_kernels_native():
    try:
        torch._amp_update_scale_(torch.ones(()), torch.zeros((), dtype=torch.int32), torch.zeros(()), 2.0, 0.5, 2)
        return hasattr(torch.amp, "GradScaler")
    except RuntimeError:  # NotImplementedError: no CPU kernel (torch < 2.3)
        return False


class CpuGradScaler(torch.cuda.amp.GradScaler):
    """torch.cuda.amp.GradScaler on CPU tensors, for torch without a CPU GradScaler: its constructor
    disables itself without CUDA, so it is enabled here by hand; scale() without the CUDA assertion."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        super().__init__(enabled=False)
        from torch.cuda.amp import grad_scaler
        self.__dict__.update(_enabled=True, _init_scale=init_scale, _scale=None, _growth_factor=growth_factor,
                             _backoff_factor=backoff_factor, _growth_interval=growth_interval,
                             _init_growth_tracker=0, _growth_tracker=None,
                             _per_optimizer_states=collections.defaultdict(grad_scaler._refresh_per_optimizer_state))

    def scale(self, outputs):
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(outputs.device)
        return outputs * self._scale


@pytest.fixture
def make_scaler(device, monkeypatch):
    """make_scaler(**GradScaler's arguments): torch's GradScaler on `device` (see the module's documentation)."""
    if device.type == "cuda":
        if hasattr(torch.amp, "GradScaler"):
            return lambda **kw: torch.amp.GradScaler("cuda", **kw)
        return lambda **kw: torch.cuda.amp.GradScaler(**kw)
    if cpu_kernels_native():
        return lambda **kw: torch.amp.GradScaler("cpu", **kw)
    from torch.cuda.amp import grad_scaler
    monkeypatch.setattr(torch, "_amp_update_scale_", ref_update_scale_, raising=False)
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", ref_check_and_unscale_, raising=False)
    monkeypatch.setattr(grad_scaler, "_MultiDeviceReplicator", _Replicator)
    return CpuGradScaler


@contextlib.contextmanager
def no_warnings():
    """Every warning is an error, but torch 2.x's FutureWarning that ferry._amp filters (the filter is
    reset here like every other)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=FUTURE, category=FutureWarning)
        # torch's own note when the sync debug mode is set (a prototype feature).
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype", category=UserWarning)
        yield


class Reference:
    """torch.optim.AdamW stepped as GradScaler steps it, with the scale rule written out."""

    def __init__(self, groups, init_scale, growth_factor, backoff_factor, growth_interval, **kw):
        self.opt = torch.optim.AdamW(groups, foreach=False, **kw)
        self.scale = torch.full((1,), init_scale, dtype=torch.float32)
        self.tracker = torch.zeros((1,), dtype=torch.int32)
        self.rule = (growth_factor, backoff_factor, growth_interval)

    def step(self, unscaled=False, other_found_inf=False, new_scale=None):
        """Unscales (unless the caller did), skips on a NaN/Inf, updates the scale as update() does (with
        new_scale: as update(new_scale) does); returns whether it skipped."""
        params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        if not unscaled:
            self.unscale(params)
        found = any(not bool(torch.isfinite(p.grad).all()) for p in params)
        if not found:
            self.opt.step()
        if new_scale is not None:
            self.scale.fill_(new_scale)
        else:
            ref_update_scale_(self.scale, self.tracker, torch.tensor(float(found or other_found_inf)), *self.rule)
        self.opt.zero_grad(set_to_none=True)
        return found

    def backward(self, loss):
        (loss * self.scale.to(loss.device)).backward()

    def unscale(self, params):
        inv = torch.tensor(1.0, dtype=torch.float64).div(self.scale.double()).float().item()
        with torch.no_grad():
            for p in params:
                p.grad.mul_(inv)


# ---- nets and data --------------------------------------------------------------------------------------

def make_net(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1)).to(device)


def per_layer(net):
    return [{"params": list(m.parameters())} for m in net if list(m.parameters())]


def batch(device, step):
    gen = torch.Generator().manual_seed(700 + step)
    return torch.randn(64, 16, generator=gen).to(device), torch.randn(64, 1, generator=gen).to(device)


def loss_at(net, step, bad):
    x, y = batch(next(net.parameters()).device, step)
    loss = torch.nn.functional.mse_loss(net(x), y)
    return loss * float("inf") if step in bad else loss  # an overflowing step: every grad NaN or Inf


RULE = dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


# ---- the tests ------------------------------------------------------------------------------------------

def test_step_takes_grad_scaler(device):
    """GradScaler's contract: the flag, and step()'s signature naming grad_scaler (torch 2.x looks at it
    and then passes itself instead of running its in-place inf check)."""
    opt = ferry.torch.Optimizer(make_net(device).parameters(), policy="offload_all")
    assert opt._step_supports_amp_scaling is True
    assert "grad_scaler" in inspect.signature(opt.step).parameters


def test_rule_matches_torch_kernel_on_edge_values():
    """ferry._amp.next_scale against the written-out kernel: growth and backoff by factors that are not
    powers of two (rounding), growth that would overflow float32 (kept), the tracker's count."""
    cases = [(65536.0, 0, 0, 2.0, 0.5, 3), (65536.0, 2, 0, 2.0, 0.5, 3), (3.0e38, 2, 0, 2.0, 0.5, 3),
             (1000.1, 0, 1, 2.0, 0.3, 3), (1000.1, 4, 0, 1.7, 0.5, 5), (1.0e-30, 0, 1, 2.0, 0.1, 1),
             (12345.678, 6, 0, 1.0001, 0.5, 7)]
    for scale, tracker, found, gf, bf, gi in cases:
        scale = torch.tensor(scale, dtype=torch.float32).item()
        s, t = torch.full((1,), scale), torch.full((1,), tracker, dtype=torch.int32)
        ref_update_scale_(s, t, torch.tensor(float(found)), gf, bf, gi)
        assert _amp.next_scale(scale, tracker, found, gf, bf, gi) == (s.item(), int(t.item())), (scale, tracker, found)


def count_reads(monkeypatch):
    """A list that gets an entry each time a mirror reads the scaler's scale from its tensor."""
    reads = []
    read = _amp._Mirror.read
    monkeypatch.setattr(_amp._Mirror, "read", lambda m, scaler: reads.append(1) or read(m, scaler))
    return reads


@pytest.mark.parametrize("overlap", [None, True])
def test_grad_scaler_matches_reference_and_keeps_overlap(device, make_scaler, monkeypatch, overlap):
    """The usual loop, scaler.scale(loss).backward(); scaler.step(opt); scaler.update(), with steps 4, 8
    and 9 overflowing: the same skips and scale history as the reference, no grad changed by
    scaler.step, the scale read once, and every clean step after a clean step keeps its early work."""
    steps, bad = 14, {4, 8, 9}
    ref_net, net = make_net(device), make_net(device)
    ref = Reference(per_layer(ref_net), lr=1e-2, weight_decay=0.1, **RULE)
    opt = ferry.torch.Optimizer(per_layer(net), lr=1e-2, weight_decay=0.1, policy="offload_all", overlap=overlap)
    scaler = make_scaler(**RULE)
    reads = count_reads(monkeypatch)
    history = []
    with no_warnings():
        last_clean = False
        for step in range(steps):
            ref.backward(loss_at(ref_net, step, bad))
            ref_skipped = ref.step()
            scaler.scale(loss_at(net, step, bad)).backward()
            versions = [p.grad._version for p in net.parameters()]
            before = opt.stats()
            scaler.step(opt)
            assert [p.grad._version for p in net.parameters()] == versions, "scaler.step changed a grad in place"
            scaler.update()
            opt.zero_grad()
            after = opt.stats()
            skipped = after["skipped_steps"] > before["skipped_steps"]
            assert skipped == ref_skipped == (step in bad), step
            assert scaler.get_scale() == ref.scale.item() == opt._amp.after[0], (step, scaler.get_scale())
            history.append(ref.scale.item())
            # overlap=True: the first backward's announcements knew no scaler yet (recomputed, exact)
            assert after["early_groups_recomputed"] == before["early_groups_recomputed"] or \
                (overlap and step == 0), "step %d recomputed its early work" % step
            if step >= 2 and last_clean and not skipped:
                assert after["early_groups_kept"] > before["early_groups_kept"], "step %d kept nothing" % step
            last_clean = not skipped
            for p, q in zip(net.parameters(), ref_net.parameters()):
                assert ulps(p, q) <= FP32_ULPS, (step, ulps(p, q).item())
    assert len(reads) == 1, "the scale was read %d times (once expected)" % len(reads)
    assert opt.overlapping
    assert max(history) > RULE["init_scale"] > min(history), history  # it grew, and backed off below the start
    assert after["skipped_steps"] == len(bad)


def test_fp16_grads_that_overflow(device, make_scaler):
    """fp16 params, their scaled grads given as fp16 (torch's own unscale_ refuses fp16 grads; the
    engine takes them): the scale grows until the scaled grads overflow fp16, backs off, grows again.
    Params within one fp16 ulp of the reference's fp32 masters rounded; the masters within FP32_ULPS."""
    steps = 16
    gen = torch.Generator().manual_seed(5)
    shapes = [(48, 20), (20,), (7, 3)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    params = [t.to(device=device, dtype=torch.float16).requires_grad_() for t in init]
    masters = [p.detach().float().cpu().requires_grad_() for p in params]
    rule = dict(init_scale=2.0 ** 11, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    ref = Reference([{"params": masters}], lr=1e-2, weight_decay=0.1, **rule)
    opt = ferry.torch.Optimizer([{"params": params}], lr=1e-2, weight_decay=0.1, policy="offload_all")
    scaler = make_scaler(**rule)
    skips = []
    with no_warnings():
        for step in range(steps):
            true = [torch.randn(s, generator=gen) * (1.0 + 3.0 * (step % 5 == 0)) for s in shapes]
            scale = ref.scale.item()
            scaled = [(g * scale).to(torch.float16) for g in true]  # |g| * scale past 65504: inf
            for p, m, g in zip(params, masters, scaled):
                p.grad = g.to(device)
                m.grad = g.float()
            scaler.scale(torch.ones((), device=device))  # the scale tensor exists (the loss's device)
            ref_skipped = ref.step()
            before = opt.stats()["skipped_steps"]
            scaler.step(opt)
            scaler.update()
            skipped = opt.stats()["skipped_steps"] > before
            assert skipped == ref_skipped, step
            skips.append(skipped)
            assert scaler.get_scale() == ref.scale.item() == opt._amp.after[0], step
    assert 2 <= sum(skips) <= steps - 4, skips  # overflowing steps, and clean ones between
    sd = opt.state_dict()
    for k, (p, m) in enumerate(zip(params, masters)):
        a, b = p.detach().float().cpu(), m.detach().half().float()
        ulp = torch.pow(2.0, torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(6.1e-5))) - 10)
        assert ((a - b).abs() / ulp).max().item() <= 1.0, k
        assert ulps(sd["state"][k]["master"], m) <= FP32_ULPS, k


def test_unscale_before_step_and_clip(device, make_scaler):
    """scaler.unscale_(opt) before scaler.step (stage UNSCALED): the grads are unscaled already, torch's
    own found-inf is used, and opt.clip_grad_norm_ returns the norm as it is; without unscale_, the
    norm of the scaled grads divided by the scale. Both against the reference with torch's clip."""
    steps, bad, max_norm = 8, {3}, 0.5
    for unscale in (True, False):
        ref_net, net = make_net(device), make_net(device)
        ref = Reference(per_layer(ref_net), lr=1e-2, **RULE)
        opt = ferry.torch.Optimizer(per_layer(net), lr=1e-2, policy="offload_all", overlap=False)
        scaler = make_scaler(**RULE)
        for step in range(steps):
            ref.backward(loss_at(ref_net, step, bad))
            ref.unscale(list(ref_net.parameters()))
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), max_norm)
            ref_skipped = ref.step(unscaled=True)
            scaler.scale(loss_at(net, step, bad)).backward()
            if unscale:
                scaler.unscale_(opt)
            norm = opt.clip_grad_norm_(max_norm)
            before = opt.stats()["skipped_steps"]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            assert (opt.stats()["skipped_steps"] > before) == ref_skipped == (step in bad), (unscale, step)
            assert scaler.get_scale() == ref.scale.item(), (unscale, step)
            if not ref_skipped and (unscale or step > 0):  # before its first step(), opt knows no scaler
                assert torch.allclose(norm.cpu(), ref_norm.cpu(), rtol=1e-5), (unscale, step, norm, ref_norm)
            for p, q in zip(net.parameters(), ref_net.parameters()):
                assert ulps(p, q) <= FP32_ULPS, (unscale, step, ulps(p, q).item())


def test_update_with_new_scale_and_load_state_dict_are_followed(device, make_scaler, monkeypatch):
    """scaler.update(new_scale) and scaler.load_state_dict change the scale otherwise than the rule: the
    mirror sees it (the scale's and tracker's version counters, whether update read this step's
    found-inf) and reads the scale again, once each; the steps stay those of the reference."""
    steps, bad = 10, {6}
    ref_net, net = make_net(device), make_net(device)
    ref = Reference(per_layer(ref_net), lr=1e-2, **RULE)
    opt = ferry.torch.Optimizer(per_layer(net), lr=1e-2, policy="offload_all")
    scaler = make_scaler(**RULE)
    reads = count_reads(monkeypatch)
    with no_warnings():
        for step in range(steps):
            new_scale = 96.0 if step == 2 else None  # not a power of two: the grads are not unscaled exactly
            ref.backward(loss_at(ref_net, step, bad))
            ref.step(new_scale=new_scale)
            scaler.scale(loss_at(net, step, bad)).backward()
            scaler.step(opt)
            scaler.update(new_scale)
            if step == 4:
                scaler.load_state_dict(dict(scaler.state_dict(), scale=4096.0, _growth_tracker=1))
                ref.scale.fill_(4096.0)
                ref.tracker.fill_(1)
            opt.zero_grad()
            assert scaler.get_scale() == ref.scale.item(), step
            for p, q in zip(net.parameters(), ref_net.parameters()):
                assert ulps(p, q) <= FP32_ULPS, (step, ulps(p, q).item())
    assert len(reads) == 3, reads  # the first step, after update(96.0), after load_state_dict


def test_a_scale_changed_behind_the_scalers_back_raises(device, make_scaler):
    """A write that bypasses the scale's version counter (through .data) is found by the check of the
    copy: RuntimeError naming both values; the next step reads the scale again and goes on."""
    net = make_net(device)
    opt = ferry.torch.Optimizer(per_layer(net), lr=1e-2, policy="offload_all")
    scaler = make_scaler(**RULE)
    for step in range(3):
        scaler.scale(loss_at(net, step, ())).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    scaler._scale.data.mul_(4.0)
    scaler.scale(loss_at(net, 3, ())).backward()
    with pytest.raises(RuntimeError, match=r"GradScaler's scale differs from Ferry's host mirror of it: the "
                                           r"scaler held scale 8192.0 .* the mirror said scale 2048.0"):
        scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale(loss_at(net, 4, ())).backward()
    scaler.step(opt)  # read again
    scaler.update()
    assert opt._amp.after[0] == scaler.get_scale()


def test_a_scaler_shared_with_another_optimizer(device, make_scaler):
    """A second optimizer (torch's SGD) stepped by the same scaler: its found-inf joins the update, so
    the scale is read at every step (warned once) and the steps stay those of the reference."""
    steps = 8
    ref_net, net = make_net(device), make_net(device)
    extra = torch.nn.Parameter(torch.ones(4, device=device))
    ref = Reference(per_layer(ref_net), lr=1e-2, **RULE)
    sgd = torch.optim.SGD([extra], lr=0.1)
    opt = ferry.torch.Optimizer(per_layer(net), lr=1e-2, policy="offload_all")
    scaler = make_scaler(**RULE)
    with pytest.warns(UserWarning, match="also steps another optimizer"):
        for step in range(steps):
            extra_bad = step in (2, 5)  # only the other optimizer overflows
            ref.backward(loss_at(ref_net, step, ()))
            ref.step(other_found_inf=extra_bad)
            scaler.scale(loss_at(net, step, ())).backward()
            scaler.scale((extra * (float("inf") if extra_bad else 1.0)).sum()).backward()
            scaler.step(opt)
            scaler.step(sgd)
            scaler.update()
            opt.zero_grad()
            sgd.zero_grad()
            assert scaler.get_scale() == ref.scale.item(), step
            for p, q in zip(net.parameters(), ref_net.parameters()):
                assert ulps(p, q) <= FP32_ULPS, (step, ulps(p, q).item())
    assert opt.stats()["skipped_steps"] == 0
    assert ref.scale.item() < RULE["init_scale"]  # the other optimizer's overflows backed it off


def test_attribute_contract(device):
    """torch's announced contract (GradScaler sets opt.grad_scale and opt.found_inf, having run its inf
    check): step() unscales by grad_scale (None after unscale_: 1)."""
    ref_net, net = make_net(device), make_net(device)
    ref = torch.optim.AdamW(ref_net.parameters(), lr=1e-2, foreach=False)
    opt = ferry.torch.Optimizer(net.parameters(), lr=1e-2, policy="offload_all")
    for step, scale in enumerate((256.0, None)):
        torch.nn.functional.mse_loss(ref_net(batch(device, step)[0]), batch(device, step)[1]).backward()
        ref.step()
        ref.zero_grad()
        loss = torch.nn.functional.mse_loss(net(batch(device, step)[0]), batch(device, step)[1])
        (loss * (scale or 1.0)).backward()
        opt.grad_scale = None if scale is None else torch.tensor(scale, device=device)
        opt.found_inf = torch.zeros((), device=device)
        opt.step()
        del opt.grad_scale, opt.found_inf
        opt.zero_grad()
        for p, q in zip(net.parameters(), ref_net.parameters()):
            assert ulps(p, q) <= FP32_ULPS, (step, ulps(p, q).item())


def test_no_future_warning_from_torch(device, make_scaler):
    """torch 2.x warns (FutureWarning) at each step of an optimizer whose step() takes grad_scaler;
    ferry._amp's filter (installed at import) drops that one warning, whatever else is shown."""
    net = make_net(device)
    opt = ferry.torch.Optimizer(per_layer(net), lr=1e-2, policy="offload_all")
    scaler = make_scaler(**RULE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _amp.quiet_torch_future_warning()
        for step in range(2):
            scaler.scale(loss_at(net, step, ())).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert not [w for w in caught if FUTURE in str(w.message)]
    assert warnings.filters[0][0] != "ignore" or FUTURE not in warnings.filters[0][1].pattern  # the block undid it


def test_cuda_autocast_fp16_against_torch_adamw_with_grad_scaler(device, monkeypatch):
    """On CUDA: autocast(fp16) and the real GradScaler, overlap on and attach(), against
    torch.optim.AdamW with its own GradScaler; steps 5 and 9 overflow (the loss times inf). The same
    skips and scale history as torch's; the same bits as Ferry without overlap; params within 1e-3 of
    torch's (fp16 activations round differently once the params differ by an fp32 ulp); no early work
    recomputed after the first step (whose announcements knew no scaler yet), and each clean step after
    a clean step keeps its early work; each Ferry optimizer read its scaler's scale once (torch's update
    bumps the scale's version counter as the mirror expects), and from the second step on scaler.step(opt)
    makes no host synchronization of torch's (sync debug mode "error")."""
    if device.type != "cuda":
        pytest.skip("CUDA only: autocast(fp16) and torch's GradScaler on a GPU (the CPU runs are above)")
    steps, bad = 14, {5, 9}
    rule = dict(init_scale=2.0 ** 6, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)

    def scaler_of():
        return torch.amp.GradScaler("cuda", **rule) if hasattr(torch.amp, "GradScaler") else \
            torch.cuda.amp.GradScaler(**rule)

    nets = [make_net(device) for _ in range(3)]
    ref = torch.optim.AdamW(per_layer(nets[0]), lr=1e-2, weight_decay=0.1)
    opt = ferry.torch.Optimizer(per_layer(nets[1]), lr=1e-2, weight_decay=0.1, policy="offload_all", overlap=True)
    plain = ferry.torch.Optimizer(per_layer(nets[2]), lr=1e-2, weight_decay=0.1, policy="offload_all", overlap=False)
    opt.attach(nets[1])
    scalers = [scaler_of() for _ in range(3)]
    reads = count_reads(monkeypatch)
    history = []
    with no_warnings():
        last_clean = False
        for step in range(steps):
            skips = []
            for net, o, scaler in zip(nets, (ref, opt, plain), scalers):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = loss_at(net, step, bad)
                scaler.scale(loss).backward()
                versions = [p.grad._version for p in net.parameters()]
                before = o.stats() if o is not ref else None
                if o is ref:
                    scaler.unscale_(o)
                    skips.append(sum(v.item() for v in scaler._found_inf_per_device(o).values()) > 0)
                # After the first step, scaler.step(opt) reads nothing of the device from torch (the
                # engine's own wait for its gradient check is not torch's, so not flagged).
                sync_debug = o is opt and step >= 1
                if sync_debug:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    scaler.step(o)
                finally:
                    if sync_debug:
                        torch.cuda.set_sync_debug_mode("default")
                if o is not ref:
                    assert [p.grad._version for p in net.parameters()] == versions, "a grad changed in place"
                    after = o.stats()
                    skips.append(after["skipped_steps"] > before["skipped_steps"])
                scaler.update()
                o.zero_grad()
                if o is opt and step >= 1:
                    assert after["early_groups_recomputed"] == before["early_groups_recomputed"], step
                    if last_clean and not skips[-1]:
                        assert after["early_groups_kept"] > before["early_groups_kept"], step
            assert skips == [step in bad] * 3, (step, skips)
            last_clean = not skips[0]
            assert len({s.get_scale() for s in scalers}) == 1, (step, [s.get_scale() for s in scalers])
            history.append(scalers[0].get_scale())
            assert opt._amp.after[0] == scalers[1].get_scale()
            opt.wait_params()
            for (name, p), q, r in zip(nets[1].named_parameters(), nets[2].parameters(), nets[0].parameters()):
                assert torch.equal(p, q), (step, name)
                assert (p - r).abs().max().item() <= 1e-3, (step, name, (p - r).abs().max().item())
    assert opt.overlapping and opt.stats()["deferred_steps"] > 0
    assert len(reads) == 2, reads
    assert max(history) > rule["init_scale"] and any(b < a for a, b in zip(history, history[1:])), history
