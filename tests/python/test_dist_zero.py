"""ferry.torch.Optimizer on several ranks (gloo, host backend): ZeRO-1 (shard=True) is bit-identical
to one rank over 50 steps with clipping, an lr schedule, grads_ready and an injected Inf, for 1, 2,
3 and 4 ranks; each rank holds 1/W of the optimizer state; state_dict() gathers the whole state;
checkpoints saved by W ranks resume on W' ranks for every pair in 1..4, bit-identical; a
single-process torch.optim.AdamW state_dict loads into a sharded optimizer; with attach(model) the
gathers of each step wait for the next forward (layers registered in the reverse of their forward
order, one used twice, one unused) and the losses and params stay the bits of one rank's.

Every rank's grads are the same (as after DDP's all-reduce): fresh random values per step."""
import os

import pytest
import torch

import dist_util

STEPS = 50
SAVE_AT = 20
INF_AT = 17
# Mixed dtypes, two param groups, a large param and small ones (empty ranges on most ranks).
F32 = ((96, 64), (64, 33), (33,), (17, 5), (5,), (40,))
BF16 = ((48, 20), (7,), (3, 3))
ALIGN = 16  # the engine's alignment of each tensor's state (hybrid_optimizer.cc: kAlignElements)


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=gen).requires_grad_() for s in F32]
    ps += [torch.randn(s, generator=gen).to(torch.bfloat16).requires_grad_() for s in BF16]
    return ps


def lr_at(step):
    return 1e-2 * (1.0 - step / 80.0) if step >= 3 else 1e-2 * (step + 1) / 3.0  # warm-up, then decay


def set_grads(ps, step):
    with torch.no_grad():
        for i, p in enumerate(ps):
            gen = torch.Generator().manual_seed(7919 * step + i)
            g = torch.randn(p.shape, generator=gen) * (1.0 + i)
            if step == INF_AT and i == 1:
                g[3, 4] = float("inf")  # one element: only the rank holding it sees it
            p.grad = g.to(p.dtype)  # an assigned grad (in-place writes are not seen)


def build(ps, sharded):
    import ferry.torch
    groups = [{"params": ps[:len(F32)], "weight_decay": 0.1},
              {"params": ps[len(F32):], "weight_decay": 0.0}]
    kw = dict(shard=True, collective_timeout=30) if sharded else {}
    return ferry.torch.Optimizer(groups, lr=lr_at(0), policy="offload_fraction", policy_args={"fraction": "0.5"},
                                 max_grad_norm=1.0, **kw)


def run_steps(opt, ps, first, last):
    for step in range(first, last):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        set_grads(ps, step)
        if step % 2:
            opt.grads_ready([1])  # the early step of group 1 (offloaded or not), as on one rank
        opt.step()


def state_bytes(opt):
    s = opt.stats()
    return s["host_state_bytes"] + s["device_state_bytes"]


def train(rank, world, sharded, root):
    ps = make_params()
    opt = build(ps, sharded)
    run_steps(opt, ps, 0, SAVE_AT)
    if root:
        opt.save_checkpoint(root, SAVE_AT)
        opt.wait_checkpoint()
    run_steps(opt, ps, SAVE_AT, STEPS)
    stats = opt.stats()
    sd = opt.state_dict()
    return {"params": [p.detach().clone() for p in ps], "state": sd["state"], "bytes": state_bytes(opt),
            "skipped": stats["skipped_steps"], "steps": stats["step"]}


