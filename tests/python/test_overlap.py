"""ferry.torch announces buckets of params from grad hooks (overlap=) and accumulates micro-batches
(accumulate()): the same bits as without announcing, close to torch.optim.AdamW, and a bucket is never
announced before every one of its grads is final (checked on the optimizer's trace of hook events).
Here every param is a bucket of its own (bucket_mb tiny), so the rule is checked param by param;
tests/python/test_buckets.py groups them.
The model (nets.Net) holds every case of the rule: a shared Parameter, a module run twice, frozen
params, a layer without grad on some steps, a group mixing frozen and trainable params."""
import contextlib
import importlib
import warnings

import pytest
import torch

import ferry.torch
from ferry import _hooks
from nets import Net, assert_close_to, assert_same_bits, batches, loss_of, net_groups

STEPS = 6
ALWAYS = {0, 1, 2, 3}  # groups all of whose params are announced every step (see nets.net_groups)
NEVER = {4, 6}  # a frozen param in them
SPARE = 5  # announced on odd steps only
KEPT_PER_STEP = 5  # groups whose early work a step keeps: ALWAYS and 6 (its frozen bias starts at step())
TINY = 1e-7  # bucket_mb: every param a bucket of its own

HOOKS = [False, True] if _hooks.POST_ACCUMULATE else [True]


class NodeHookOptimizer(ferry.torch.Optimizer):
    _node_hooks = True  # the AccumulateGrad-node hooks of torch < 2.1, on any torch


def make(device, node_hooks, overlap, policy="offload_all", seed=0, **kw):
    net = Net(seed=seed).to(device)
    cls = NodeHookOptimizer if node_hooks else ferry.torch.Optimizer
    kw.setdefault("bucket_mb", TINY)
    opt = cls(net_groups(net), lr=1e-2, weight_decay=0.1, policy=policy, overlap=overlap,
              transfer_chunk_bytes=1024, **kw)
    opt._tracker.trace = []
    return net, opt


def reference(device, seed=0):
    net = Net(seed=seed).to(device)
    return net, torch.optim.AdamW(net_groups(net), lr=1e-2, weight_decay=0.1, foreach=False)


def train_step(net, opt, step, micro=1, accumulate=True, after_backward=None):
    for i, (x, y) in enumerate(batches(net.head.weight.device, step, micro)):
        last = i == micro - 1
        ctx = opt.accumulate() if accumulate and not last and hasattr(opt, "accumulate") else contextlib.nullcontext()
        with ctx:
            loss_of(net, x, y, step).backward()
    if after_backward is not None:
        after_backward(net)
    opt.step()
    opt.zero_grad(set_to_none=isinstance(opt, torch.optim.AdamW))


def check_trace(opt, step):
    """Each announcement of this step came after the grads of every param of its bucket in the same
    backward, and no grad of an announced param came after it. Returns the groups all of whose params
    were announced, each with the position of its last param's announcement."""
    trace = opt._tracker.trace
    announced = {}  # k -> position
    seen = {}  # k -> the position of its last grad event
    for pos, event in enumerate(trace):
        if event[0] == "grad":
            k = event[1]
            assert k not in announced, "step %d: a grad of param %d after it was announced" % (step, k)
            seen[k] = (pos, event[2])
        elif event[0] == "announce":
            u, epoch = event[1], event[2]
            for k in event[3]:  # the bucket's params then (the buckets follow the first backward's order after it)
                assert k in seen and seen[k][1] == epoch, \
                    "step %d: bucket %d announced before param %d's grad of that backward" % (step, u, k)
                announced[k] = pos
    trace.clear()
    groups = {}
    for gi in range(len(opt.param_groups)):
        ks = [k for k in range(len(opt._params)) if opt._group_of[k] == gi]
        if all(k in announced for k in ks):
            groups[gi] = max(announced[k] for k in ks)
    return groups


