"""torch's GradScaler steps ferry.torch.Optimizer without changing a grad in place, so the overlap is kept.

    scaler = torch.amp.GradScaler("cuda")           # torch 1.13: torch.cuda.amp.GradScaler()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()                   # announces each param group as its grads are final
    scaler.step(opt)                                # the engine unscales, and skips on a NaN/Inf
    scaler.update()

For an ordinary optimizer, GradScaler.step unscales the grads in place (and torch 2.x's contract for
optimizers that handle the scale, `optimizer.grad_scale` / `found_inf`, first runs its inf check, which
multiplies them by 1.0 in place): the grads' version counters change, and the groups announced during
the backward are recomputed. This optimizer declares `_step_supports_amp_scaling` and takes
`grad_scaler=` in step(): GradScaler.step then calls `opt.step(grad_scaler=scaler)` and does nothing
to the grads (torch 1.13 always; torch 2.x because step's signature names the parameter. Its
FutureWarning about that contract, addressed to optimizer authors, is filtered below). The engine
divides the grads by the scale and skips the step on a NaN/Inf (StepOptions::loss_scale,
check_finite), and the step records that found-inf result where scaler.update() reads it
(`_per_optimizer_states[id(opt)]["found_inf_per_device"]`). After `scaler.unscale_(opt)` (stage
UNSCALED) the grads are unscaled already: loss_scale 1, and torch recorded found-inf itself (that step
recomputes its announced groups: unscale_ changed them in place). Should torch switch to the
attribute contract, step() reads `grad_scale` (one host sync) and stays exact.

The scale as a host float. The engine takes it as a float, the announcements during the backward
need it before step(), and the scaler keeps it in a device tensor whose .item() would make the host
wait for the GPU in the middle of the backward. So a host mirror follows it: read once (the first
step with a scaler, or after the scale changed otherwise than by scaler.update(): update(new_scale),
load_state_dict), then advanced by torch's own rule (_amp_update_scale_: times backoff_factor on
found-inf, times growth_factor after growth_interval clean steps unless that overflows float32; the
float32 scale times the double factor, rounded to float32) with the engine's skip as found-inf.
While a scaler steps the optimizer, the mirror is the default loss_scale of the announcements (and of
grads_ready()); a step without the scaler goes back to the constructor's. Which update ran is seen
without the device: update() reads the found-inf dict this step recorded (a dict that notes being
read) and bumps the scale's version counter once; update(new_scale) bumps it without reading the
dict; load_state_dict bumps both the scale's and the growth tracker's. Another optimizer stepped by the
same scaler adds its own found-inf to the rule's input: then the scale is read at every step (one
host sync each; warned once).

The mirror is checked without a sync: a step whose scale came from the mirror first copies the
scaler's scale and growth tracker into pinned host memory (non_blocking, on the current stream), and
the engine's step, whose gradient check waits for that stream anyway, lands the copy; once an event's
query() says it has (else at the next step), a value other than the mirror's raises RuntimeError
naming both. The next step then reads the scale again.
"""
import math
import struct
import warnings
import weakref

import torch


def quiet_torch_future_warning():
    """Filters the FutureWarning torch 2.x's GradScaler.step gives at every step of an optimizer whose
    step() takes grad_scaler (for optimizer authors; the contract it announces changes grads in place),
    and only that one. At import; code that imports ferry inside warnings.catch_warnings() (pytest's
    collection) loses it with the block."""
    # By its text: torch warns with the caller's frame (stacklevel), so the module is the trainer's.
    warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


quiet_torch_future_warning()