def resume(rank, world, roots):
    import ferry.torch
    out = {}
    ps = make_params(seed=99)  # other values: the load must replace them
    opt = build(ps, True)
    for w, root in roots.items():
        opt.load_checkpoint(root)
        run_steps(opt, ps, SAVE_AT, STEPS)
        out[w] = [p.detach().clone() for p in ps]
    # A single-process torch.optim.AdamW's state_dict into the sharded optimizer.
    mine, sd = adamw_state_dict()
    opt2 = ferry.torch.Optimizer(mine, lr=1e-2, weight_decay=0.1, shard=True, collective_timeout=30)
    opt2.load_state_dict(sd)
    back = opt2.state_dict()
    for step in range(3, 5):
        set_grads_plain(mine, step)
        opt2.step()
    out["adamw_roundtrip"] = {k: (back["state"][k]["exp_avg"], back["state"][k]["exp_avg_sq"], back["state"][k]["step"])
                              for k in back["state"]}
    out["adamw_loaded"] = {k: (sd["state"][k]["exp_avg"], sd["state"][k]["exp_avg_sq"]) for k in sd["state"]}
    out["adamw_params"] = [p.detach().clone() for p in mine]
    return out


def set_grads_plain(ps, step):
    with torch.no_grad():
        for i, p in enumerate(ps):
            gen = torch.Generator().manual_seed(31 * step + i)
            g = torch.randn(p.shape, generator=gen)
            p.grad = g  # an assigned grad (in-place writes are not seen)


