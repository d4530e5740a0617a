"""ferry.torch.Optimizer.attach_ddp(ddp_model): overlap under DistributedDataParallel.

Without it, DDP and overlap do not mix: DDP all-reduces a bucket of grads after autograd accumulated
them, and writes the averaged values into p.grad only at the end of the backward (Reducer::
finalize_backward), so Ferry's post-accumulate-grad hooks see grads that are not final yet (the
optimizer then needs overlap=False, or the step recomputes every announced param).

attach_ddp registers a DDP communication hook (DistributedDataParallel.register_comm_hook) that does
DDP's own all-reduce of each bucket: the bucket is multiplied by 1 / world size (what DDP's reducer
does without a hook when it copies a grad into its bucket: the same bits) and all-reduced in place
on DDP's process group; the future returned to DDP yields that bucket. Once the all-reduce has
completed (the future's `then` callback), the callback copies this rank's range of each of the
bucket's params (ZeRO-1 with shard=True: the rank's range; unsharded: the whole param) from the
reduced bucket into the optimizer's grad buffer, which the engine reads, and announces those params
(Engine GradsReadyParams): DDP's bucket is the unit of overlap, whatever the param groups. So the announced grads
are the final values whatever DDP later does with p.grad (gradient_as_bucket_view=True: p.grad is a
view of the bucket; False: DDP copies the bucket into p.grad, the optimizer's buffer, the same bits
again).

Streams: on CUDA the callback runs with the current stream set to a stream that waits for the
all-reduce (torch's Future.then: a pool stream made to wait on the future's events). The copies and
the GradsReady's event go on a high-priority stream of the bridge's own, made to wait for that one
(and it for them before the callback returns: DDP's end of backward waits for the future that the
callback completes, so the trainer's stream sees the copies too). On the callback's pool stream the
announcements of a 735M model's backward became final out of order and late (traced on an H100:
nine in a row of the middle blocks only after the backward's last ones), and CPU Adam, having
nothing final to take, idled 13-33 ms a step more than in the same loop without DDP; on the
high-priority stream they become final in order, as the backward makes the grads (FSDP2's reduce-scatter stream, where its announcements
come from, is a high-priority stream too). With gloo the callback may run on gloo's thread: the
engine is driven one thread at a time through the optimizer's _engine_lock.

What stays exact: the copies are of the reduced values, the announcement comes only after them, and
step() keeps early work only where it was exact (the grads read are checked against their version
counters once DDP is done with them: a second callback queued at the end of the backward runs after
DDP's own end-of-backward callback and records each grad as DDP left it; a later in-place change,
clip_grad_norm_ for one, makes the step recompute). DDP's no_sync(): the forward under no_sync()
makes the next backward an accumulating one for the optimizer (nothing announced, nothing counted
as a backward of the step); DDP runs no all-reduce there, so only the last backward announces.

Not supported: find_unused_parameters=True (a param unused on this rank gets DDP's averaged grad
only at the end of the backward: refused), a second comm hook on the same DDP model (DDP allows one),
sparse grads. Optimizer params outside the DDP model are never reduced by it: they step in step() as
without overlap.
"""
import threading
import weakref

import torch
import torch.distributed as dist

from . import _buckets
from . import distributed as fdist


def _queue_callback(fn):
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class _HookState:
    """What DDP passes to the comm hook: the reduction's group and size, and the bridge (weakly: a
    dropped optimizer leaves a hook that only all-reduces)."""

    def __init__(self, bridge, group, world):
        self.bridge = weakref.ref(bridge)
        self.group = group
        self.world = world


def _comm_hook(state, bucket):
    tensor = bucket.buffer()
    tensor.mul_(1.0 / state.world)  # DDP's division (reducer.cpp: grad times 1 / div_factor)
    fut = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()
    bridge = state.bridge()
    if bridge is None:
        return fut.then(lambda f: f.value()[0])
    return bridge.launched(bucket, fut)


