"""ferry.torch.Optimizer.attach(model): the next forward waits per layer for its own params.

With the optimizer attached, step() returns without making the stream wait for the uploads of the
new params (the engine's StepOptions wait_for_params=false), and a forward pre-hook on every module
that owns params of the optimizer (its own, recurse=False) makes the current stream wait, before the
module's forward, for the buckets holding those params only (Engine.wait_params_of: after a deferred
step, only the part of the update holding them), once per step: the first module of a bucket waits,
later ones find it done. Buckets none of whose params a module owns are waited for right after
step(). The hooks cost a set lookup per module and one engine call per bucket and step; no host
synchronization. So a model in one param group starts its next forward while the params of its later
layers still update, as one with a group per layer does. With units= (modules of the model, e.g. a
transformer's blocks) the pre-hook sits on each unit instead, for every param under it, and the
modules outside the units keep theirs: fewer hooks, hence fewer splits of a forward torch.compile
compiled (each hook runs between its graphs), each unit waiting for all of its params at its start.

FSDP2 (DTensor params): FSDP2's own forward pre-hook (registered with prepend=True) all-gathers a
module's params, and its copy-in of the local shards runs on a stream of FSDP2's (the all-gather
copy-in stream, or the current one for explicit prefetches), which waits for the current stream only
at the root's forward. So Fsdp2Waits registers its hooks with prepend=True on each module fully_shard
was applied to (they run before FSDP2's), for the params of that module's FSDP2 param groups and of
the modules its forward prefetches (set_modules_to_forward_prefetch), and makes both the current
stream and the copy-in stream wait for their buckets.

After a deferred step the engine may still read a bucket's grads until that wait, so zero_grad()
zeroes such a bucket's grads at the wait (Optimizer._wait_units). A grad hook on every param makes
sure of it before a backward accumulates into a grad whose bucket nothing waited for yet (a param
used outside the forward of the modules owning it).

Under FSDP2, attach() warns when the root's unit holds a tenth or more of the offloaded params
(_warn_if_root_unit_large: that unit is reduced last and gathered first).
"""
import importlib
import warnings
import weakref

import torch

from . import _buckets
from . import _zero


class _Waits:
    """What the hooks of attach() share: their handles, the params some module owns, and a grad hook
    per param (the deferred zeroing before a backward accumulates into a bucket nothing waited for).

    Whether the forward ran them: since the last step, the params whose module's pre-hook ran (or
    that wait_params() waited for), `seen`, and the owned params that got a grad, `grads`. A forward
    that does not run the hooks (a model torch.compile compiled before attach(): by default its
    compiled code ignores hooks added later) would read the params of a deferred step before their
    update; verdict() tells step() not to defer then."""

    def _init_seen(self):
        self.seen = set()  # params (k) a pre-hook or wait_params() waited for since the last step
        self.grads = set()  # owned params (k) that got a grad since the last step
        self.deferred = False  # the last step left its params to the hooks of the next forward
        self.steps = 0  # steps since attach()

    def _add_grad_hooks(self, optimizer, me, index):
        for k, p in enumerate(optimizer._params):
            if p.requires_grad and id(p) in index:
                self.handles.append(p.register_hook(_grad_hook(me, k)))

    def _add_state_dict_hooks(self, model, me, index):
        """model.state_dict() and model.load_state_dict(), over the model or any module of it owning a
        param of the optimizer, first wait for the last step's uploads: state_dict() hands out the
        params' memory (torch.save reads it next) and a load writes it, while after a deferred step
        the update still uploads into it. torch's post-hook of state_dict and pre-hook of the load
        (the underscored names: torch 1.13 has no public ones; 2.x keeps them)."""
        def wait(*_args):
            opt = me()
            if opt is not None and opt._pending:
                opt._wait_params()
        for module in model.modules():
            if module is model or any(id(p) in index for p in module.parameters(recurse=False)):
                self.handles.append(module._register_state_dict_hook(wait))
                self.handles.append(module._register_load_state_dict_pre_hook(wait))

    def verdict(self):
        """At step(), before the engine's step: (whether the step may leave its params to the next
        forward's hooks, the owned params that got a grad in a forward that did not wait for them,
        whether such a forward followed a deferred step). Starts the next step's record."""
        unwaited = sorted(self.grads - self.seen)
        raced = bool(unwaited) and self.deferred
        waiting = bool(self.seen) and not unwaited
        if self.steps == 0:  # the forward may have come before attach(): no verdict on its hooks
            unwaited = []
        self.seen, self.grads, self.deferred = set(), set(), False
        self.steps += 1
        return waiting, unwaited, raced

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