def adamw_state_dict():
    """A single-process torch.optim.AdamW's state_dict after 3 steps, and fresh copies of its params."""
    fp32 = [p.detach().clone().float().requires_grad_() for p in make_params(seed=5)]
    ref = torch.optim.AdamW(fp32, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        set_grads_plain(fp32, step)
        ref.step()
    return [p.detach().clone().requires_grad_() for p in fp32], ref.state_dict()


def adamw_after_load(rank, world):
    """One rank, unsharded: the reference for the AdamW-load part of resume()."""
    import ferry.torch
    mine, sd = adamw_state_dict()
    opt = ferry.torch.Optimizer(mine, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(sd)
    for step in range(3, 5):
        set_grads_plain(mine, step)
        opt.step()
    return [p.detach().clone() for p in mine]


def bits(t):
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t.view(torch.int32)


def assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, "%s: %d elements differ, first at %s (%r vs %r)" % (
        what, diff.shape[0], diff[0].tolist(), a[tuple(diff[0])].item(), b[tuple(diff[0])].item())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero")
    ref = dist_util.ok(dist_util.run_ranks(1, train, False, None, timeout=120))[0]
    sharded = {}
    for w in (1, 2, 3, 4):
        sharded[w] = dist_util.ok(dist_util.run_ranks(w, train, True, str(root / ("w%d" % w)), timeout=120))
    return {"ref": ref, "sharded": sharded, "root": root}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero1_bit_identical_to_one_rank(runs, world):
    ref = runs["ref"]
    assert ref["skipped"] == 1, "the injected Inf skips exactly one step"
    for rank, res in enumerate(runs["sharded"][world]):
        assert res["steps"] == ref["steps"] == STEPS - 1 and res["skipped"] == 1  # the Inf step is not counted
        for i, (a, b) in enumerate(zip(res["params"], ref["params"])):
            assert_same_bits(a, b, "world %d, rank %d, param %d" % (world, rank, i))
        # state_dict(): the whole state on every rank, the same bits as one rank's.
        assert sorted(res["state"]) == sorted(ref["state"])
        for k, entry in ref["state"].items():
            for kind, t in entry.items():
                assert_same_bits(res["state"][k][kind].reshape(t.shape), t,
                                 "world %d, rank %d, state[%d][%s]" % (world, rank, k, kind))
    # The run moved: the params differ from their start.
    start = make_params()
    assert not torch.equal(ref["params"][0], start[0].detach())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero1_state_memory_is_one_wth(runs, world):
    single = runs["ref"]["bytes"]
    n_params = len(F32) + len(BF16)
    slack = n_params * ALIGN * 12 + world * 12  # each range's alignment, and the pieces' rounding
    per_rank = [res["bytes"] for res in runs["sharded"][world]]
    for rank, b in enumerate(per_rank):
        assert abs(b - single / world) <= slack, "rank %d of %d holds %d bytes of state; one rank %d (1/W = %.0f)" % (
            rank, world, b, single, single / world)
    assert abs(sum(per_rank) - single) <= world * slack


@pytest.fixture(scope="module")
def resumed(runs):
    roots = {w: str(runs["root"] / ("w%d" % w)) for w in (1, 2, 3, 4)}
    out = {}
    for w2 in (1, 2, 3, 4):
        out[w2] = dist_util.ok(dist_util.run_ranks(w2, resume, roots, timeout=150))
    out["adamw_ref"] = dist_util.ok(dist_util.run_ranks(1, adamw_after_load, timeout=60))[0]
    return out


@pytest.mark.parametrize("resume_world", [1, 2, 3, 4])
def test_checkpoint_saved_by_w_resumes_on_w2(runs, resumed, resume_world):
    ref = runs["ref"]["params"]
    assert os.path.exists(str(runs["root"] / "w3" / "latest"))
    for rank, res in enumerate(resumed[resume_world]):
        for save_world in (1, 2, 3, 4):
            for i, (a, b) in enumerate(zip(res[save_world], ref)):
                assert_same_bits(a, b, "saved by %d ranks, resumed on %d (rank %d), param %d"
                                 % (save_world, resume_world, rank, i))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_torch_adamw_state_dict_loads_into_sharded(resumed, world):
    for rank, res in enumerate(resumed[world]):
        for k, (exp_avg, exp_avg_sq) in res["adamw_loaded"].items():
            got = res["adamw_roundtrip"][k]
            assert_same_bits(got[0].reshape(exp_avg.shape), exp_avg.float(), "exp_avg %d" % k)
            assert_same_bits(got[1].reshape(exp_avg_sq.shape), exp_avg_sq.float(), "exp_avg_sq %d" % k)
            assert float(got[2]) == 3.0
        for i, (a, b) in enumerate(zip(res["adamw_params"], resumed["adamw_ref"])):
            assert_same_bits(a, b, "world %d rank %d: param %d two steps after loading AdamW's state" % (world, rank, i))


ASYNC_POLICY = """
return {
  place = function(groups, ctx) local out = {} for _, g in ipairs(groups) do out[g.name] = "cpu" end return out end,
  checkpoint = function(info, ctx) return { skip = {}, async = true, keep_last = 3 } end,
}
"""


def async_saves(rank, world, policy, root, load_from):
    """Asynchronous saves (the engine's writer thread runs the exchange on the comm's duplicate gloo
    group while this thread keeps stepping on the main one), then, with load_from, a resume."""
    import ferry.torch
    ps = make_params()
    groups = [{"params": ps[:len(F32)]}, {"params": ps[len(F32):]}]
    opt = ferry.torch.Optimizer(groups, lr=1e-2, policy=policy, max_grad_norm=1.0, shard=True, collective_timeout=30)
    first = 0
    if load_from:
        opt.load_checkpoint(load_from)
        first = 4
    for step in range(first, 10):
        set_grads(ps, step + 100)
        opt.step()
        if not load_from and step in (1, 3):
            opt.save_checkpoint(root, step + 1)  # returns at once; the next steps overlap the writer
    opt.wait_checkpoint()
    return [p.detach().clone() for p in ps]


def test_async_saves_use_their_own_group_and_resume_on_other_world(tmp_path):
    policy = tmp_path / "async.lua"
    policy.write_text(ASYNC_POLICY)
    root = str(tmp_path / "ck")
    saved = dist_util.ok(dist_util.run_ranks(2, async_saves, str(policy), root, None, timeout=90))
    assert os.path.isdir(os.path.join(root, "step-00000004"))
    resumed = dist_util.ok(dist_util.run_ranks(3, async_saves, str(policy), root,
                                               os.path.join(root, "step-00000004"), timeout=90))
    for rank, res in enumerate(resumed):
        for i, (a, b) in enumerate(zip(res, saved[0])):
            assert_same_bits(a, b, "async save by 2 ranks, resumed on 3 (rank %d), param %d" % (rank, i))


# ---- ZeRO-1 with attach(): the gathers in the next forward -------------------------------------------

class Reversed(torch.nn.Module):
    """Layers registered in the reverse of their forward order (the first layer's pre-hook gathers every
    unit), a layer used twice, and a layer no forward uses (gathered when the forward returns; no grad,
    so its params do not step)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        dims = [(24, 6), (40, 24), (40, 40), (12, 40)]  # (in, out), registered last layer first
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in dims)
        self.unused = torch.nn.Linear(6, 6)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x):
        h = x
        for i, layer in enumerate(reversed(self.layers)):
            h = torch.tanh(layer(h))
            if i == 1:
                h = torch.tanh(layer(h))  # the 40 x 40 layer twice
        return h


def mse_step(model, opt, seed, n_in, n_out):
    """One step on a batch of `seed` (every rank the same batch: the same grads); the loss."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, n_in, generator=gen), torch.randn(8, n_out, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def attached(rank, world, sharded, steps, root=None, whole=False):
    """whole: attach(model, units=[model]): one pre-hook, the model's, gathers every unit."""
    import ferry.torch
    model = Reversed()
    kw = dict(shard=True, collective_timeout=30, bucket_mb=1024 / (1 << 20)) if sharded else {}
    opt = ferry.torch.Optimizer(model.parameters(), lr=1e-2, weight_decay=0.1, policy="offload_all",
                                max_grad_norm=1.0, overlap=sharded, **kw)
    if sharded:
        opt.attach(model, units=[model] if whole else None)
    losses, left = [], []
    for step in range(steps):
        losses.append(mse_step(model, opt, 100 + step, 12, 6))
        if sharded:
            left.append(len(opt._zero.units) - opt._zero.next_unit)
        if root is not None and step == 2:  # with this step's gathers pending: they run first
            state = opt.state_dict()["state"]
            opt.save_checkpoint(root, step + 1)
            opt.wait_checkpoint()
            saved = {k: v["exp_avg"].clone() for k, v in state.items()}
            opt.load_checkpoint(root)  # loads what was just saved: nothing changes
    opt.wait_params()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "left": left,
            "units": len(opt._zero.units) if sharded else 0, "saved": saved if root is not None else None}


@pytest.mark.parametrize("world,ahead_mb,whole", [(2, None, False), (3, None, False), (2, "0.0005", False),
                                                  (3, "1", False), (2, None, True)])
def test_zero1_attached_gathers_in_forward_bit_identical(world, ahead_mb, whole, tmp_path, monkeypatch):
    """ahead_mb: FERRY_ZERO_GATHER_AHEAD_MB, the units a forward pre-hook gathers beyond its module's
    (gloo gathers none ahead by default; 0.0005 MiB: a unit or two here, 1 MiB: all of them). whole:
    the model as attach()'s one unit (units=[model])."""
    if ahead_mb is not None:
        monkeypatch.setenv("FERRY_ZERO_GATHER_AHEAD_MB", ahead_mb)
    steps = 5
    ref = dist_util.ok(dist_util.run_ranks(1, attached, False, steps, str(tmp_path / "one"), timeout=60))[0]
    for rank, res in enumerate(dist_util.ok(dist_util.run_ranks(world, attached, True, steps, str(tmp_path / "w"),
                                                                whole, timeout=120))):
        # state_dict(), a save and a load with the step's gathers pending: the same state as one rank's
        for k, t in ref["saved"].items():
            assert_same_bits(res["saved"][k], t, "world %d rank %d: exp_avg of param %d after step 2" % (world, rank, k))
        # every unit of each step was left for the next forward, which gathered them all
        assert res["units"] >= 4 and res["left"] == [res["units"]] * steps, (rank, res["units"], res["left"])
        for step, (a, b) in enumerate(zip(res["losses"], ref["losses"])):
            assert_same_bits(a, b, "world %d rank %d: loss of step %d" % (world, rank, step))
        for i, (a, b) in enumerate(zip(res["params"], ref["params"])):
            assert_same_bits(a, b, "world %d rank %d: param %d" % (world, rank, i))
    assert not torch.equal(ref["params"][0], Reversed().layers[0].weight.detach())  # the run moved
    assert torch.equal(ref["params"][-1], Reversed().unused.bias.detach())  # no grad: unchanged


def forward_ordered(rank, world, sharded, steps):
    """Layers in forward order: each layer's pre-hook needs the next units. Returns the losses, the
    params and how many pre-hook gathers of each step gathered anything."""
    import ferry.torch
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(*[torch.nn.Linear(i, o) for i, o in [(6, 24), (24, 40), (40, 40), (40, 12)]])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    kw = dict(shard=True, collective_timeout=30, bucket_mb=1024 / (1 << 20)) if sharded else {}
    opt = ferry.torch.Optimizer(model.parameters(), lr=1e-2, policy="offload_all", overlap=sharded, **kw)
    calls = []
    if sharded:
        opt.attach(model)
        z, through = opt._zero, opt._zero.gather_through
        def counted(*args, **kwargs):
            done = through(*args, **kwargs)
            calls[-1] += bool(done)
            return done
        z.gather_through = counted
    losses = []
    for step in range(steps):
        calls.append(0)
        losses.append(mse_step(model, opt, 200 + step, 6, 12))
    in_steps = list(calls)  # wait_params() gathers the last step's units in one more call
    opt.wait_params()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()], "calls": in_steps,
            "units": len(opt._zero.units) if sharded else 0}