def _f32(x):
    """x rounded to float32 as C++'s static_cast<float>(double) rounds it (inf past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def next_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """torch's _amp_update_scale_ (CUDA and CPU kernels alike) on host values: the (scale, growth tracker)
    that GradScaler.update() makes of `scale` (a float32 value) and `tracker` given `found_inf`."""
    if found_inf:
        return _f32(scale * float(backoff_factor)), 0
    successful = tracker + 1
    if successful == growth_interval:
        grown = _f32(scale * float(growth_factor))
        return (grown if math.isfinite(grown) else scale), 0
    return scale, successful


def _stage(state):
    return getattr(state["stage"], "name", None) if state is not None else None


class _FoundInf(dict):
    """found_inf_per_device as a step recorded it ({device: tensor}); notes whether scaler.update() read it."""
    read = False

    def values(self):
        self.read = True
        return super().values()

    def items(self):
        self.read = True
        return super().items()


class _Mirror:
    """The host's copy of one GradScaler's scale and growth tracker (see the module's documentation)."""

    def __init__(self, scaler):
        self.scaler = weakref.ref(scaler)
        self.scale = None  # the scale the scaler held at the last step (or read), a float32 value; None: unknown
        self.tracker = None  # its growth tracker then
        self.after = None  # (scale, tracker) once update() has applied torch's rule to that step's found-inf
        self.tensors = None  # weakrefs to the scaler's _scale and _growth_tracker then
        self.versions = None  # their version counters then
        self.found_inf = None  # the _FoundInf that step recorded
        self.states = {}  # the scaler's per-optimizer states of that step (other optimizers in it: shared)
        self.shared = False
        self.pinned = None  # (scale, tracker): the check's copies
        self.event = None
        self.check = None  # (scale, tracker) the mirror gave for the copy in flight

    def known(self, scaler):
        """(scale, growth tracker) that `scaler` holds now, known without reading the device; None when not."""
        if self.scale is None or self.shared:
            return None
        s, g = scaler._scale, scaler._growth_tracker
        if s is None or g is None or self.tensors[0]() is not s or self.tensors[1]() is not g:
            return None
        ds, dg = s._version - self.versions[0], g._version - self.versions[1]
        read = self.found_inf is not None and self.found_inf.read
        if ds == 0 and dg == 0 and not read:
            return self.scale, self.tracker  # no update() since
        if ds == 1 and dg in (0, 1) and read and self.after is not None:
            return self.after  # update() ran the rule on that step's found-inf
        return None

    def read(self, scaler):
        """Reads the scaler's scale and growth tracker (a host sync on CUDA); returns them."""
        s, g = scaler._scale, scaler._growth_tracker
        self._seen(s, g, float(s.item()), int(g.item()))
        return self.scale, self.tracker

    def _seen(self, s, g, scale, tracker):
        self.scale, self.tracker = scale, tracker
        self.tensors = (weakref.ref(s), weakref.ref(g))
        self.versions = (s._version, g._version)
        self.after = None
        self.found_inf = None

    def stepped(self, scaler, scale, tracker, skipped, found_inf):
        """A step ran with the scaler at (scale, tracker): the rule's result for its update()."""
        self._seen(scaler._scale, scaler._growth_tracker, scale, tracker)
        self.found_inf = found_inf
        self.states = scaler._per_optimizer_states
        self.after = next_scale(scale, tracker, skipped, scaler._growth_factor, scaler._backoff_factor,
                                scaler._growth_interval)

    def copy_for_check(self, scaler, scale, tracker):
        """Copies the scaler's scale and tracker to the host without waiting; check() compares them."""
        s, g = scaler._scale, scaler._growth_tracker
        if self.pinned is None or self.pinned[0].shape != s.shape or self.pinned[1].shape != g.shape:
            pin = s.is_cuda
            self.pinned = (torch.empty(s.shape, dtype=torch.float32, pin_memory=pin),
                           torch.empty(g.shape, dtype=torch.int32, pin_memory=pin))
        self.pinned[0].copy_(s, non_blocking=True)
        self.pinned[1].copy_(g, non_blocking=True)
        if s.is_cuda:
            if self.event is None:
                self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(s.device))
        self.check = (scale, tracker)

    def check_copy(self, wait):
        """Compares the landed copy with what the mirror gave (wait: for the copy, if still in flight).
        Raises RuntimeError on a difference, after which the next step reads the scale again."""
        if self.check is None:
            return
        if self.event is not None and not self.event.query():
            if not wait:
                return
            self.event.synchronize()
        scale, tracker = self.check
        self.check = None
        got_scale, got_tracker = float(self.pinned[0].item()), int(self.pinned[1].item())
        if (got_scale, got_tracker) == (scale, tracker) or (math.isnan(got_scale) and math.isnan(scale)):
            return
        self.scale = None
        scaler = self.scaler()
        factors = "" if scaler is None else " (growth_factor %r, backoff_factor %r, growth_interval %r)" % (
            scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval)
        differs = [what for what, a, b in (("scale", got_scale, scale), ("growth tracker", got_tracker, tracker))
                   if a != b]
        raise RuntimeError(
            "ferry.torch.Optimizer: the GradScaler's %s %s from Ferry's host mirror of it: the scaler held "
            "scale %r and growth tracker %d at this step, the mirror said scale %r and growth tracker %d, and the "
            "step used the mirror's scale. Ferry reads the scale at the first step and after "
            "scaler.update(new_scale) or load_state_dict(), and otherwise applies torch's update rule%s to the "
            "engine's found-inf; something changed the scaler otherwise (a write into scaler._scale or "
            "_growth_tracker, a factor changed between step() and update(), a GradScaler subclass with a rule of "
            "its own?). The next step reads the scale again"
            % (" and ".join(differs), "differ" if len(differs) > 1 else "differs", got_scale, got_tracker, scale,
               tracker, factors))