class DDPBridge:
    """The comm hook's side of one attach_ddp(): which params a backward reduced, and the
    announcements. The optimizer holds it; the hook holds it weakly."""

    def __init__(self, optimizer, ddp):
        self._opt = weakref.ref(optimizer)
        self.ddp = weakref.ref(ddp)
        group = ddp.process_group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.index = {id(p): k for k, p in enumerate(optimizer._params)}
        self.reduced = set()  # params whose bucket this backward reduced
        self.queued = False  # the end-of-backward callbacks are queued for this backward
        self.syncing = True  # the last forward of the DDP model prepared an all-reduce (not no_sync())
        self.handles = [ddp.register_forward_pre_hook(_forward_pre_hook(weakref.ref(self)))]
        self.state = _HookState(self, group, self.world)
        self._lock = threading.Lock()  # count, reduced, queued: the autograd thread and DDP's comm threads
        self._side = None

    # ---- from the comm hook (the autograd thread) -----------------------------------------------

    def launched(self, bucket, fut):
        """The bucket's all-reduce is under way: the future DDP waits for, which first hands the
        reduced bucket to the optimizer."""
        params = bucket.parameters()
        ks, offsets, at = [], [], 0
        for p in params:
            ks.append(self.index.get(id(p)))
            offsets.append(at)
            at += p.numel()
        if at != bucket.buffer().numel():
            raise RuntimeError("ferry attach_ddp: DDP bucket %d holds %d elements, its params %d (sparse or "
                               "non-contiguous grads are not supported)"
                               % (bucket.index(), bucket.buffer().numel(), at))
        with self._lock:
            if bucket.index() == 0:  # DDP launches its buckets in order: a new backward (even after one that raised)
                self.reduced = set()
                self.queued = False
            if not self.queued:
                self.queued = True
                _queue_callback(self._backward_ending)

        def done(f):
            flat = f.value()[0]
            self._reduced(flat, ks, offsets)
            return flat
        return fut.then(done)

    def _reduced(self, flat, ks, offsets):
        """The bucket `flat` is reduced (on CUDA: on the current stream; the copies and the
        announcement go on the side stream, see the module's documentation). Runs on DDP's comm
        thread or the autograd thread."""
        opt = self._opt()
        if opt is None:
            return
        tracker = opt._tracker
        with opt._engine_lock:
            mine = [(k, off) for k, off in zip(ks, offsets) if k is not None]
            with self._lock:
                self.reduced.update(k for k, _ in mine)
            if not tracker.announcing or tracker.accumulating:
                return  # overlap off: step() takes p.grad as DDP leaves it
            again = [k for k, _ in mine if k in tracker.announced]
            if again:
                raise RuntimeError(
                    "ferry.torch.Optimizer (rank %d): DDP all-reduced the grad of %s again after it was announced "
                    "in this step: a second backward outside no_sync() before step()? Run every backward but the "
                    "last of a step under ddp_model.no_sync()" % (self.rank, opt._where[again[0]]))
            side = self._side_stream(flat)
            if side is None:
                self._take(opt, flat, mine)
                return
            current = torch.cuda.current_stream(flat.device)
            side.wait_stream(current)  # after the all-reduce
            with torch.cuda.stream(side):
                self._take(opt, flat, mine)
            current.wait_stream(side)  # DDP's end of backward waits for the copies

    def _take(self, opt, flat, mine):
        """Copies this rank's range of the reduced bucket's params into the optimizer's buffers and
        announces them, on the current stream."""
        dsts, srcs = [], []
        for k, off in mine:
            b, e = opt._grad_range(k)
            if e > b:
                dsts.append(opt._grads[k].view(-1)[b:e])
                srcs.append(flat[off + b:off + e])
            opt._tracker.got[k] = True
        with torch.no_grad():
            _buckets.copy_all(dsts, srcs)
        # DDP's bucket is the unit of overlap here: its params are announced together.
        opt._announce_params_from_hook([k for k, _ in mine], take=False)

    def _side_stream(self, flat):
        """The high-priority stream of the copies and announcements on CUDA (made once); None on the host."""
        if not flat.is_cuda:
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(device=flat.device, priority=-1)
        return self._side

    def _backward_ending(self):
        # Runs among autograd's final callbacks, before DDP's finalize_backward (queued later, by the
        # last bucket): a callback queued from here runs after it.
        _queue_callback(self._backward_ended)

    def _backward_ended(self):
        """DDP has written the reduced grads (and waited for every bucket's future)."""
        opt = self._opt()
        self.queued = False
        if opt is None:
            return
        with opt._engine_lock, self._lock:
            opt._tracker.record_versions(sorted(self.reduced))  # the grads as DDP left them
            self.reduced = set()

    def forward(self, ddp):
        if torch.is_grad_enabled():  # a no_grad forward (evaluation) has no backward
            self.syncing = bool(ddp.require_backward_grad_sync)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _forward_pre_hook(me):
    def hook(module, _inputs):
        bridge = me()
        if bridge is not None:
            bridge.forward(module)
    return hook