def test_hooks_fire_once_per_backward_for_shared_and_reused_params(device):
    for node_hooks in HOOKS:
        net, opt = make(device, node_hooks, overlap=False)
        x, y = batches(device, 1)[0]
        loss_of(net, x, y, 1).backward()
        grads = [e[1] for e in opt._tracker.trace if e[0] == "grad"]
        trainable = [k for k, p in enumerate(opt._params) if p.requires_grad]
        # shared (used by two blocks) and blocks[3] (run twice) appear once, like every other param;
        # frozen params never (no hook), spare not on an odd... here step 1 is odd: spare has grads.
        assert sorted(grads) == trainable, (node_hooks, grads)
        assert opt._tracker.backwards == 1


@pytest.mark.parametrize("policy", ["offload_all", None])
def test_overlap_is_bit_identical_and_never_early(device, policy):
    for node_hooks in HOOKS:
        net, opt = make(device, node_hooks, overlap=True, policy=policy)
        plain_net, plain = make(device, False, overlap=False, policy=policy)
        ref_net, ref = reference(device)
        before_frozen = net.frozen.weight.detach().clone()
        for step in range(1, STEPS + 1):
            train_step(net, opt, step)
            announced = check_trace(opt, step)
            assert set(announced) == ALWAYS | ({SPARE} if step % 2 == 1 else set()), (step, announced)
            # Announced during the backward, not at its end: the last block's group went first, before
            # the first block's grads arrived.
            assert announced[3] < announced[0]
            train_step(plain_net, plain, step)
            train_step(ref_net, ref, step)
            assert_same_bits(net, plain_net, "step %d" % step)
        assert_close_to(net, ref_net)
        assert torch.equal(net.frozen.weight.detach(), before_frozen)
        stats = opt.stats()
        if policy == "offload_all":
            assert stats["early_groups_kept"] == KEPT_PER_STEP * STEPS + STEPS // 2, stats
            assert stats["early_groups_recomputed"] == 0
            # The speculations' bytes went out of place (every param has spare state here: all of them).
            assert 0 < stats["cpu_adam_spare_bytes"] <= stats["cpu_adam_bytes"], stats
        assert plain.stats()["early_groups_kept"] == 0 and plain.stats()["cpu_adam_spare_bytes"] == 0


def test_accumulate_four_micro_batches_against_adamw(device):
    for node_hooks in HOOKS:
        net, opt = make(device, node_hooks, overlap=True)
        plain_net, plain = make(device, False, overlap=False)
        ref_net, ref = reference(device)
        for step in range(1, STEPS + 1):
            train_step(net, opt, step, micro=4)
            # Only the last micro-batch's backward was counted, and it announced.
            epochs = {e[2] for e in opt._tracker.trace if e[0] != "wait"}
            assert len(epochs) == 1, epochs
            assert set(check_trace(opt, step)) >= ALWAYS
            train_step(plain_net, plain, step, micro=4)
            train_step(ref_net, ref, step, micro=4)  # torch accumulates the four backward passes
            assert_same_bits(net, plain_net, "step %d" % step)
        assert_close_to(net, ref_net)
        assert opt.stats()["early_groups_kept"] == KEPT_PER_STEP * STEPS + STEPS // 2
        assert opt.stats()["early_groups_recomputed"] == 0


def test_nothing_is_announced_inside_accumulate(device):
    net, opt = make(device, False, overlap=True)
    for x, y in batches(device, 1, micro=3):
        with opt.accumulate():
            loss_of(net, x, y, 1).backward()
    assert not opt._tracker.announced and opt._tracker.backwards == 0
    assert not [e for e in opt._tracker.trace if e[0] == "grad"]
    opt.step()  # every group with grads steps in step()
    assert opt.stats()["step"] == 1 and opt.stats()["early_groups_kept"] == 0


