"""The bounds bench_train.py sets beside its rows, timed on the loop's own passes without an optimizer:
forward + backward alone, and FirstGradsWait: the head's forward to its grads (the least wait of CPU
Adam in a CPU-bound overlapped iteration) and on to the backward's end (the bound of a loop whose clip
is reached at every step)."""
import statistics
import time

import torch


def compute_alone(model, data, loop, args):
    """Forward + backward alone (no optimizer, no clip, no loss scaling), host running ahead: (mean
    iteration in s, FirstGradsWait's mean in s or None, its tail in s or None)."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for p in model.parameters():
        p.grad = None
    wait = FirstGradsWait(model, cuda=args.device == "cuda")
    for it in range(args.warmup):
        loop.forward_backward(model, data[it % len(data)], None)
    sync()
    wait.arm()
    t = time.perf_counter()
    for it in range(args.steps):
        loop.forward_backward(model, data[it % len(data)], None)
        wait.pass_done()
    sync()
    elapsed = (time.perf_counter() - t) / args.steps
    for p in model.parameters():
        p.grad = None
    return elapsed, wait.finish(), wait.tail


class FirstGradsWait:
    """The least time of each iteration in which an overlapped, CPU-bound loop leaves CPU Adam nothing
    to do: from the start of the forward of the module that owns the param whose grad a backward makes
    final first (the head) to that grad. A forward uses that module last, so every update of a step is
    done (its params new) before that forward starts, and the next step's updates wait for that first
    grad: a CPU-bound overlapped iteration takes at least CPU Adam's time plus this. Timed on the passes
    after arm() (the host running ahead: CUDA events on `cuda`, else the host's clock, the passes then
    being synchronous); the warm-up's first backward names the param. With torch < 2.1 the grad hook
    stands in for the post-accumulate-grad hook (called as the grad is made, before it is
    accumulated).

    Its tail, from the same forward to the backward's end (pass_done() after each timed pass; `tail`
    after finish()), bounds a loop whose clip is reached at every step: the clipped update needs the
    global norm, so it starts when the backward ends, and the next backward starts once that forward
    has its params: such an iteration takes at least the step alone plus the tail."""

    def __init__(self, model, cuda):
        self.model, self.cuda, self.first, self.owner = model, cuda, None, None
        self.starts, self.ends, self.pass_ends, self.tail = [], [], [], None
        self.handles = [self._grad_hook(p, self._seen) for p in model.parameters() if p.requires_grad]

    @staticmethod
    def _grad_hook(param, fn):
        """fn(param) once param's grad is made (post-accumulate-grad hook, else the grad hook)."""
        if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return param.register_post_accumulate_grad_hook(fn)
        def hook(grad):
            fn(param)  # returns None: the grad is left as it is
        return param.register_hook(hook)

    def _seen(self, param):
        if self.first is None:
            self.first = param

    def _grad_done(self, param):
        if len(self.ends) < len(self.starts):
            self.ends.append(self._now())

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def pass_done(self):
        """Called after each timed pass's backward: the end of the tail."""
        if len(self.pass_ends) < len(self.starts):
            self.pass_ends.append(self._now())

    def _forward(self, module, inputs):
        if len(self.starts) == len(self.ends):  # the first call of this pass (a tied module runs twice)
            self.starts.append(self._now())

    def arm(self):
        """Time the passes from here on (the warm-up has named the first param): hooks on that param
        and its module alone."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.first is None:
            return
        self.owner = next(m for m in self.model.modules()
                          if any(q is self.first for q in m.parameters(recurse=False)))
        self.handles = [self._grad_hook(self.first, self._grad_done), self.owner.register_forward_pre_hook(self._forward)]

    def finish(self):
        """The mean over the timed passes in s (after a synchronize on `cuda`), None where none was
        timed; sets `tail` likewise; removes the hooks."""
        for handle in self.handles:
            handle.remove()
        self.tail = self._mean(zip(self.starts, self.pass_ends))
        return self._mean(zip(self.starts, self.ends))

    def _mean(self, pairs):
        pairs = list(pairs)
        if not pairs:
            return None
        return statistics.mean(s.elapsed_time(e) / 1e3 if self.cuda else e - s for s, e in pairs)
