"""ferry.torch.Optimizer.attach(model): the next forward waits per layer for its own params.

With the optimizer attached, step() returns without making the stream wait for the uploads of the
new params (the engine's StepOptions wait_for_params=false), and a forward pre-hook on every module
that owns params of the optimizer (its own, recurse=False) makes the current stream wait, before the
module's forward, for the param groups of those params only (Engine.wait_params), once per step:
the first module of a group waits, later ones find it done. A module owning params of several groups
waits for each of them; a group spread over several modules is waited for by the first of them to
run. Groups none of whose params a module owns are waited for right after step(). The hooks cost a
set lookup per module and one stream wait per group and step; no host synchronization.

After a deferred step the engine may still read a group's grads until that wait, so zero_grad()
zeroes such a group's grads at the wait (Optimizer._wait_groups). A grad hook on every param makes
sure of it before a backward accumulates into a grad whose group nothing waited for yet (a param
used outside the forward of the modules owning it).
"""
import weakref

import torch

from . import _zero


class ModuleWaits:
    """The forward pre-hooks of one attach(model)."""

    def __init__(self, optimizer, model, group_index):
        """group_index: {id(param): its param group's index} of the optimizer's params."""
        me = weakref.ref(optimizer)
        self.handles = []
        self.owned = set()
        for module in model.modules():
            groups = sorted({group_index[id(p)] for p in module.parameters(recurse=False) if id(p) in group_index})
            if groups:
                self.owned.update(groups)
                self.handles.append(module.register_forward_pre_hook(_pre_hook(me, tuple(groups))))
        if not self.handles:
            raise ValueError("attach: no module of %s owns a param of this optimizer" % type(model).__name__)
        for p in optimizer._params:
            if p.requires_grad and id(p) in group_index:
                self.handles.append(p.register_hook(_grad_hook(me, group_index[id(p)])))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _grad_hook(me, group):
    def hook(_grad):
        opt = me()
        if opt is not None and group in opt._zero_pending:
            opt._wait_groups((group,))
    return hook


def _pre_hook(me, groups):
    def hook(_module, _inputs):
        opt = me()
        if opt is not None:
            opt._wait_groups(groups)
    return hook


class AttachMixin:
    """ferry.torch.Optimizer's attach(), detach() and wait_params(): the next forward waits per layer.
    Uses the optimizer's _waits (the ModuleWaits of attach(), or None), _pending (groups whose new
    params no stream waited for yet), _zero_pending (of those, groups whose grads zero_grad() left for
    the wait), _group_of, _grads, _zeroed, _groups, _engine, _stream() and _tracker."""

    def attach(self, model):
        """Forward pre-hooks on the modules of `model` that own params of this optimizer: step() then
        returns without waiting for the uploads of new params, and each module's forward waits only
        for its own groups' params (above). The same bits as without it. Code that reads a
        param outside the forward of a module owning it calls opt.wait_params() first. Returns self."""
        if self._waits is not None:
            raise RuntimeError("attach: the optimizer is attached already; detach() first")
        dtensors = [self._where[k] for k, p in enumerate(self._params) if _zero.is_dtensor(p)]
        if dtensors:
            raise ValueError("attach: %s is a DTensor (FSDP2): FSDP2's own forward pre-hook (registered with "
                             "prepend=True) all-gathers a module's params before any hook of Ferry's could wait for "
                             "their upload. Leave the optimizer unattached: step() waits for every upload, and "
                             "overlap=True still announces each group once its reduce-scatter has landed" % dtensors[0])
        index = {id(p): self._group_of[k] for k, p in enumerate(self._params)}
        self._waits = ModuleWaits(self, model, index)
        return self

    def detach(self):
        """Removes attach()'s hooks; the stream waits for every pending upload, and steps wait again."""
        if self._waits is not None:
            self._waits.remove()
            self._waits = None
        self.wait_params()

    def wait_params(self, groups=None):
        """Makes the current stream wait for the new params of `groups` (param group indices; None:
        all) from the last step, where it has not yet (only with attach())."""
        if self._pending:
            self._wait_groups(sorted(self._pending) if groups is None else groups)

    def _wait_groups(self, groups):
        if not self._pending:
            return
        with self._engine_lock:  # attach_ddp's comm hook may announce from another thread
            self._wait_groups_locked(groups)

    def _wait_groups_locked(self, groups):
        need = [gi for gi in groups if gi in self._pending]
        if not need:
            return
        self._engine.wait_params([self._groups[gi] for gi in need], stream=self._stream())
        self._pending.difference_update(need)
        zero = [gi for gi in need if gi in self._zero_pending]
        if zero:  # zero_grad() of these groups, now ordered after the engine's reads of their grads
            self._zero_pending.difference_update(zero)
            bufs = [k for k, gi in enumerate(self._group_of) if gi in zero]
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