@pytest.mark.parametrize("clip_by", ["clip_grad_norm_", "mul_"])
def test_grads_changed_in_place_after_announcing_are_recomputed(device, clip_by):
    """clip_grad_norm_ (or any in-place change) after the backward that announced: the announced
    groups are recomputed from the final grads, the same bits as without announcing; one warning."""
    net, opt = make(device, False, overlap=True)
    plain_net, plain = make(device, False, overlap=False)

    def clip(n):
        if clip_by == "mul_":
            with torch.no_grad():
                n.blocks[2].fc.weight.grad.mul_(0.5)
        else:
            torch.nn.utils.clip_grad_norm_(n.parameters(), 0.05)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 4):
            train_step(net, opt, step, after_backward=clip)
            train_step(plain_net, plain, step, after_backward=clip)
            assert_same_bits(net, plain_net, "step %d" % step)
    late = [w for w in caught if "changed after it was announced" in str(w.message)]
    assert len(late) == 1, [str(w.message) for w in caught]
    # Every announced group is recomputed, also where only group 2's grad changed (mul_): the engine
    # discards a step's early work as a whole.
    assert opt.stats()["early_groups_recomputed"] > 0 and opt.stats()["early_groups_kept"] == 0


def test_a_second_backward_after_announcing_is_refused_at_once(device):
    """Its forward and backward read params that the early update replaces: not exact, so refused."""
    net, opt = make(device, False, overlap=True)
    (x, y), (x2, y2) = batches(device, 1, micro=2)
    loss_of(net, x, y, 1).backward()
    assert opt._tracker.announced
    with pytest.raises(RuntimeError, match=r"received another grad after it was announced.*"
                                           r"opt.accumulate\(\)"):
        loss_of(net, x2, y2, 1).backward()


