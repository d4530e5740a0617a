"""ferry.torch.Optimizer's buckets and announcements: the units of overlap (runs of bucket_mb of
grads in the order the first backward finished them, across param groups), the announcement of a
bucket's params to the engine (Engine.grads_ready_params) from the grad hooks (ferry/_hooks.py) or
attach_ddp's comm hook (ferry/_ddp.py), grads_ready() by hand, and accumulate(); copy_all, the
grads' copies into the optimizer's buffers, batched."""
import contextlib

import torch

from . import _zero

_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)  # torch >= 2.2
_PROFILING = getattr(torch.autograd, "_profiler_enabled", None)


def annotate(name):
    """torch.profiler's record_function(name) while a profiler runs, else nothing (the hooks run
    hundreds of times a step): `ferry trace` of the ranks' torch.profiler traces splits each compute
    stream's wait for its host by the innermost such range (ferry.wait_params, ferry.gather, ...)."""
    if _PROFILING is not None and _PROFILING():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def copy_all(dsts, srcs):
    """dst.copy_(src) for each pair, on the current stream: one foreach launch where torch has it (a
    bucket's grads: tens of copies, each a launch from the autograd thread otherwise)."""
    if len(dsts) > 1 and _FOREACH_COPY is not None:
        _FOREACH_COPY(dsts, srcs)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


class BucketMixin:
    """Uses the optimizer's _params, _names, _group_of, _groups, _bucket_bytes, _tracker, _engine,
    _step_options, _by_hand, _check_unchanged(), _options(), _take_grads(), _has_grad(), _stream() and
    wait_params()."""

    # ---- buckets --------------------------------------------------------------------------------------

    def _set_units(self, order, tracker=True):
        """The buckets (units of announcement and of attach()'s waits): the params in `order` (the order
        a backward finishes their grads) cut into runs of about _bucket_bytes of grads, then the params
        `order` does not hold (no grad in that backward) in reverse order, cut the same way."""
        order = list(order)
        seen = set(order)
        order += [k for k in range(len(self._params) - 1, -1, -1) if k not in seen]
        units, unit, size = [], [], 0
        for k in order:
            unit.append(k)
            size += _zero.local(self._params[k]).numel() * self._params[k].element_size()
            if size >= self._bucket_bytes:
                units.append(unit)
                unit, size = [], 0
        if unit:
            units.append(unit)
        self._units = units
        self._unit_of = [0] * len(self._params)
        for u, ks in enumerate(units):
            for k in ks:
                self._unit_of[k] = u
        self._unit_names = [[self._names[k] for k in ks] for ks in units]
        if tracker:
            self._tracker.set_units(self._unit_of, len(units))

    def _units_of_groups(self, groups):
        gs = set(groups)
        return sorted({self._unit_of[k] for k in range(len(self._params)) if self._group_of[k] in gs})


    # ---- announcing (overlap=, grads_ready) -----------------------------------------------------

    def _announce_from_hook(self, u, take=True):
        """Bucket u's grads are final in this backward (called by the hooks). Returns whether it was
        announced."""
        return self._announce_params_from_hook(self._units[u], take=take)

    def _announce_params_from_hook(self, ks, take=True):
        """The grads of params `ks` are final in this backward (the hooks; take=False: attach_ddp's comm
        hook, which copied them into the buffers). Returns whether any was announced."""
        ks = [k for k in ks if k not in self._tracker.announced]  # by hand already
        if not ks:
            return False
        if self._step_options is None:
            self._step_options = self._check_unchanged()
            self._wait_params()  # refused once a param is announced: the uploads of the last step first
            self._sync_changed_params()  # so is reading masters: params the trainer wrote first
        self._announce(ks, self._step_options, self._options(None, None, None), take=take)
        return True

    def _announce(self, ks, per_step, options, take=True):
        if take:
            with torch.no_grad():
                self._take_grads(ks)  # on the current stream, before the announcement
        with annotate("ferry.announce"):
            self._engine.grads_ready_params([self._names[k] for k in ks], **per_step, **options,
                                            stream=self._stream())
        self._tracker.announced.update(ks)
        if take:  # attach_ddp: the versions are recorded once DDP is done with p.grad (ferry._ddp)
            self._tracker.record_versions(ks)

    def grads_ready(self, groups=None, *, loss_scale=None, max_grad_norm=None, check_finite=None):
        """Starts the coming step of param groups whose grads are final (indices into param_groups;
        None: every group not announced yet), by hand (`overlap=` does it from hooks): call it after
        the last backward that accumulates into them, with the options step() will get. Offloaded
        groups then copy their grads down, run CPU Adam and upload new params in the background, on
        the current stream's order; step() completes the step and keeps that work only when it is
        exact (no clipping triggered, the same lr and options), so the result is the same bits as
        without this call. Until step(), do not change these grads or read these params. Every param
        of an announced group must have a grad."""
        announced = self._tracker.announced
        if groups is None:
            groups = range(len(self._groups))
        elif isinstance(groups, int):
            groups = [groups]
        groups = list(groups)
        for gi in groups:
            if not 0 <= gi < len(self._groups):
                raise IndexError("grads_ready: no param group %d (%d groups)" % (gi, len(self._groups)))
        for gi in groups:
            if gi in self._by_hand:
                raise ValueError("grads_ready: param group %d was already announced in this step" % gi)
        gs = set(groups)
        ks = [k for k in range(len(self._params)) if self._group_of[k] in gs and k not in announced]
        if not ks:
            self._by_hand.update(gs)
            return  # the hooks were first: nothing to do
        per_step = self._check_unchanged()
        options = self._options(loss_scale, max_grad_norm, check_finite)
        for k in ks:
            if not self._has_grad(k):
                raise RuntimeError("grads_ready: %s has no grad (none produced since zero_grad())" % self._where[k])
        if not announced:
            self._wait_params()
            self._sync_changed_params()
        self._announce(ks, per_step, options)
        self._by_hand.update(gs)

    @contextlib.contextmanager
    def accumulate(self):
        """`with opt.accumulate():` around the forward and backward of each micro-batch that is not the
        last of a step (like DDP's no_sync): their grads accumulate, and nothing is announced. The last
        micro-batch's backward, outside, announces each group once its grads are final."""
        self._tracker.hook_missing()
        self._tracker.accumulating += 1
        try:
            yield self
        finally:
            self._tracker.accumulating -= 1
