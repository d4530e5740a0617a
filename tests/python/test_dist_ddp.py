"""ferry.torch.Optimizer.attach_ddp (ferry/_ddp.py): overlap under DistributedDataParallel, 2 gloo
processes, on the tensors of FERRY_TEST_DEVICE (CPU: the host backend; CUDA: both ranks on one GPU).

  * exactness: DDP + attach_ddp + overlap=True (and None: on after the first step) ends every step
    with the same bits as DDP without the hook and overlap=False, over 6 steps of fresh random
    batches (each rank its own), one of them a no_sync() accumulation of two micro-batches; ZeRO-1
    (shard=True) and unsharded, with
    gradient_as_bucket_view off and on; the overlapped run kept its early work (announced during the
    backward, not recomputed), with attach(model)'s deferred steps (ZeRO-1's all-gather waits for
    their uploads; the grads zero_grad() leaves for the next forward are zeroed also where DDP's
    bucket rebuild copied them into its bucket, gradient_as_bucket_view=True);
  * ordering: what the engine reads at each announcement (the optimizer's grad buffers at the
    GradsReady call) is the all-reduced average of the ranks' grads, computed here by hand, never a
    rank's own grad; announcements come during the backward (before it returns); on CUDA each is
    made on the bridge's high-priority side stream, never on the comm hook's pool stream;
  * the loops people write: the params in one group (model.parameters()) or in weight-decay and
    no-decay groups, clipped with opt.clip_grad_norm_ between the backward and step(), ZeRO-1 and
    unsharded: the same bits as DDP with overlap=False and the same clip, every step, with the clip
    reached on some steps and not on others; the norms returned are the reference's and torch's
    clip_grad_norm_'s, and the steps that did not clip kept their early work;
  * a model-only load between steps (model.load_state_dict on every rank, after opt.wait_params()),
    ZeRO-1 and unsharded, attached: every rank's masters take the loaded weights (its range of them),
    and the params stay within test_adamw_match's ULP bound of DDP + torch.optim.AdamW given the same
    load;
  * misuse: a second backward outside no_sync() after the announcements raises naming the param;
    find_unused_parameters=True is refused.

DDP's buckets are made small (dist._DEFAULT_FIRST_BUCKET_BYTES and bucket_cap_mb) so that a backward
reduces several buckets and the groups are announced one after another.
"""
import os

import pytest
import torch

import dist_util

STEPS = 6
NO_SYNC_AT = 2  # this step accumulates two micro-batches, the first under no_sync()
DIMS = (12, 40, 40, 24, 6)  # four Linear layers, one param group each
GATHER_MB = 2048 / (1 << 20)


def device():
    """The ranks' device: FERRY_TEST_DEVICE (the python.cuda.* variant: cuda; conftest skips it
    without a GPU)."""
    return torch.device(os.environ.get("FERRY_TEST_DEVICE", "cpu"))


def make_model(seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in zip(DIMS[:-1], DIMS[1:])]
    seq = []
    for layer in layers:
        seq += [layer, torch.nn.Tanh()]
    return torch.nn.Sequential(*seq[:-1]).to(device())


def groups_of(model):
    return [{"params": list(m.parameters())} for m in model if isinstance(m, torch.nn.Linear)]


def wrap(model, gabv):
    import torch.distributed as dist
    dist._DEFAULT_FIRST_BUCKET_BYTES = 2048  # several buckets from the first backward on
    return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004, gradient_as_bucket_view=gabv)


def batch(rank, step, micro):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x, y = torch.randn(8, DIMS[0], generator=gen), torch.randn(8, DIMS[-1], generator=gen)
    return x.to(device()), y.to(device())


def loss_of(model, rank, step, micro):
    x, y = batch(rank, step, micro)
    return torch.nn.functional.mse_loss(model(x), y)


def build(model, shard, overlap):
    import ferry.torch
    # ZeRO-1: buckets and gather units of ~2 KiB, so that each step gathers several units
    kw = dict(shard=True, collective_timeout=30, bucket_mb=GATHER_MB) if shard else {}
    return ferry.torch.Optimizer(groups_of(model), lr=1e-2, weight_decay=0.1, policy="offload_all",
                                 overlap=overlap, **kw)