def test_overlap_by_default_turns_on_when_safe_and_off_when_not(device):
    net, opt = make(device, False, overlap=None)
    plain_net, plain = make(device, False, overlap=False)
    assert not opt.overlapping
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(net, opt, 1)  # one backward, nothing changed its grads: on from the next step
        assert opt.overlapping and not caught
        train_step(net, opt, 2)
        assert set(check_trace(opt, 2)) == ALWAYS and opt.stats()["early_groups_kept"] == KEPT_PER_STEP
        clip = lambda n: torch.nn.utils.clip_grad_norm_(n.parameters(), 0.05)  # noqa: E731
        train_step(net, opt, 3, after_backward=clip)  # recomputed (exact), then off for good
        assert not opt.overlapping
        train_step(net, opt, 4)
        assert not opt.overlapping
    assert len([w for w in caught if "overlap" in str(w.message)]) == 1
    for step in range(1, 5):
        train_step(plain_net, plain, step, after_backward=clip if step == 3 else None)
    assert_same_bits(net, plain_net)
    assert opt.stats()["early_groups_recomputed"] > 0
    # Several backward passes per step without accumulate(): never on.
    net, opt = make(device, False, overlap=None)
    with pytest.warns(UserWarning, match="2 backward passes outside accumulate"):
        train_step(net, opt, 1, micro=2, accumulate=False)
    train_step(net, opt, 2)
    assert not opt.overlapping
    # Nothing offloaded: announcing would not help; stays off, silently.
    net, opt = make(device, False, overlap=None, policy=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(net, opt, 1, micro=2, accumulate=False)
        train_step(net, opt, 2)
    assert not opt.overlapping


@pytest.mark.parametrize("overlap", [True, False])
def test_attach_waits_per_module_and_gives_the_same_bits(device, overlap):
    """attach(): step() does not wait for the uploads; each module's forward waits for its own params'
    buckets, once per step (group 1 spreads over blocks[1].fc and blocks 1 and 2, which both hold `shared`;
    the frozen Linear owns params of groups 4 and 6); the same bits as without it."""
    net, opt = make(device, False, overlap=overlap)
    plain_net, plain = make(device, False, overlap=overlap)
    assert opt.attach(net) is opt
    with pytest.raises(RuntimeError, match="attached already"):
        opt.attach(net)
    for step in range(1, STEPS + 1):
        opt._tracker.trace.clear()
        train_step(net, opt, step)
        waits = [e[1] for e in opt._tracker.trace if e[0] == "wait"]
        if step > 1:
            # Each block waits for its own params' buckets in forward order, each bucket once: group
            # 1's `shared` at blocks[1], not again at blocks[1].fc or blocks[2]. (step() waits itself
            # for the frozen params' buckets, and the spare's on even steps, before restoring them:
            # the last wait.)
            units = [u for w in waits[:-1] for u in w]
            assert len(set(units)) == len(units), waits
            order = []
            for u in units:
                for k in opt._units[u]:
                    if opt._group_of[k] not in order:
                        order.append(opt._group_of[k])
            assert order[:4] == [0, 1, 2, 3], (order, waits)
        train_step(plain_net, plain, step)
        opt.engine.synchronize()  # for reading here (not opt.wait_params(): the next forward waits)
        assert_same_bits(net, plain_net, "step %d" % step)
    opt.detach()
    assert not opt._pending
    train_step(net, opt, STEPS + 1)
    train_step(plain_net, plain, STEPS + 1)
    assert_same_bits(net, plain_net)
    with pytest.raises(ValueError, match="no module of Linear owns a param"):
        opt.attach(torch.nn.Linear(2, 2))


def test_announcing_by_hand_beside_the_hooks(device):
    """A loop that calls grads_ready by hand (as before overlap=) keeps working with the hooks on: the
    groups the hooks announced already are left alone; the others are announced by hand."""
    net, opt = make(device, False, overlap=True)
    plain_net, plain = make(device, False, overlap=False)
    for step in range(1, 4):
        x, y = batches(device, step)[0]
        loss_of(net, x, y, step).backward()
        opt.grads_ready([0, 1, 2, 3])  # all by the hooks already: nothing to do
        with pytest.raises(RuntimeError, match=r"param 9 .* has no grad"):
            opt.grads_ready(4)  # the frozen weight
        opt.step()
        opt.zero_grad()
        train_step(plain_net, plain, step)
        assert_same_bits(net, plain_net, "step %d" % step)
    assert opt.stats()["early_groups_kept"] == KEPT_PER_STEP * 3 + 2


def _allocations(snapshot, device):
    """The device allocations a memory-history snapshot recorded: (bytes, the innermost Python frames
    of Ferry or the tests), for the message of a failed check."""
    out = []
    for event in snapshot.get("device_traces", [[]])[device.index or 0]:
        if event.get("action") != "alloc":
            continue
        frames = [f for f in event.get("frames", []) if "ferry" in f["filename"] or "tests" in f["filename"]]
        out.append((event["size"], ["%s:%d %s" % (f["filename"].rsplit("/", 1)[-1], f["line"], f["name"])
                                    for f in frames[:4]]))
    return out


def test_hooks_take_no_device_memory_and_no_host_sync(device):
    """On CUDA: a backward with the hooks announcing allocates no more device memory than one without
    (the number of allocations and their bytes over the backward, the forward done: the peak depends
    on when autograd frees the saved tensors, which the host's timing moves), and no torch call in the
    hooks or in attach()'s forward pre-hooks synchronizes the host (sync debug mode raises on one). On
    a failure the message lists the backward's allocations where torch records them."""
    if device.type != "cuda":
        pytest.skip("CUDA only: device memory and host synchronization are a GPU's (the CPU runs are above)")
    memory = torch.cuda.memory
    record = hasattr(memory, "_record_memory_history") and hasattr(memory, "_snapshot")
    made, peaks, allocations = [], [], []  # per backward: (allocations, bytes), the peak above the start
    for overlap in (False, True):
        net, opt = make(device, False, overlap=overlap)
        opt.attach(net)
        train_step(net, opt, 1)  # warm: buffers, the engine's spare state
        x, y = batches(device, 2)[0]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = loss_of(net, x, y, 2)  # attach()'s pre-hooks wait for the last step's uploads here
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        if record:
            try:
                memory._record_memory_history(max_entries=10000)
            except TypeError:  # torch before 2.1 takes other arguments
                record = False
        before = torch.cuda.memory_stats(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats(device)
        made.append(tuple(after[key] - before[key]
                          for key in ("allocation.all.allocated", "allocated_bytes.all.allocated")))
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        if record:
            allocations.append(_allocations(memory._snapshot(), device))
            memory._record_memory_history(enabled=None)
        assert bool(opt._tracker.announced) == overlap
        opt.step()
    assert made[0][0] > 0, made  # the backward's own allocations were counted
    assert made[1][0] <= made[0][0] and made[1][1] <= made[0][1], \
        "allocations, bytes: %s; peaks: %s; the allocations: %s" % (made, peaks, allocations)


def test_a_dropped_optimizer_leaves_the_params(device):
    """The hooks hold the optimizer weakly and leave the params when it is collected: the model trains
    on with another optimizer."""
    import gc
    import weakref

    net, opt = make(device, False, overlap=True)
    train_step(net, opt, 1)
    gone = weakref.ref(opt)
    tracker = weakref.ref(opt._tracker)
    del opt
    gc.collect()
    assert gone() is None and tracker() is None
    ref = torch.optim.AdamW(net_groups(net), lr=1e-2)
    train_step(net, ref, 2)  # no hook of the old optimizer runs (it would fail on a dead engine)


class Functional(torch.nn.Module):
    """`b`'s weight is used only functionally: b's own forward (and its pre-hook) never runs.
    bypass=True: a's forward is called without a's __call__ too (as code torch.compile compiled
    before attach() runs: without the hooks added later)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8, bias=False)
        self.bypass = False
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        h = self.a.forward(x) if self.bypass else self.a(x)
        return torch.nn.functional.linear(torch.tanh(h), self.b.weight)


def functional_pair(device):
    """Two Functional nets with an offloading optimizer each, the first attached."""
    nets, opts = [], []
    for attach in (True, False):
        net = Functional().to(device)
        opt = ferry.torch.Optimizer([{"params": [net.a.weight, net.a.bias]}, {"params": [net.b.weight]}], lr=1e-2,
                                    weight_decay=0.1, policy="offload_all", overlap=True, transfer_chunk_bytes=1024)
        if attach:
            opt.attach(net)
        nets.append(net)
        opts.append(opt)
    return nets, opts


def train_pair(nets, opts, steps, seed, wait=False, bypass_from=None):
    """`steps` steps of both nets on the same batches (wait: opt.wait_params() before each forward;
    bypass_from: the step from which the nets' forward skips a's hooks). Yields after each step."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(16, 8, generator=g).to(nets[0].a.weight.device)
        for net, opt in zip(nets, opts):
            net.bypass = bypass_from is not None and step >= bypass_from
            if wait:
                opt.wait_params()
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        yield step


def test_attach_zeroes_grads_of_a_group_its_forward_waited_for_by_hand(device):
    """A param used outside the forward of its module waits by opt.wait_params() (attach()'s contract):
    the steps are deferred, and after one zero_grad() leaves a group's grads until a stream waits for
    the group (the engine may still read them): the same bits as without attach(), every step."""
    nets, opts = functional_pair(device)
    for step in train_pair(nets, opts, 6, seed=5, wait=True):
        assert opts[0].stats()["deferred_steps"] == step + 1
        for opt in opts:
            opt.engine.synchronize()  # for reading here
        assert_same_bits(nets[0], nets[1], "step %d" % step)


def test_attach_does_not_defer_params_a_forward_reads_without_their_hooks(device):
    """b's weight is read outside b's forward and nothing waits for it: step() sees that b's hook did
    not run in the forward that made its grad, so it does not leave b's params (or any) to the next
    forward, and says so once, naming the param; the same bits as without attach(), every step. The
    same where no hook of the forward runs (a's forward bypassed from the start, as a model compiled
    before attach() runs)."""
    for bypass_from in (None, 0):
        nets, opts = functional_pair(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in train_pair(nets, opts, 5, seed=6, bypass_from=bypass_from):
                for opt in opts:
                    opt.engine.synchronize()
                assert_same_bits(nets[0], nets[1], "step %d" % step)
        assert opts[0].stats()["deferred_steps"] == 0
        said = [str(w.message) for w in caught if "pre-hooks" in str(w.message)]
        assert len(said) == 1, said
        assert "param 2 (param_groups[1]['params'][0])" in said[0] and "torch.compile" in said[0]
        assert ("param 0 (param_groups[0]['params'][0])" in said[0]) == (bypass_from == 0)


def test_attach_warns_when_a_forward_read_deferred_params_without_their_hooks(device):
    """Steps deferred while the forward ran the hooks, the bits of a twin without attach(); then the
    forward skips a's hook (as a model whose compiled code ignores them): it may have read a's params
    before the update left to that hook. step() says so at that step, naming them, and from then on
    waits for the params itself: no step after it is deferred."""
    nets, opts = [], []
    for attach in (True, False):
        net = Functional().to(device)
        net.b.weight.requires_grad_(False)
        opt = ferry.torch.Optimizer(list(net.a.parameters()), lr=1e-2, policy="offload_all", overlap=True,
                                    transfer_chunk_bytes=1024)
        nets.append(net)
        opts.append(opt.attach(net) if attach else opt)
    for step in train_pair(nets, opts, 3, seed=7):
        for opt in opts:
            opt.engine.synchronize()
        assert_same_bits(nets[0], nets[1], "step %d" % step)
    assert opts[0].stats()["deferred_steps"] == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in train_pair(nets[:1], opts[:1], 3, seed=8, bypass_from=0):
            said = [w for w in caught if "may have read" in str(w.message)]
            assert len(said) == 1 and said[0].category is RuntimeWarning, [str(w.message) for w in said]
            assert "param 0 (param_groups[0]['params'][0]), param 1" in str(said[0].message)
            assert "torch.compile" in str(said[0].message)
    assert opts[0].stats()["deferred_steps"] == 3


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(8)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch >= 2.0")
def test_attach_and_torch_compile(device):
    """torch.compile (backend "eager": Dynamo's graphs run as they are). A model compiled by its first
    call before attach(): its compiled forward runs none of the hooks added later where torch guards
    on no hooks (its default), so step() does not defer, and says so once; attach() before the first
    call: the hooks run between Dynamo's graphs (torch.compiler.disable), and the steps are deferred.
    The same bits as the compiled model without attach(), every step, either way. Dynamo's cache is
    emptied before each case: its code for Pair, compiled without hooks, would serve the next Pair too
    (torch guards on neither the module nor its hooks)."""
    for attach_first in (False, True):
        importlib.import_module("torch._dynamo").reset()  # loaded on first use, as bench_model.py does
        nets, compiled, opts = [], [], []
        for attach in (True, False):
            net = Pair().to(device)
            opt = ferry.torch.Optimizer(net.parameters(), lr=1e-2, policy="offload_all", overlap=True,
                                        transfer_chunk_bytes=1024)
            if attach and attach_first:
                opt.attach(net)
            nets.append(net)
            compiled.append(torch.compile(net, backend="eager"))
            opts.append(opt)
        g = torch.Generator().manual_seed(9)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(5):
                x = torch.randn(16, 8, generator=g).to(device)
                for i in range(2):
                    compiled[i](x).square().mean().backward()
                    opts[i].step()
                    opts[i].zero_grad()
                    if step == 0 and i == 0 and not attach_first:
                        opts[0].attach(nets[0])  # after the compiled model's first call
                for opt in opts:
                    opt.engine.synchronize()
                assert_same_bits(nets[0], nets[1], "step %d, attach first %s" % (step, attach_first))
        said = [str(w.message) for w in caught if "pre-hooks" in str(w.message)]
        deferred = opts[0].stats()["deferred_steps"]
        if attach_first:
            assert not said and deferred == 5, (said, deferred)
        elif said:  # torch guards on no hooks (its default): the compiled forward ignores them
            assert len(said) == 1 and "torch.compile" in said[0] and deferred == 0, (said, deferred)
        else:  # a torch that recompiles with the hooks added: they run, from the second step
            assert deferred == 4, deferred
