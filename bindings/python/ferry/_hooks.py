"""Which params received a grad, and when a param group's grads are final: the hooks behind
ferry.torch.Optimizer (its skip rule, `overlap=` and `accumulate()`).

One hook per param runs right after autograd accumulated the param's grad into p.grad: torch >= 2.1's
Tensor.register_post_accumulate_grad_hook, or on older torch (1.13) a hook on the param's
AccumulateGrad node (the node DDP hooks; kept alive here so the param keeps using it). Autograd sums
every contribution to a leaf (a Parameter shared by two modules, a module run twice in one forward)
before that node runs, so the hook runs once per backward per param, with the grad final for that
backward. The hook only does bookkeeping on Python lists: no device memory, no host synchronization.

The rule for announcing a group (Engine.grads_ready) during a backward: every param of the group has
received its grad in this backward (hooks counted per backward; the end of a backward is seen through
autograd's queue_callback). So a group with a frozen param (requires_grad=False: no hook runs), or a
param that gets no grad in this backward, is never announced early: it steps in step(). Nothing is
announced inside `accumulate()` (micro-batches that are not the last of a step). A grad that changes
after its group was announced (a second backward outside accumulate(), an in-place change such as
clip_grad_norm_ or GradScaler.unscale_, seen by the tensor's version counter) makes the step discard
that early work and recompute it (exact; StepOptions::discard_early). A second backward after the
announcement is refused at once (its forward and backward read params the early update replaces).

Under DDP with attach_ddp (ferry/_ddp.py) the tracker still counts grads and backwards, but the
groups are announced by DDP's comm hook once their all-reduce has landed (`external`), and a backward
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

    params: the optimizer's params in order (k), wheres[k] its name in messages; group_of[k]: its
    param group's index; announce(gi):
    called (from the backward, outside the lock) when group gi is complete and may be announced; it
    returns True when it announced. `node_hooks=True` forces the AccumulateGrad-node hooks (tests run
    both mechanisms on torch 2.x)."""

    def __init__(self, params, wheres, group_of, num_groups, announce, node_hooks=None):
        n = len(params)
        self._params = params
        self._wheres = wheres
        self._group_of = group_of
        self._size = [0] * num_groups
        for gi in group_of:
            self._size[gi] += 1
        self._announce = announce
        self._node_hooks = (not POST_ACCUMULATE) if node_hooks is None else bool(node_hooks)
        self._lock = threading.Lock()
        self._handles = [None] * n
        self._nodes = [None] * n  # AccumulateGrad nodes kept alive (node hooks)
        self._unhooked = n
        self.got = [False] * n  # a grad was produced by a backward since the last clear_grads()
        self._epoch = 0  # the backward being counted (0: none yet)
        self._open = False  # a backward outside accumulate() is running (its end callback is queued)
        self._fired = [0] * n  # the backward in which the param last received its grad
        self._count = [0] * num_groups  # params of the group that received their grad in _count_epoch
        self._count_epoch = [0] * num_groups
        self._version = [None] * n  # p.grad and its version after its last grad outside accumulate()
        self.accumulating = 0  # depth of accumulate() contexts
        self.announcing = False  # announce complete groups (the optimizer's overlap, when active)
        self.announced = set()  # groups announced in this step
        self.backwards = 0  # backward passes outside accumulate() since the last step
        self.late = None  # (what, k): an announced group's grad changed before step() (None: none did)
        self.trace = None  # a list: tests record ("grad", k, epoch) and ("announce", gi, epoch) in it
        self.external = False  # another announces complete groups (ferry._ddp: from DDP's reduced buckets)
        self.skip_backward = None  # a callable: True when the running backward accumulates (DDP's no_sync())
        self.hook_missing()

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
        gi = self._group_of[k]
        complete = False
        with self._lock:
            self.got[k] = True
            if gi in self.announced:
                # Announced already: by hand from another hook of this same accumulation (the grad is
                # as announced), or the grad changed since: a second backward, whose forward and
                # backward read params that the group's early update is replacing. Refused at once.
                if self.changed_since_backward((k,)) is None:
                    return
                if self.late is None:
                    self.late = ("another grad", k)
                raise RuntimeError(
                    "ferry.torch.Optimizer: %s received another grad after its param group was announced "
                    "(a second backward outside accumulate() in one step?): this backward and its forward read "
                    "params that the group's early update is replacing, so the step would not be exact. Wrap "
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
            if not self.announcing or self.external or self._fired[k] == epoch:
                self._fired[k] = epoch
                return
            self._fired[k] = epoch
            if self._count_epoch[gi] != epoch:
                self._count_epoch[gi] = epoch
                self._count[gi] = 0
            self._count[gi] += 1
            complete = self._count[gi] == self._size[gi]
        if complete and self._announce(gi) and self.trace is not None:
            self.trace.append(("announce", gi, epoch))

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