def train(opt, ddp, rank, step):
    if step == NO_SYNC_AT:
        with ddp.no_sync():
            loss_of(ddp, rank, step, 1).backward()
    loss = loss_of(ddp, rank, step, 0)
    loss.backward()
    announced = len(opt._tracker.announced)
    opt.step()
    opt.zero_grad()
    # ZeRO-1 gather units left for the next forward (attach(); none otherwise)
    left = 0 if opt._zero is None else len(opt._zero.units) - opt._zero.next_unit
    return announced, loss.detach(), left


def bits(t):
    return t.detach().view(torch.int32)


def exact(rank, world, shard, gabv, overlap):
    import ferry.torch  # noqa: F401
    from ferry import _zero
    _zero.SOLO_BYTES = 4096  # the 40 x 40 and 40 x 24 weights are gather units of their own
    mine, ref = make_model(), make_model()
    ddp_mine, ddp_ref = wrap(mine, gabv), wrap(ref, gabv)
    opt = build(mine, shard, overlap=overlap).attach_ddp(ddp_mine)
    opt.attach(mine)  # deferred steps too: each layer's forward waits for its own group
    ref_opt = build(ref, shard, overlap=False)
    announced, left = [], []
    for step in range(STEPS):
        # The params are read only by the forwards (attach(): each module waits for its own group),
        # so each loss checks the params of the step before; the params themselves at the end.
        n, loss, deferred = train(opt, ddp_mine, rank, step)
        announced.append(n)
        left.append(deferred)
        _, ref_loss, ref_left = train(ref_opt, ddp_ref, rank, step)
        assert ref_left == 0, "rank %d step %d: not attached, yet %d gather units were left" % (rank, step, ref_left)
        if not torch.equal(bits(loss), bits(ref_loss)):
            raise AssertionError("rank %d step %d: loss %r, DDP without the hook and overlap=False %r"
                                 % (rank, step, loss.item(), ref_loss.item()))
    opt.wait_params()  # attach(): the last step's uploads, before reading the params here
    for i, (a, b) in enumerate(zip(mine.parameters(), ref.parameters())):
        diff = (bits(a) != bits(b)).sum().item()
        if diff:
            raise AssertionError("rank %d param %d: %d elements differ from DDP without the hook and "
                                 "overlap=False after %d steps" % (rank, i, diff, STEPS))
    stats = opt.stats()
    local = sum(1 for g in opt.placement() if g["numel"] > 0)  # ZeRO-1: groups with elements on this rank
    return {"announced": announced, "kept": stats["early_groups_kept"], "local": local, "left": left,
            "units": len(opt._zero.units) if opt._zero is not None else 0,
            "recomputed": stats["early_groups_recomputed"],
            "sum": sum(p.double().sum().item() for p in mine.parameters())}


@pytest.mark.parametrize("shard,gabv,overlap", [(True, False, True), (True, True, None), (False, True, True)])
def test_overlap_bit_identical_to_ddp_without_it(shard, gabv, overlap):
    results = dist_util.ok(dist_util.run_ranks(2, exact, shard, gabv, overlap, timeout=120))
    params = 2 * (len(DIMS) - 1)  # a weight and a bias per layer
    # overlap=True: every param announced during each backward (a DDP bucket at a time), and the
    # early work kept; None: from the second step on (the first shows it safe; the no_sync()
    # micro-batch does not turn it off)
    early = STEPS if overlap else STEPS - 1
    for rank, r in enumerate(results):
        assert r["announced"] == [0] * (STEPS - early) + [params] * early, (rank, r["announced"])
        assert r["local"] > 0 and r["kept"] == r["local"] * early and r["recomputed"] == 0, \
            (rank, r["local"], r["kept"], r["recomputed"])
        if shard:  # every gather unit of each step was left for the next forward's pre-hooks
            assert r["units"] >= 3 and r["left"] == [r["units"]] * STEPS, (rank, r["units"], r["left"])
    assert results[0]["sum"] == results[1]["sum"]  # the replicas agree


def user_groups(model, grouping):
    params = list(model.parameters())
    if grouping == "one":
        return params
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


