"""Which params received a grad, and when a bucket's grads are final: the hooks behind
ferry.torch.Optimizer (its skip rule, `overlap=` and `accumulate()`).

One hook per param runs right after autograd accumulated the param's grad into p.grad: torch >= 2.1's
Tensor.register_post_accumulate_grad_hook, or on older torch (1.13) a hook on the param's
AccumulateGrad node (the node DDP hooks; kept alive here so the param keeps using it). Autograd sums
every contribution to a leaf (a Parameter shared by two modules, a module run twice in one forward)
before that node runs, so the hook runs once per backward per param, with the grad final for that
backward. The hook only does bookkeeping on Python lists: no device memory, no host synchronization.

The unit of announcement is a bucket of params (ferry.torch.Optimizer's `_units`: a few MiB to tens
of MiB of grads, in the order the backward finishes them, whatever the param groups; learned from
the first backward). The rule for announcing a bucket (Engine.grads_ready_params) during a backward:
every param of the bucket has received its grad in this backward (hooks counted per backward; the end
of a backward is seen through autograd's queue_callback). So a bucket with a frozen param
(requires_grad=False: no hook runs), or a param that gets no grad in this backward, is never
announced early: it steps in step(). Nothing is announced inside `accumulate()` (micro-batches that
are not the last of a step). A grad that changes after it was announced (a second backward outside
accumulate(), an in-place change such as clip_grad_norm_ or GradScaler.unscale_, seen by the tensor's
version counter) makes the step discard that early work and recompute it (exact;
StepOptions::discard_early). A second backward after the announcement is refused at once (its
forward and backward read params the early update replaces).

Under DDP with attach_ddp (ferry/_ddp.py) the tracker still counts grads and backwards, but the
params are announced by DDP's comm hook, a DDP bucket at a time, once its all-reduce has landed
(`external`), and a backward
whose forward ran under DDP's no_sync() counts as accumulating (`skip_backward`).
"""
import threading
import weakref

import torch