@pytest.mark.parametrize("ahead_mb,after,expected", [("0", "1", 4), ("1", "0", 1), ("1", "1", 2)])
def test_zero1_forward_gathers_ahead_in_fewer_calls_bit_identical(ahead_mb, after, expected, monkeypatch):
    """A forward in layer order gathers each layer's units at its pre-hook (4 gathers); with gather-ahead
    (FERRY_ZERO_GATHER_AHEAD_MB=1: more than the model) all of them at the first pre-hook
    (FERRY_ZERO_AHEAD_AFTER=0: 1), or the first layer's at its pre-hook and the rest after its
    forward (the default: 2). The same bits as one rank."""
    monkeypatch.setenv("FERRY_ZERO_GATHER_AHEAD_MB", ahead_mb)
    monkeypatch.setenv("FERRY_ZERO_AHEAD_AFTER", after)
    steps = 4
    ref = dist_util.ok(dist_util.run_ranks(1, forward_ordered, False, steps, timeout=60))[0]
    for rank, res in enumerate(dist_util.ok(dist_util.run_ranks(2, forward_ordered, True, steps, timeout=120))):
        # step 0 has nothing to gather (no step before it); each later step's forward gathers them
        assert res["units"] >= 4 and res["calls"] == [0] + [expected] * (steps - 1), (rank, res["units"], res["calls"])
        for step, (a, b) in enumerate(zip(res["losses"], ref["losses"])):
            assert_same_bits(a, b, "rank %d: loss of step %d" % (rank, step))
        for i, (a, b) in enumerate(zip(res["params"], ref["params"])):
            assert_same_bits(a, b, "rank %d: param %d" % (rank, i))