CLIP = 0.5  # the global norm of these grads lies between 0.4 and 0.7: some steps clip, some do not


def clipped(rank, world, grouping, shard):
    import ferry.torch
    mine, ref = make_model(), make_model()
    ddp_mine, ddp_ref = wrap(mine, True), wrap(ref, True)
    kw = dict(shard=True, collective_timeout=30, bucket_mb=GATHER_MB) if shard else {}
    opt = ferry.torch.Optimizer(user_groups(mine, grouping), lr=1e-2, policy="offload_all", overlap=True,
                                **kw).attach_ddp(ddp_mine).attach(mine)
    ref_opt = ferry.torch.Optimizer(user_groups(ref, grouping), lr=1e-2, policy="offload_all", overlap=False, **kw)
    norms, ref_norms, torch_norms = [], [], []
    for step in range(STEPS):
        loss = loss_of(ddp_mine, rank, step, 0)
        loss.backward()
        norms.append(opt.clip_grad_norm_(CLIP).item())
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(ddp_ref, rank, step, 0)
        ref_loss.backward()
        torch_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item())  # changes no grad
        ref_norms.append(ref_opt.clip_grad_norm_(CLIP).item())
        ref_opt.step()
        ref_opt.zero_grad()
        if not torch.equal(bits(loss), bits(ref_loss)):
            raise AssertionError("rank %d step %d: loss %r, overlap=False %r"
                                 % (rank, step, loss.item(), ref_loss.item()))
    opt.wait_params()
    for i, (a, b) in enumerate(zip(mine.parameters(), ref.parameters())):
        if not torch.equal(bits(a), bits(b)):
            raise AssertionError("rank %d param %d differs from overlap=False after %d steps" % (rank, i, STEPS))
    stats = opt.stats()
    return {"norms": norms, "ref_norms": ref_norms, "torch_norms": torch_norms, "kept": stats["early_groups_kept"],
            "deferred": stats["deferred_steps"]}


@pytest.mark.parametrize("grouping,shard", [("one", False), ("one", True), ("decay", False), ("decay", True)])
def test_one_or_two_groups_clipped_by_the_optimizer(grouping, shard):
    results = dist_util.ok(dist_util.run_ranks(2, clipped, grouping, shard, timeout=120))
    for rank, r in enumerate(results):
        assert r["norms"] == r["ref_norms"], (rank, r["norms"], r["ref_norms"])
        assert r["norms"] == pytest.approx(r["torch_norms"], rel=1e-6), (rank, r["norms"], r["torch_norms"])
        over = [n > CLIP for n in r["norms"]]
        assert any(over) and not all(over), (rank, r["norms"])
        assert r["kept"] > 0 and r["deferred"] == STEPS, (rank, r["kept"], r["deferred"])
    assert results[0]["norms"] == results[1]["norms"]


def loaded(rank, world, shard):
    import ferry.torch
    from nets import assert_close_to
    mine, ref = make_model(), make_model()
    ddp_mine, ddp_ref = wrap(mine, True), wrap(ref, True)
    kw = dict(shard=True, collective_timeout=30, bucket_mb=GATHER_MB) if shard else {}
    opt = ferry.torch.Optimizer(mine.parameters(), lr=1e-2, weight_decay=0.1, policy="offload_all", overlap=True,
                                **kw).attach_ddp(ddp_mine).attach(mine)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    other = make_model(seed=7).state_dict()
    for step in range(STEPS):
        if step == 3:
            opt.wait_params()
            mine.load_state_dict(other)
            ref.load_state_dict(other)
        for m, o in ((ddp_mine, opt), (ddp_ref, ref_opt)):
            loss_of(m, rank, step, 0).backward()
            o.step()
            o.zero_grad()
        opt.wait_params()
        assert_close_to(mine, ref, "rank %d step %d" % (rank, step))
    return opt.stats()["params_synced"]


@pytest.mark.parametrize("shard", [True, False])
def test_a_model_load_between_steps_reaches_every_ranks_masters(shard):
    synced = dist_util.ok(dist_util.run_ranks(2, loaded, shard, timeout=120))
    params = 2 * (len(DIMS) - 1)
    if shard:  # each rank refreshed the params it holds elements of: every param, between the two
        assert 0 < min(synced) and max(synced) < params <= sum(synced), synced
    else:
        assert synced == [params, params], synced