class ModuleWaits(_Waits):
    """The forward pre-hooks of one attach(model): on each unit (units=), for every param under it,
    and on each module outside the units that owns params, for its own."""

    def __init__(self, optimizer, model, index, units=None):
        """index: {id(param): its index k among the optimizer's params}."""
        me = weakref.ref(optimizer)
        self.handles = []
        self.owned = set()  # params (k) some module owns
        self._init_seen()
        hooked = []  # (module, the params its pre-hook waits for)
        inside = set()  # id() of every module of a unit
        for unit in _checked_units(model, units):
            inside.update(id(m) for m in unit.modules())
            ks = tuple(sorted({index[id(p)] for p in unit.parameters() if id(p) in index}))
            if ks:
                hooked.append((unit, ks))
        for module in model.modules():
            if id(module) in inside:
                continue
            ks = tuple(sorted({index[id(p)] for p in module.parameters(recurse=False) if id(p) in index}))
            if ks:
                hooked.append((module, ks))
        for module, ks in hooked:
            self.owned.update(ks)
            self.handles.append(module.register_forward_pre_hook(_pre_hook(me, ks)))
            if optimizer._gathering() and optimizer._zero.ahead_after:
                self.handles.append(module.register_forward_hook(_ahead_hook(me, ks)))
        if not self.handles:
            raise ValueError("attach: no module of %s owns a param of this optimizer" % type(model).__name__)
        if optimizer._gathering():  # ZeRO-1: the units no module's forward gathered, once it returns
            self.handles.append(model.register_forward_hook(_post_hook(me)))
        self._add_grad_hooks(optimizer, me, index)
        self._add_state_dict_hooks(model, me, index)


