"""Buckets, not param groups, are the unit of overlap: a model given as one group, as two
(decay / no decay, as nanoGPT's and HF Trainer's configure_optimizers write them) or as a group per
block overlaps alike, with buckets that span groups once the order of the first backward is learned,
with attach() and opt.clip_grad_norm_ (reached or not): the same bits as overlap=False, close to
torch.optim.AdamW (+ torch's clip_grad_norm_), early work kept on the steps that do not clip, and
every step deferred under attach() (a clipped one too: its update runs with the step's own scalars
beside the next forward)."""
import gc
import json

import pytest
import torch

import ferry.torch
from nets import Net, assert_close_to, assert_same_bits, batches, loss_of, net_groups

STEPS = 8


def groups_of(net, grouping):
    if grouping == "one":
        return net.parameters()
    if grouping == "decay":
        ps = [p for p in net.parameters() if p.requires_grad]
        return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
    return net_groups(net)


def run(device, grouping, overlap, attach, clip, bucket_mb, reference=False):
    """STEPS steps of the nets.Net loop; returns the net and the optimizer. clip: None, or the max
    norm passed to clip_grad_norm_ (opt's, or torch's for the reference)."""
    net = Net(seed=3).to(device)
    if reference:
        opt = torch.optim.AdamW(groups_of(net, grouping), lr=1e-2, weight_decay=0.1, foreach=False)
    else:
        opt = ferry.torch.Optimizer(groups_of(net, grouping), lr=1e-2, weight_decay=0.1, policy="offload_all",
                                    overlap=overlap, transfer_chunk_bytes=1024, bucket_mb=bucket_mb)
        if attach:
            opt.attach(net)
    norms = []
    for step in range(1, STEPS + 1):
        x, y = batches(device, step)[0]
        loss_of(net, x, y, 2 * step + 1).backward()  # odd: `spare` has a grad at every step, as torch counts it
        if clip is not None:
            if reference:
                norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip))
            else:
                norms.append(opt.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad(set_to_none=reference)
    if not reference:
        opt.wait_params()
        opt.engine.synchronize()
    return net, opt, norms


@pytest.mark.parametrize("grouping", ["one", "decay", "block"])
@pytest.mark.parametrize("clip", [None, 1e6, 1e-3])
def test_any_grouping_overlaps_and_gives_the_same_bits(device, grouping, clip):
    bucket_mb = 2e-4  # ~200 bytes of grads: a weight alone, a bias with the next param
    net, opt, norms = run(device, grouping, overlap=True, attach=True, clip=clip, bucket_mb=bucket_mb)
    plain_net, plain, plain_norms = run(device, grouping, overlap=False, attach=False, clip=clip, bucket_mb=bucket_mb)
    ref_net, _, ref_norms = run(device, grouping, overlap=None, attach=False, clip=clip, bucket_mb=None, reference=True)
    assert_same_bits(net, plain_net, grouping)
    assert_close_to(net, ref_net)
    for a, b, r in zip(norms, plain_norms, ref_norms):
        assert a.item() == b.item()
        assert abs(a.item() - r.item()) <= 1e-5 * r.item()
    stats = opt.stats()
    assert stats["deferred_steps"] == STEPS, stats  # under attach() every step, a clipped one too
    if clip == 1e-3:  # reached every step: the speculation fails, each step recomputes (deferred)
        assert stats["early_groups_recomputed"] > 0, stats
    else:
        assert stats["early_groups_kept"] > 0 and stats["early_groups_recomputed"] == 0, stats
    # The buckets follow the backward: once learned, some span groups (not with one group).
    spanning = [u for u in opt._units if len({opt._group_of[k] for k in u}) > 1]
    assert bool(spanning) == (grouping != "one"), opt._units
    assert len(opt._units) > 3


def test_one_bucket_per_param_and_one_for_everything(device):
    """The extremes: a bucket per param, and one bucket for the whole model (a frozen param in it:
    never announced by the hooks, so the step does it all) give the same bits."""
    nets = [run(device, "decay", overlap=True, attach=True, clip=None, bucket_mb=mb)[0] for mb in (1e-9, 1e3)]
    plain_net = run(device, "decay", overlap=False, attach=False, clip=None, bucket_mb=1.0)[0]
    for net in nets:
        assert_same_bits(net, plain_net)


def test_bucket_mb_is_checked(device):
    net = Net().to(device)
    for bad in (0, -1, "16", True):
        with pytest.raises(ValueError, match="bucket_mb"):
            ferry.torch.Optimizer(net.parameters(), bucket_mb=bad)


@pytest.mark.parametrize("grouping", ["block", "one", "decay"])
def test_spare_state_budget(device, grouping):
    """spare_state=f: the overlap's spare state takes at most f of the offloaded state (the params that
    fit, spread over the model whatever the groups, speculate; the others update once step() knows the
    step); the same bits at 0, 0.5 and 1, and at 0.5 a model in one group or two speculates too."""
    plain_net = run(device, grouping, overlap=False, attach=False, clip=None, bucket_mb=1e-3)[0]
    sizes = {}
    for spare in (0.0, 0.5, 1.0):
        net = Net(seed=3).to(device)
        opt = ferry.torch.Optimizer(groups_of(net, grouping), lr=1e-2, weight_decay=0.1, policy="offload_all",
                                    overlap=True, transfer_chunk_bytes=1024, bucket_mb=1e-3, spare_state=spare)
        opt.attach(net)
        for step in range(1, STEPS + 1):
            x, y = batches(device, step)[0]
            loss_of(net, x, y, 2 * step + 1).backward()
            opt.step()
            opt.zero_grad()
        opt.wait_params()
        assert_same_bits(net, plain_net, "spare_state=%s" % spare)
        stats = opt.stats()
        sizes[spare] = stats["spare_state_bytes"]
        assert stats["deferred_steps"] == STEPS
        assert (stats["early_groups_kept"] > 0) == (spare > 0), (spare, stats)
    # (A page at the least: with one group this net's half is a page too; early_groups_kept above
    # tells 0 from 0.5.)
    assert sizes[0.0] <= 4096 and sizes[0.0] <= sizes[0.5] < sizes[1.0], sizes
    with pytest.raises(ValueError, match="spare_state"):
        ferry.torch.Optimizer(Net().parameters(), spare_state=1.5)


def test_a_clipped_step_updates_layers_in_forward_order(device, tmp_path):
    """A clip reached at every step keeps no speculation: under attach() the step's update runs after
    step(), beside the next forward, which waits layer by layer. ferry.torch registers decay /
    no-decay groups group by group (every weight before every bias), so the update must follow the
    backward's buckets, not the registration: in the trace, the parts each layer's wait names are
    queued (and so taken by the engine's early thread, the latest first) no later than the parts of
    the layers after it. With the registration order the first layer's bias waited for every weight."""
    layers, dim = 6, 32
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]).to(device)
    groups = groups_of(net, "decay")
    trace = str(tmp_path / "trace.json")
    opt = ferry.torch.Optimizer(groups, lr=1e-2, weight_decay=0.1, policy="offload_all", overlap=True,
                                transfer_chunk_bytes=1024, bucket_mb=2e-4, trace_path=trace)
    opt.attach(net)
    for step in range(1, 4):
        x = torch.randn(8, dim, generator=torch.Generator().manual_seed(step)).to(device)
        net(x).pow(2).mean().backward()
        opt.clip_grad_norm_(1e-6)
        opt.step()
        opt.zero_grad()
    opt.wait_params()
    assert opt.stats()["deferred_steps"] == 3
    del opt
    gc.collect()  # the engine writes its trace when it is destroyed
    registered = [p for g in groups for p in g["params"]]  # the engine's param indices
    layer_of = {i: next(k for k, m in enumerate(net) if any(p is q for q in m.parameters()))
                for i, p in enumerate(registered)}
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    steps = sorted(e["ts"] for e in events if e.get("ph") == "X" and e["name"] == "step")
    waits = sorted((e for e in events if e.get("ph") == "X" and e["name"] == "wait.upload"
                    and "part" in e.get("args", {})), key=lambda e: e["ts"])
    checked = 0
    for begin, end in zip(steps[1:], steps[2:] + [float("inf")]):  # the forwards after steps 1 and 2
        parts = {}  # layer -> the parts its waits named
        for e in waits:
            if begin <= e["ts"] < end:
                parts.setdefault(layer_of[int(e["args"]["param"])], []).append(e["args"]["part"])
        assert sorted(parts) == list(range(layers)), parts
        for k in range(1, layers):
            assert max(parts[k]) <= min(parts[k - 1]), (k, parts)
            checked += 1
    assert checked == 2 * (layers - 1)