class Recorder:
    """Wraps the optimizer's engine: at each grads_ready_params, a copy of what the engine will read
    (this rank's range of every announced param's grad buffer), and whether the backward had returned."""

    def __init__(self, opt):
        self.engine, self.opt, self.calls, self.in_backward = opt._engine, opt, [], False
        self.streams = set()  # the streams the announcements were made on (CUDA)

    def grads_ready_params(self, names, **kw):
        opt = self.opt
        self.streams.add(kw.get("stream"))
        for name in names:
            k = opt._names.index(name)
            b, e = opt._grad_range(k)
            self.calls.append((k, self.in_backward, opt._grads[k].view(-1)[b:e].clone()))
        return self.engine.grads_ready_params(names, **kw)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def ordering(rank, world, shard):
    import torch.distributed as dist
    model, plain = make_model(), make_model()
    ddp = wrap(model, False)
    opt = build(model, shard, overlap=True).attach_ddp(ddp)
    rec = Recorder(opt)
    opt._engine = rec
    checked = 0
    for step in range(3):
        # The average of the ranks' grads by hand: each rank's local grads on a plain replica,
        # all-gathered, times 1/2 and summed (as DDP: every grad times 1 / world, then the sum).
        for p, q in zip(plain.parameters(), model.parameters()):
            with torch.no_grad():
                p.copy_(q)
            p.grad = None
        loss_of(plain, rank, step, 0).backward()
        local = [p.grad.detach().clone() for p in plain.parameters()]
        every = []
        for g in local:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            every.append(sum(x * (1.0 / world) for x in parts))
        rec.calls = []
        rec.in_backward = True
        loss_of(ddp, rank, step, 0).backward()
        rec.in_backward = False
        assert len({k for k, _, _ in rec.calls}) == len(local), "step %d: announced %s" % (step, rec.calls)
        for k, during, seen in rec.calls:
            b, e = opt._grad_range(k)
            want = every[k].reshape(-1)[b:e]
            assert during, "param %d announced after the backward returned" % k
            assert not torch.equal(want, local[k].reshape(-1)[b:e]) or e == b
            if not torch.equal(seen, want):
                raise AssertionError("rank %d step %d param %d: the engine would read %s, the averaged grad is %s"
                                     % (rank, step, k, seen[:4].tolist(), want[:4].tolist()))
            checked += e - b
        opt.step()
        opt.zero_grad()
    if model[0].weight.is_cuda:
        side = opt._ddp._side
        assert side is not None and rec.streams == {side.cuda_stream}, \
            "announced on streams %s, not the bridge's side stream %s" % (rec.streams, side and side.cuda_stream)
        assert side.priority < 0, "the side stream has priority %d, not a high one" % side.priority
    # A second backward outside no_sync() after the groups were announced: refused, naming the param.
    loss_of(ddp, rank, 9, 0).backward()
    error = None
    try:
        loss_of(ddp, rank, 9, 1).backward()
    except RuntimeError as e:
        error = str(e)
    return {"checked": checked, "error": error}


@pytest.mark.parametrize("shard", [True, False])
def test_engine_reads_the_all_reduced_grads(shard):
    results = dist_util.ok(dist_util.run_ranks(2, ordering, shard, timeout=120))
    numel = sum(a * b + b for a, b in zip(DIMS[:-1], DIMS[1:]))
    checked = [r["checked"] for r in results]
    assert sum(checked) == 3 * numel * (1 if shard else 2), checked
    for r in results:
        assert r["error"] is not None and "announced" in r["error"] and "no_sync" in r["error"], r["error"]


def refused(rank, world):
    import ferry.torch
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = ferry.torch.Optimizer(groups_of(model), lr=1e-2, policy="offload_all", overlap=True)
    try:
        opt.attach_ddp(ddp)
    except ValueError as e:
        return str(e)
    return None


def test_find_unused_parameters_refused():
    for message in dist_util.ok(dist_util.run_ranks(2, refused, timeout=60)):
        assert message is not None and "find_unused_parameters" in message