def _checked_units(model, units):
    """attach()'s units= as a list of modules of `model`, none inside another. A ModuleList or
    Sequential stands for its modules, a ModuleDict for its values; errors name the unit at fault."""
    if units is None:
        return []
    if isinstance(units, (torch.nn.ModuleList, torch.nn.Sequential)):
        units = list(units)
    elif isinstance(units, torch.nn.ModuleDict):
        units = list(units.values())
    elif isinstance(units, torch.nn.Module):
        units = [units]
    else:
        try:
            units = list(units)
        except TypeError:
            raise TypeError("attach: units= takes modules (a ModuleList, or an iterable of modules), got %s"
                            % type(units).__name__) from None
    of_model = {id(m) for m in model.modules()}
    for i, unit in enumerate(units):
        what = "units[%d] (%s)" % (i, type(unit).__name__)
        if not isinstance(unit, torch.nn.Module):
            raise TypeError("attach: %s is not a torch.nn.Module" % what)
        if isinstance(unit, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            raise ValueError("attach: %s is a container whose forward never runs, so its pre-hook would "
                             "never wait: pass its modules (units=model.blocks, not [model.blocks])" % what)
        if id(unit) not in of_model:
            raise ValueError("attach: %s is not a module of %s" % (what, type(model).__name__))
    for i, unit in enumerate(units):
        for j, other in enumerate(units):
            if i != j and any(m is unit for m in other.modules()):
                raise ValueError("attach: units[%d] (%s) is %s units[%d] (%s): units may not nest"
                                 % (i, type(unit).__name__, "the same module as" if unit is other else "inside",
                                    j, type(other).__name__))
    return units


def _eager(hook):
    """A forward hook that torch.compile calls as it is, between graphs (torch.compiler.disable),
    rather than tracing it: it calls into the engine and reads the optimizer's
    state of the step, on which compiled code would otherwise guard (and recompile as it changes)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)  # torch >= 2.1
    if disable is None and hasattr(torch, "compile"):  # torch 2.0
        disable = importlib.import_module("torch._dynamo").disable
    return hook if disable is None else disable(hook)


def _fsdp_state(module):
    """FSDP2's state of a module fully_shard was applied to, or None."""
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return None
    try:
        return get()
    except (AssertionError, RuntimeError):
        return None


def _fsdp_groups(state):
    """The FSDPParamGroups of an FSDP2 state (one before torch's per-param meshes, a list after)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def _fsdp_params(state):
    """The sharded params (the module's nn.Parameters, DTensors) an FSDP2 state all-gathers."""
    return [fp.sharded_param for g in _fsdp_groups(state) for fp in g.fsdp_params]


class Fsdp2Waits(_Waits):
    """attach(model) over FSDP2: hooks that run before FSDP2's pre-forward (above)."""

    def __init__(self, optimizer, model, index):
        me = weakref.ref(optimizer)
        self.handles = []
        self.owned = set()
        self._init_seen()
        # Every module of a state: fully_shard([a, b]) gives a and b one state, whose all-gather runs
        # at the pre-forward of whichever of them runs first.
        for module in model.modules():
            state = _fsdp_state(module)
            if state is None:
                continue
            try:
                ks = tuple(sorted({index[id(p)] for p in _fsdp_params(state) if id(p) in index}))
            except AttributeError as e:
                raise ValueError("attach: this torch's FSDP2 state of %s has no param groups Ferry knows (%s); "
                                 "leave the optimizer unattached" % (type(module).__name__, e)) from None
            self.owned.update(ks)
            self.handles.append(module.register_forward_pre_hook(_fsdp_pre_hook(me, state, ks, index),
                                                                 prepend=True))
        if not self.handles:
            raise ValueError("attach: %s has DTensor params but no module of it is an FSDP2 module (fully_shard)"
                             % type(model).__name__)
        self._add_grad_hooks(optimizer, me, index)
        self._add_state_dict_hooks(model, me, index)
        _warn_if_root_unit_large(optimizer, model, index)


# The share of the offloaded params from which FSDP2's root unit draws a warning at attach().
ROOT_UNIT_SHARE = 0.1


def _warn_if_root_unit_large(optimizer, model, index):
    """FSDP2 reduce-scatters a unit's grads once the backward of all its modules has run, and
    all-gathers it before the first of them runs forward. The root's unit (what fully_shard(model)
    holds beyond the units made before it: written as torch's FSDP2 example writes it, the embeddings,
    the final norm and the head) is therefore the last to be reduced and the first to be gathered:
    its offloaded update can start only once the backward ends, and the next forward waits for all of
    it. Warns when it holds ROOT_UNIT_SHARE or more of the offloaded params."""
    state = _fsdp_state(model)
    if state is None:
        return
    try:
        root = [index[id(p)] for p in _fsdp_params(state) if id(p) in index]
    except AttributeError:  # a torch whose FSDP2 state Ferry does not know: __init__ has said so
        return
    offloaded = {d["param_group"] for d in optimizer.placement() if d["offloaded"]}
    params = optimizer._params
    total = sum(params[k].numel() for k in range(len(params)) if optimizer._group_of[k] in offloaded)
    mine = [k for k in root if optimizer._group_of[k] in offloaded]
    share = sum(params[k].numel() for k in mine) / total if total else 0.0
    if share < ROOT_UNIT_SHARE:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    held = sorted(mine, key=lambda k: -params[k].numel())
    listed = ", ".join(names.get(id(params[k]), optimizer._where[k]) for k in held[:3])
    # fully_shard swaps the model's class for a subclass named FSDP<its class>: name the user's class.
    cls = type(model)
    name = next((c.__name__ for c in cls.__mro__[1:] if "FSDP" + c.__name__ == cls.__name__), cls.__name__)
    optimizer._warn_once(
        "fsdp2_root_unit",
        "FSDP2's root unit (fully_shard(%s)) holds %.0f%% of the offloaded params (%s%s): FSDP2 reduce-scatters "
        "it after the whole backward and all-gathers it before the first forward of its modules, so its CPU "
        "update runs between the backward and the next forward while the GPU waits. Give its large modules "
        "units of their own before fully_shard(model), as torchtitan does (fully_shard(model.embed), each block, "
        "fully_shard([model.norm, model.head])): the head's grads are then reduced first and updated during the "
        "backward (bindings/python/README.md, FSDP2, 'Which units')"
        % (name, 100 * share, listed, ", ..." if len(held) > 3 else ""))


def _named(where, ks):
    """(up to three params of `ks` named, and "was" / "were"; "it" / "them") for an error's sentence."""
    names = ", ".join(where[k] for k in ks[:3]) + (", ..." if len(ks) > 3 else "")
    return (names + (" were" if len(ks) > 1 else " was"), "them" if len(ks) > 1 else "it")


def _fsdp_pre_hook(me, state, own, index):
    def hook(_module, _inputs):
        opt = me()
        if opt is None:
            return
        ks = set(own)
        for target in getattr(state, "_states_to_forward_prefetch", ()):  # all-gathered from this pre-forward
            ks.update(index[id(p)] for p in _fsdp_params(target) if id(p) in index)
        if opt._waits is not None:
            opt._waits.seen.update(ks)
        if not ks or not opt._pending:
            return
        ctx = getattr(state, "_comm_ctx", None)
        copy_in = getattr(ctx, "all_gather_copy_in_stream", None) if opt._cuda else None
        opt._wait_units({opt._unit_of[k] for k in ks}, also=copy_in)
    return _eager(hook)


def _grad_hook(me, k):
    def hook(_grad):
        opt = me()
        if opt is None:
            return
        waits = opt._waits
        if waits is not None and k in waits.owned:
            waits.grads.add(k)
        if opt._pending and opt._unit_of[k] in opt._pending:  # the engine may still read the buffer
            opt._wait_units((opt._unit_of[k],))
    return hook


def _pre_hook(me, ks):
    def hook(_module, _inputs):
        opt = me()
        if opt is None:
            return
        if opt._waits is not None:
            opt._waits.seen.update(ks)
        if opt._zero is not None and opt._zero.gathers_pending:
            opt._gather_through(ks, ahead=not opt._zero.ahead_after)
        if opt._pending:
            opt._wait_units({opt._unit_of[k] for k in ks})
    return _eager(hook)


def _ahead_hook(me, ks):
    def hook(_module, _inputs, _output):
        opt = me()
        if opt is not None and opt._zero.gathers_pending:
            opt._gather_through(ks, launch=True)
    return _eager(hook)


def _post_hook(me):
    def hook(_module, _inputs, _output):
        opt = me()
        if opt is not None and opt._zero.gathers_pending:
            opt._gather_through(range(len(opt._params)))
    return _eager(hook)


class AttachMixin:
    """ferry.torch.Optimizer's attach(), detach() and wait_params(): the next forward waits per layer.
    Uses the optimizer's _waits (the ModuleWaits of attach(), or None), _pending (buckets whose new
    params no stream waited for yet), _zero_pending (of those, buckets whose grads zero_grad() left for
    the wait), _units, _unit_of, _unit_names, _grads, _zeroed, _engine, _stream() and _tracker."""

    def attach(self, model, units=None):
        """Forward pre-hooks on the modules of `model` that own params of this optimizer: step() then
        returns without waiting for the uploads of new params, and each module's forward waits only
        for the buckets holding its own params (above). The same bits as without it. Code that reads
        a param outside the forward of a module owning it calls opt.wait_params() first. Returns self.

        units: modules of `model` (a ModuleList such as a transformer's blocks, or an iterable of
        modules; none inside another) whose forward waits once for every param under it, instead of
        each of their modules that owns params waiting for its own. Fewer hooks: a forward compiled by
        torch.compile runs each hook between its graphs, so each one splits the compiled code. Each
        unit then waits for the update of all of its params before its first layer runs."""
        if self._waits is not None:
            raise RuntimeError("attach: the optimizer is attached already; detach() first")
        index = {id(p): k for k, p in enumerate(self._params)}
        if any(_zero.is_dtensor(p) for p in self._params):
            if units is not None:
                raise ValueError("attach: units= does not apply under FSDP2: its forward waits at the modules "
                                 "fully_shard was applied to")
            self._waits = Fsdp2Waits(self, model, index)
        else:
            self._waits = ModuleWaits(self, model, index, units)
        return self

    def detach(self):
        """Removes attach()'s hooks; the stream waits for every pending upload, and steps wait again."""
        if self._waits is not None:
            self._waits.remove()
            self._waits = None
        self._wait_params()

    def wait_params(self, groups=None):
        """Makes the current stream wait for the new params of `groups` (param group indices; None:
        all) from the last step, where it has not yet (only with attach()). With attach(), what reads
        a param outside the forward of a module owning it calls this first."""
        if self._waits is not None:
            picked = None if groups is None else set(groups)
            self._waits.seen.update(k for k in range(len(self._params))
                                    if picked is None or self._group_of[k] in picked)
        self._wait_params(groups)

    def _forward_waits(self):
        """At step() with attach(): whether this step may leave its params to the hooks of the next
        forward (the last forward ran them for every param it took a grad of). Warns where the hooks
        did not run: once, and at every step where such a forward followed a deferred step (it may
        have read params before their update: this step then takes grads of partly updated params)."""
        waiting, unwaited, raced = self._waits.verdict()
        if not unwaited:
            return waiting
        names = ", ".join(self._where[k] for k in unwaited[:3]) + (", ..." if len(unwaited) > 3 else "")
        see = "engine/TROUBLESHOOTING.md#a-forward-without-attachs-hooks"
        if raced:
            warnings.warn(
                "ferry.torch.Optimizer: attach(): the forward before this step read %s without the forward "
                "pre-hook of its module while the last step's update of it was left to that hook, so it may have "
                "read some of those params before their update, and this step's grads come from them (not the "
                "bits of a step without attach()). step() now waits for the params itself until the hooks run "
                "again. The hooks do not run in a model torch.compile compiled before attach() (attach() before "
                "its first call) or for a param read outside the forward of the module owning it (call "
                "opt.wait_params() before; %s)" % (names, see), RuntimeWarning, stacklevel=4)
            return False
        self._warn_once("hooks", "attach(): the forward before this step did not run the forward pre-hooks of the "
                        "modules owning %s (a model compiled by torch.compile before attach() ignores hooks added "
                        "later: attach() before its first call, and torch._dynamo.reset() before it where another "
                        "model of its class was compiled first): step() waits for those params itself instead "
                        "of leaving them to the next forward (the same bits, less overlap; %s)" % (names, see))
        return False

    def _wait_params(self, groups=None):
        """wait_params() for Ferry's own use: not counted as the forward's wait (_Waits.seen)."""
        if self._zero is not None and self._zero.gathers_pending:
            self._gather_through(range(len(self._params)))  # ZeRO-1: every unit (they go in order)
        if self._pending:
            self._wait_units(sorted(self._pending) if groups is None else self._units_of_groups(groups))

    def _wait_units(self, units, also=None):
        """The current stream (and the torch stream `also`, where given) waits for these buckets."""
        if not self._pending:
            return
        with self._engine_lock:  # attach_ddp's comm hook may announce from another thread
            self._wait_units_locked(units, also)

    def _wait_units_locked(self, units, also=None):
        need = sorted(u for u in units if u in self._pending)
        if not need:
            return
        names = self._unit_names[need[0]] if len(need) == 1 else [n for u in need for n in self._unit_names[u]]
        with _buckets.annotate("ferry.wait_params"):
            self._engine.wait_params_of(names, stream=self._stream())
            if also is not None and also.cuda_stream != self._stream():
                self._engine.wait_params_of(names, stream=also.cuda_stream)
        # A grad buffer changed in place since the step (not by Ferry: it changes none of them until
        # this wait) may have been read changed by the step's update, which runs beside the forward.
        changed = sorted(k for u in need for k in self._units[u]
                         if self._grads[k]._version != self._step_versions[k])
        # So would a param written in place since (a copy_ into it): the update's upload may land on it.
        written = sorted(k for u in need for k in self._units[u]
                         if self._watch_params and self._params[k]._version != self._param_versions[k])
        self._pending.difference_update(need)
        zero = [u for u in need if u in self._zero_pending]
        if zero:  # zero_grad() of these buckets, now ordered after the engine's reads of their grads
            self._zero_pending.difference_update(zero)
            bufs = [k for u in zero for k in self._units[u]]
            # DDP (gradient_as_bucket_view=True) may have copied these grads into its bucket and
            # pointed p.grad at the bucket's view since zero_grad() (its forward rebuilds the
            # buckets before the modules' pre-hooks run): that copy is zeroed too.
            moved = [self._params[k].grad for k in bufs
                     if self._params[k].grad is not None and self._params[k].grad is not self._grads[k]]
            with torch.no_grad():
                torch._foreach_zero_([self._grads[k] for k in bufs] + moved)
            for k in bufs:
                self._zeroed[k] = self._grads[k]._version
        if self._tracker.trace is not None:
            self._tracker.trace.append(("wait", tuple(need)))
        if written:
            raise RuntimeError(
                "ferry.torch.Optimizer: %s changed in place after step() while that step's update, left to the "
                "next forward by attach(), was still writing %s: the update's upload may land on it. Call "
                "opt.wait_params() before writing params after step() (model.load_state_dict() waits itself); "
                "Ferry then refreshes the masters from them "
                "(engine/TROUBLESHOOTING.md#a-grad-or-param-changed-after-step)" % _named(self._where, written))
        if changed:
            raise RuntimeError(
                "ferry.torch.Optimizer: the %s of %s changed in place after step() while that step's update, "
                "left to the next forward by attach(), could still read %s: the step may have used the changed "
                "values (not the bits of torch's loop). model.zero_grad() with set_to_none=False (torch 1.13's "
                "default) does this. Zero the grads with opt.zero_grad() (each bucket is zeroed once its update "
                "has read it) or model.zero_grad(set_to_none=True), or call opt.wait_params() before changing a "
                "grad after step() (engine/TROUBLESHOOTING.md#a-grad-or-param-changed-after-step)"
                % (("grads" if len(changed) > 1 else "grad",) + _named(self._where, changed)))