@pytest.mark.parametrize("n", [1, 5])
def test_copy_all_copies_each_pair(device, n):
    """The grads' batched copies (one foreach launch on torch >= 2.2, a copy each before): every
    destination, a view into a larger buffer included, holds its source's bits, other elements stay."""
    from ferry import _buckets
    gen = torch.Generator().manual_seed(n)
    sizes = [1 + 37 * i for i in range(n)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16][:n]
    srcs = [torch.randn(s, generator=gen).to(dt).to(device) for s, dt in zip(sizes, dtypes)]
    bufs = [torch.randn(s + 8, generator=gen).to(dt).to(device) for s, dt in zip(sizes, dtypes)]
    before = [b.clone() for b in bufs]
    dsts = [b[4:4 + s] for b, s in zip(bufs, sizes)]  # views, as attach_ddp's ranges of a param
    _buckets.copy_all(dsts, srcs)
    def bits(t):
        return t.cpu().view(torch.int32 if t.element_size() == 4 else torch.int16)
    for b, was, src, s in zip(bufs, before, srcs, sizes):
        assert torch.equal(bits(b[4:4 + s]), bits(src))
        assert torch.equal(bits(b[:4]), bits(was[:4])) and torch.equal(bits(b[4 + s:]), bits(was[4 + s:]))
    _buckets.copy_all([], [])  # nothing to copy: no launch, no error


def test_hooks_name_their_waits_and_announcements_only_while_a_profiler_runs(device):
    """Under torch.profiler an attached, overlapped loop's hooks leave ferry.announce and
    ferry.wait_params ranges (ferry trace splits a stream's wait for its host by them); outside one,
    annotate() is a no-op context and records nothing."""
    from ferry import _buckets
    with _buckets.annotate("ferry.nothing") as ctx:
        assert ctx is None  # contextlib.nullcontext: no profiler
    net = Net(seed=3).to(device)
    opt = ferry.torch.Optimizer(net.parameters(), lr=1e-2, policy="offload_all", overlap=True,
                                transfer_chunk_bytes=1024, bucket_mb=2e-4)
    opt.attach(net)
    for step in range(1, 3):  # the second step's forward waits for the first step's params
        x, y = batches(device, step)[0]
        if step == 2:
            prof = torch.profiler.profile()
            prof.__enter__()
        loss_of(net, x, y, 2 * step + 1).backward()
        opt.step()
        opt.zero_grad()
    x, y = batches(device, 3)[0]
    loss_of(net, x, y, 7)  # a forward: the pre-hooks wait for step 2's params
    prof.__exit__(None, None, None)
    opt.wait_params()
    names = {e.name for e in prof.events()}
    assert {"ferry.announce", "ferry.wait_params"} <= names, sorted(n for n in names if n.startswith("ferry"))