def test_nccl_gather_runs_cover_the_units_in_order_within_the_cap():
    """ZeRO-1's NCCL gathers group consecutive units into runs of at most the cap's bytes (a larger
    unit alone), each run as long as the cap allows, every unit of first..last once, in order."""
    from ferry import _gather_plan
    rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=rng))
        sizes = [int(s) for s in torch.randint(1, 300, (n,), generator=rng)]
        cap = int(torch.randint(1, 600, (1,), generator=rng))
        first = int(torch.randint(0, n, (1,), generator=rng))
        last = int(torch.randint(first, n, (1,), generator=rng))
        runs = list(_gather_plan.coalesced_runs(sizes, first, last, cap))
        assert [j for j, end in runs for j in range(j, end + 1)] == list(range(first, last + 1)), (sizes, cap, runs)
        for j, end in runs:
            size = sum(sizes[j:end + 1])
            assert size <= cap or end == j, (sizes, cap, runs)
            if end < last:  # the next unit would not have fitted
                assert size + sizes[end + 1] > cap or size >= cap, (sizes, cap, runs)
    assert list(_gather_plan.coalesced_runs([5, 5, 5], 1, 2, 0)) == [(1, 1), (2, 2)]


def test_launch_ahead_waits_until_half_the_bytes_ahead_are_left():
    """After a module's forward, the gathers ahead are launched only where those launched do not yet
    hold every unit within half of `ahead` bytes past its units, and then through `ahead` bytes."""
    from ferry import _gather_plan

    def within(sizes, last, budget):  # the last unit of the longest run past `last` within budget bytes
        end = last
        while end + 1 < len(sizes) and sum(sizes[last + 1:end + 2]) <= budget:
            end += 1
        return end

    rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    launched = 0
    for _ in range(300):
        n = int(torch.randint(1, 40, (1,), generator=rng))
        sizes = [int(s) for s in torch.randint(1, 300, (n,), generator=rng)]
        ahead = int(torch.randint(0, 900, (1,), generator=rng))
        last = int(torch.randint(0, n, (1,), generator=rng))
        next_unit = int(torch.randint(last + 1, n + 1, (1,), generator=rng))
        through = _gather_plan.launch_through(sizes, next_unit, last, ahead)
        if ahead == 0 or next_unit - 1 >= within(sizes, last, ahead // 2):
            assert through is None, (sizes, next_unit, last, ahead, through)
        else:
            launched += 1
            assert through == within(sizes, last, ahead) >= next_unit, (sizes, next_unit, last, ahead, through)
    assert launched > 20
    assert _gather_plan.launch_through([10] * 8, 2, 1, 40) == 5  # nothing past unit 1 launched: through 4 units more
    assert _gather_plan.launch_through([10] * 8, 3, 1, 40) == 5  # 10 bytes launched, less than half of 40
    assert _gather_plan.launch_through([10] * 8, 4, 1, 40) is None  # 20 bytes launched: half


def test_gather_ahead_takes_the_following_units_within_the_bytes():
    """A forward pre-hook that needs units up to `last` gathers the units after it while they add up
    to at most `ahead` bytes: the longest such run, never past the last unit."""
    from ferry import _gather_plan
    rng = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=rng))
        sizes = [int(s) for s in torch.randint(1, 300, (n,), generator=rng)]
        ahead = int(torch.randint(0, 900, (1,), generator=rng))
        last = int(torch.randint(0, n, (1,), generator=rng))
        end = _gather_plan.gather_ahead(sizes, last, ahead)
        assert last <= end < n, (sizes, last, ahead, end)
        assert sum(sizes[last + 1:end + 1]) <= ahead, (sizes, last, ahead, end)
        if end + 1 < n:
            assert sum(sizes[last + 1:end + 2]) > ahead, (sizes, last, ahead, end)
    assert _gather_plan.gather_ahead([5, 5, 5], 0, 0) == 0
    assert _gather_plan.gather_ahead([5, 5, 5], 0, 10) == 2


@pytest.mark.parametrize("text,expected", [(None, 1 << 30), ("", 1 << 30), ("0", 0), ("64", 64 << 20),
                                           ("0.5", 1 << 19)])
def test_gather_group_size_comes_from_the_environment(monkeypatch, text, expected):
    from ferry import _gather_plan
    if text is None:
        monkeypatch.delenv("FERRY_ZERO_COALESCE_MB", raising=False)
    else:
        monkeypatch.setenv("FERRY_ZERO_COALESCE_MB", text)
    assert _gather_plan.coalesce_bytes() == expected


@pytest.mark.parametrize("text", ["-1", "lots"])
def test_a_bad_gather_group_size_is_named(monkeypatch, text):
    from ferry import _gather_plan
    monkeypatch.setenv("FERRY_ZERO_COALESCE_MB", text)
    with pytest.raises(ValueError, match="FERRY_ZERO_COALESCE_MB=%r" % text):
        _gather_plan.coalesce_bytes()