def _check(optimizer, ddp):
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("attach_ddp: expected a torch.nn.parallel.DistributedDataParallel model, got %s"
                        % type(ddp).__name__)
    if optimizer._ddp is not None:
        raise RuntimeError("attach_ddp: the optimizer is attached to a DDP model already")
    if getattr(ddp, "find_unused_parameters", False):
        raise ValueError("attach_ddp: the DDP model has find_unused_parameters=True: a param this rank did not use "
                         "gets DDP's averaged grad only at the end of the backward, after its group could be "
                         "announced. Build DDP without it, or leave the optimizer unattached with overlap=False")
    if any(getattr(p, "is_sparse", False) for p in ddp.parameters()) or getattr(ddp, "sparse_gradient", False):
        raise ValueError("attach_ddp: sparse grads are not supported")
    zero = optimizer._zero
    if zero is not None:
        mine, theirs = fdist.group_ranks(zero.comm.group), fdist.group_ranks(ddp.process_group)
        if list(mine) != list(theirs):
            raise ValueError("attach_ddp: the optimizer's ranks %s differ from the DDP model's process group %s"
                             % (mine, theirs))
    index = {id(p) for p in optimizer._params}
    if not any(id(p) in index for p in ddp.module.parameters() if p.requires_grad):
        raise ValueError("attach_ddp: no param of the DDP model that requires grad is a param of this optimizer")


class DDPMixin:
    """ferry.torch.Optimizer's attach_ddp(). Uses the optimizer's _ddp (the bridge, or None),
    _engine_lock, _tracker, _grads, _grad_range(k), _announce_params_from_hook."""

    def attach_ddp(self, ddp_model):
        """Overlap under DDP: registers a comm hook on `ddp_model` (a DistributedDataParallel over
        the module whose params this optimizer steps) that all-reduces each bucket as DDP does and,
        once a bucket is reduced, gives this rank's part of its grads to the optimizer and announces
        them (DDP's bucket is the unit of overlap). Bit-identical to
        DDP without the hook and overlap=False. Works with shard=True (ZeRO-1) and unsharded, with
        gradient_as_bucket_view either way, and with no_sync() for grad accumulation (only the
        synchronized backward announces). Call it before the first backward; DDP takes one comm
        hook per model, so the model keeps it (once this optimizer is gone it only all-reduces).
        Overlap itself follows `overlap=` (None: on after a safe step). Returns self."""
        _check(self, ddp_model)
        bridge = DDPBridge(self, ddp_model)
        try:
            ddp_model.register_comm_hook(bridge.state, _comm_hook)
        except (RuntimeError, ValueError) as e:
            bridge.remove()
            raise RuntimeError("attach_ddp: DDP refused Ferry's comm hook (%s): a DDP model takes one comm hook; "
                               "build the DDP model without one" % e) from e
        self._ddp = bridge
        tracker = self._tracker
        tracker.external = True  # the bridge announces, from reduced buckets
        tracker.skip_backward = lambda: not bridge.syncing
        return self