POST_ACCUMULATE = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def _queue_callback(fn):
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class GradTracker:
    """Per-param grad hooks of one optimizer.

    params: the optimizer's params in order (k), wheres[k] its name in messages; unit_of[k]: its
    bucket's index (see set_units); announce(u): called (from the backward, outside the lock) when
    bucket u is complete and may be announced; it returns True when it announced. `node_hooks=True`
    forces the AccumulateGrad-node hooks (tests run both mechanisms on torch 2.x)."""

    def __init__(self, params, wheres, unit_of, num_units, announce, node_hooks=None):
        n = len(params)
        self._params = params
        self._wheres = wheres
        self._announce = announce
        self._lock = threading.Lock()
        self.set_units(unit_of, num_units)
        self._node_hooks = (not POST_ACCUMULATE) if node_hooks is None else bool(node_hooks)
        self._handles = [None] * n
        self._nodes = [None] * n  # AccumulateGrad nodes kept alive (node hooks)
        self._unhooked = n
        self.got = [False] * n  # a grad was produced by a backward since the last clear_grads()
        self._epoch = 0  # the backward being counted (0: none yet)
        self._open = False  # a backward outside accumulate() is running (its end callback is queued)
        self._fired = [0] * n  # the backward in which the param last received its grad
        self._version = [None] * n  # p.grad and its version after its last grad outside accumulate()
        self.accumulating = 0  # depth of accumulate() contexts
        self.announcing = False  # announce complete buckets (the optimizer's overlap, when active)
        self.announced = set()  # params (k) announced in this step
        self.backwards = 0  # backward passes outside accumulate() since the last step
        self.order = []  # params in the order their grads became final in the last backward counted
        self.late = None  # (what, k): an announced param's grad changed before step() (None: none did)
        self.trace = None  # a list: tests record ("grad", k, epoch) and ("announce", u, epoch, its params) in it
        self.external = False  # another announces params (ferry._ddp: from DDP's reduced buckets)
        self.skip_backward = None  # a callable: True when the running backward accumulates (DDP's no_sync())
        self.hook_missing()

    def set_units(self, unit_of, num_units):
        """The buckets: param k is in bucket unit_of[k] (None: in none; it is never announced by the
        hooks). Between steps."""
        with self._lock:
            self._unit_of = list(unit_of)
            self._size = [0] * num_units
            for u in self._unit_of:
                if u is not None:
                    self._size[u] += 1
            self._count = [0] * num_units  # params of the bucket that received their grad in _count_epoch
            self._count_epoch = [0] * num_units

    # ---- hooks ---------------------------------------------------------------------------------------

    def hook_missing(self):
        """Hooks every param that requires grad and has none yet (at construction; params unfrozen
        later get theirs at the next step, zero_grad or accumulate)."""
        if self._unhooked == 0:
            return
        me = weakref.ref(self)
        for k, p in enumerate(self._params):
            if self._handles[k] is not None or not p.requires_grad:
                continue
            if self._node_hooks:
                with torch.enable_grad():
                    node = p.expand_as(p).grad_fn.next_functions[0][0]
                self._nodes[k] = node
                self._handles[k] = node.register_hook(_node_hook(me, k))
            else:
                self._handles[k] = p.register_post_accumulate_grad_hook(_tensor_hook(me, k))
            self._unhooked -= 1

    def __del__(self):
        try:
            self.remove()  # the optimizer is gone: its hooks leave the params
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def hooked(self, k):
        return self._handles[k] is not None

    def remove(self):
        for h in self._handles:
            if h is not None:
                h.remove()
        self._handles = [None] * len(self._handles)
        self._nodes = [None] * len(self._nodes)
        self._unhooked = len(self._handles)

    def fired(self, k):
        """Param k's grad was just accumulated (on the autograd thread)."""
        u = self._unit_of[k]
        complete = False
        with self._lock:
            self.got[k] = True
            if k in self.announced:
                # Announced already: by hand from another hook of this same accumulation (the grad is
                # as announced), or the grad changed since: a second backward, whose forward and
                # backward read params that the param's early update is replacing. Refused at once.
                if self.changed_since_backward((k,)) is None:
                    return
                if self.late is None:
                    self.late = ("another grad", k)
                raise RuntimeError(
                    "ferry.torch.Optimizer: %s received another grad after it was announced "
                    "(a second backward outside accumulate() in one step?): this backward and its forward read "
                    "params that the early update is replacing, so the step would not be exact. Wrap "
                    "every forward and backward but the last of a step in %s, or construct the optimizer with "
                    "overlap=False (see engine/TROUBLESHOOTING.md#a-second-backward-with-overlap-on)" % (self._wheres[k], "`with ddp_model.no_sync():` (DDP; or opt.accumulate())"
                                       if self.external else "`with opt.accumulate():`"))
            if self.accumulating or (self.skip_backward is not None and self.skip_backward()):
                return
            if not self._open:
                self._open = True
                self._epoch += 1
                self.backwards += 1
                _queue_callback(_end_callback(weakref.ref(self), self._epoch))
            epoch = self._epoch
            self._version[k] = _version_of(self._params[k].grad)
            if self.trace is not None:
                self.trace.append(("grad", k, epoch))
            if self._fired[k] != epoch:
                if self.backwards == 1:
                    self.order.append(k)
            if not self.announcing or self.external or self._fired[k] == epoch or u is None:
                self._fired[k] = epoch
                return
            self._fired[k] = epoch
            if self._count_epoch[u] != epoch:
                self._count_epoch[u] = epoch
                self._count[u] = 0
            self._count[u] += 1
            complete = self._count[u] == self._size[u]
        if complete and self._announce(u) and self.trace is not None:
            self.trace.append(("announce", u, epoch, tuple(j for j, v in enumerate(self._unit_of) if v == u)))

    def end_backward(self, epoch):
        with self._lock:
            if self._epoch == epoch:
                self._open = False

    # ---- between steps ---------------------------------------------------------------------------------

    def changed_since_backward(self, ks):
        """The first param of `ks` whose grad changed since its last backward outside accumulate()
        (an in-place change, or p.grad replaced), or None."""
        for k in ks:
            seen = self._version[k]
            if seen is None:
                continue
            grad = self._params[k].grad
            if grad is None or grad is not seen[0]() or grad._version != seen[1]:
                return k
        return None

    def record_versions(self, ks):
        """The grads of `ks` as they are now are the announced ones (after grads_ready copied them)."""
        for k in ks:
            self._version[k] = _version_of(self._params[k].grad)

    def end_step(self):
        """After step(): the next step's announcements and backward count start."""
        with self._lock:
            self.announced = set()
            self.backwards = 0
            self.order = []
            self.late = None
            self._version = [None] * len(self._version)

    def clear_grads(self):
        """zero_grad(): no param has a grad of this step any more."""
        with self._lock:
            self.got = [False] * len(self.got)
            self._version = [None] * len(self._version)


def _version_of(grad):
    # The grad (held weakly: no memory kept alive) and its version counter, which every in-place
    # change bumps. No device access.
    return None if grad is None else (weakref.ref(grad), grad._version)


# The hooks hold the tracker weakly: params outlive an optimizer that was dropped.
def _tensor_hook(me, k):
    def hook(_param):
        t = me()
        if t is not None:
            t.fired(k)
    return hook


def _node_hook(me, k):
    def hook(_grad_inputs, _grad_outputs):
        t = me()
        if t is not None:
            t.fired(k)
    return hook


def _end_callback(me, epoch):
    def callback():
        t = me()
        if t is not None:
            t.end_backward(epoch)
    return callback