class AmpMixin:
    """GradScaler's contract for optimizers that unscale and skip by themselves (see the module's
    documentation). The optimizer provides _step_ranks, _engine, _step_defaults, _warned, _warn_once."""

    _step_supports_amp_scaling = True  # GradScaler.step(opt) calls opt.step(grad_scaler=scaler)
    _amp = None  # the _Mirror of the scaler that steps this optimizer
    _amp_own_scale = None  # the constructor's loss_scale while the mirror is the default

    def _amp_called(self):
        """torch's newer contract: GradScaler.step set `grad_scale` and `found_inf` on the optimizer."""
        return getattr(self, "found_inf", None) is not None

    def _amp_plain(self):
        """A step without a scaler: the constructor's loss_scale is the default again."""
        if self._amp is not None:
            self._step_defaults["loss_scale"] = self._amp_own_scale
            self._amp = None

    def _amp_loss_scale(self):
        """The scale the grads carry now (clip_grad_norm_ divides its norm by it): 1 after
        scaler.unscale_(opt); else the scaler's (one host sync when the mirror does not know it)."""
        m = self._amp
        scaler = m.scaler() if m is not None else None
        if scaler is None:
            return self._step_defaults["loss_scale"]
        if _stage(scaler._per_optimizer_states.get(id(self))) == "UNSCALED":
            return 1.0
        known = m.known(scaler)
        return (known or m.read(scaler))[0]

    def _scaled_step(self, scaler, closure, loss_scale, max_grad_norm, check_finite):
        """step(grad_scaler=scaler): GradScaler.step's call (or torch's attribute contract: scaler None)."""
        if loss_scale is not None:
            raise ValueError("step(): loss_scale=%r given with a GradScaler, which sets the loss scale: pass one "
                             "of them" % (loss_scale,))
        if check_finite is not None and not check_finite:
            raise ValueError("step(): check_finite=False with a GradScaler: the engine's NaN/Inf check is the "
                             "scaler's found-inf")
        self._warned.add("nonfinite")  # a GradScaler's skipped steps are expected: no warning
        if scaler is None:
            # torch's attribute contract: its inf check ran in place (the announced groups are recomputed)
            # and recorded found-inf; grad_scale is None after scaler.unscale_(opt).
            grad_scale = getattr(self, "grad_scale", None)
            return self._step_ranks(closure, 1.0 if grad_scale is None else float(grad_scale), max_grad_norm, True)
        state = scaler._per_optimizer_states[id(self)]
        m = self._amp
        if m is None or m.scaler() is not scaler:
            if m is None:
                self._amp_own_scale = self._step_defaults["loss_scale"]
            m = self._amp = _Mirror(scaler)
        m.check_copy(wait=True)  # the last step's, if it had not landed then (it has, by now)
        me = id(self)
        if not m.shared and (any(k != me for k in m.states) or any(k != me for k in scaler._per_optimizer_states)):
            m.shared = True
            self._warn_once("amp shared", "the GradScaler also steps another optimizer, whose found-inf joins its "
                            "update: Ferry reads the scaler's scale at each step (one host sync per step) instead "
                            "of following it on the host")
        known = m.known(scaler)
        if known is None:
            scale, tracker = m.read(scaler)
        else:
            scale, tracker = known
            m.copy_for_check(scaler, scale, tracker)
        unscaled = _stage(state) == "UNSCALED"
        skipped_before = self._engine.stats()["skipped_steps"]
        loss = self._step_ranks(closure, 1.0 if unscaled else scale, max_grad_norm, True)
        skipped = self._engine.stats()["skipped_steps"] != skipped_before
        if unscaled:
            found_inf = _FoundInf(state["found_inf_per_device"])  # unscale_'s own
        else:
            s = scaler._scale
            found_inf = _FoundInf({s.device: torch.full_like(s, 1.0 if skipped else 0.0)})
        state["found_inf_per_device"] = found_inf
        m.stepped(scaler, scale, tracker, skipped, found_inf)
        self._step_defaults["loss_scale"] = m.after[0]  # the announcements of the next backward
        m.check_copy(wait=False)
        return loss
