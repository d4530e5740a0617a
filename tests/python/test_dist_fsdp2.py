"""ferry.torch.Optimizer over FSDP2 (torch.distributed fsdp `fully_shard`, torch >= 2.4): params that
are DTensors sharded on dim 0 are registered as their local rows (the global shape, the flattened
range, the local tensor's storage), FSDP2's uneven shards included (it pads the storage of the last
ranks' shards; the local tensor is the unpadded rows, possibly none).

On CPU tensors with gloo (FSDP2 runs on CPU in the torch of the GPU machine, 2.11; upstream's own
FSDP2 tests run there with allow_cpu=True), 1 to 4 processes:
  * registration: each rank's engine steps exactly its local rows of every param, in place in the
    DTensor's local storage (the storage FSDP2 all-gathers from);
  * with the same global grads (assigned as DTensors), 8 steps with clipping and an lr schedule are
    bit-identical to the single-process ferry.torch.Optimizer over plain tensors, and within
    test_adamw_match's FP32_ULPS of torch.optim.AdamW + clip_grad_norm_ (fp32); state_dict() gathers
    the same state as the single process's;
  * real training: forward/backward through fully_shard (FSDP2's all-gather reads what Ferry wrote,
    its reduce-scatter makes the grads) follows torch.optim.AdamW on an identical FSDP2 model;
  * a Ferry checkpoint saved by W ranks resumes on W' ranks for every pair in 1..4, bit-identical.
On a torch without FSDP2 (Debian's 1.13) every test here skips, saying so.
"""
import math
import os
import re

import pytest
import torch

import dist_util

STEPS = 8
SAVE_AT = 4
CLIP = 4.0  # the global grad norm is ~ 48 with the grads below (2.4 when scaled): most steps clip, not all
# fp32 params of one FSDP2 group (root) and bf16 params of another (a child module): uneven rows,
# a param smaller than the world (only the first ranks hold rows), a 1-row param.
F32 = ((13, 7), (64, 33), (5,), (3, 4), (1, 9))
BF16 = ((10, 6), (7,))


def torch_version():
    return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())


def fsdp2():
    """(fully_shard, DTensor, Shard, init_device_mesh) of this torch, or None where it has no FSDP2
    (before 2.4; not even imported there: torch 1.13's torch.distributed.fsdp fails to import on
    Python 3.11). fully_shard is torch.distributed.fsdp.fully_shard from torch 2.6 and
    torch.distributed._composable.fsdp.fully_shard in 2.4-2.5; DTensor is in torch.distributed.tensor
    from 2.5, torch.distributed._tensor before."""
    if torch_version() < (2, 4):
        return None
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        from torch.distributed._tensor import DTensor, Shard
    from torch.distributed.device_mesh import init_device_mesh
    return fully_shard, DTensor, Shard, init_device_mesh


pytestmark = pytest.mark.skipif(
    fsdp2() is None, reason="torch %s has no FSDP2 (fully_shard needs torch >= 2.4)" % torch.__version__)


class Holder(torch.nn.Module):
    """Params only (no forward): the optimizer tests assign grads."""

    def __init__(self, shapes, dtype, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i, s in enumerate(shapes):
            setattr(self, "w%d" % i, torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)))


class Model(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.f32 = Holder(F32, torch.float32, seed)
        self.low = Holder(BF16, torch.bfloat16, seed + 1)


def plain_params(seed=0):
    m = Model(seed)
    return [p.detach().clone().requires_grad_() for p in m.f32.parameters()], \
           [p.detach().clone().requires_grad_() for p in m.low.parameters()]


def sharded_model(world, seed=0):
    fully_shard, _, _, init_device_mesh = fsdp2()
    mesh = init_device_mesh("cpu", (world,))
    m = Model(seed)
    fully_shard(m.low, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, mesh


def rows(rank, world, n):
    """[begin, end) rows of rank's dim-0 shard: torch.chunk's split (ceil(n / world) rows per rank, the
    last ranks fewer or none), as FSDP2 cuts (FSDPParam._init_sharded_param: _chunk_with_empty)."""
    c = -(-n // world)
    return min(rank * c, n), min((rank + 1) * c, n)


def lr_at(step):
    return 1e-2 * (1.0 - step / 20.0)


def global_grad(shape, step, i, dtype):
    gen = torch.Generator().manual_seed(7919 * step + 31 * i + 5)
    scale = 0.05 if step % 3 == 2 else 1.0  # every third step's norm stays under CLIP
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def assign_dtensor_grads(params, step, rank, world, mesh):
    _, DTensor, Shard, _ = fsdp2()
    for i, p in enumerate(params):
        g = global_grad(tuple(p.shape), step, i, p.dtype)
        b, e = rows(rank, world, g.shape[0])
        p.grad = DTensor.from_local(g[b:e].contiguous(), mesh, [Shard(0)], run_check=False, shape=g.shape,
                                    stride=g.stride())


def assign_plain_grads(params, step):
    for i, p in enumerate(params):
        p.grad = global_grad(tuple(p.shape), step, i, p.dtype)


def build(groups, **kw):
    import ferry.torch
    return ferry.torch.Optimizer([{"params": groups[0], "weight_decay": 0.1},
                                  {"params": groups[1], "weight_decay": 0.0}],
                                 lr=lr_at(0), max_grad_norm=CLIP, policy="offload_fraction",
                                 policy_args={"fraction": "0.5"}, collective_timeout=60, **kw)


def run_steps(opt, params, first, last, assign):
    norms = []
    for step in range(first, last):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        assign(params, step)
        opt.step()
        norms.append(opt.stats()["last_grad_norm"])
    return norms


def local_rows(p):
    return p.to_local().detach().clone()


def fsdp_train(rank, world, root):
    """W ranks of FSDP2 params, assigned grads; returns each param's local rows, the registration
    facts and the gathered state_dict."""
    _, DTensor, Shard, _ = fsdp2()
    m, mesh = sharded_model(world)
    f32, half = list(m.f32.parameters()), list(m.low.parameters())
    params = f32 + half
    facts = {"dtensor": [isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) for p in params],
             "local_shapes": [tuple(p.to_local().shape) for p in params],
             "global_shapes": [tuple(p.shape) for p in params]}
    before = [p.to_local().data_ptr() for p in params]
    opt = build([f32, half])
    facts["sharding"] = opt.sharding
    assign = lambda ps, step: assign_dtensor_grads(ps, step, rank, world, mesh)  # noqa: E731
    norms = run_steps(opt, params, 0, SAVE_AT, assign)
    if root:
        opt.save_checkpoint(root, SAVE_AT)
        opt.wait_checkpoint()
    norms += run_steps(opt, params, SAVE_AT, STEPS, assign)
    facts["same_storage"] = [p.to_local().data_ptr() == b for p, b in zip(params, before)]
    sd = opt.state_dict()
    return {"rows": [local_rows(p) for p in params], "facts": facts, "norms": norms, "state": sd["state"]}


def reference(rank, world):
    """One process, plain tensors: ferry.torch.Optimizer, and torch.optim.AdamW with clip_grad_norm_
    (fp32 copies)."""
    f32, half = plain_params()
    opt = build([f32, half])
    norms = run_steps(opt, f32 + half, 0, STEPS, assign_plain_grads)
    ref32 = [p.detach().clone().requires_grad_() for p in plain_params()[0]]
    adamw = torch.optim.AdamW(ref32, lr=lr_at(0), weight_decay=0.1)
    for step in range(STEPS):
        adamw.param_groups[0]["lr"] = lr_at(step)
        assign_plain_grads(ref32, step)
        # Ferry clips on the global norm of every param (both groups): the same coefficient here.
        total = math.sqrt(sum(float(global_grad(tuple(p.shape), step, i, p.dtype).double().pow(2).sum())
                              for i, p in enumerate(f32 + half)))
        coef = min(1.0, CLIP / (total + 1e-6))
        for p in ref32:
            p.grad.mul_(coef)
        adamw.step()
    return {"params": [p.detach().clone() for p in f32 + half], "norms": norms,
            "adamw": [p.detach().clone() for p in ref32], "state": opt.state_dict()["state"]}


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, "%s: %s %s vs %s %s" % (what, a.dtype, tuple(a.shape), b.dtype,
                                                                            tuple(b.shape))
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, "%s: %d elements differ, first at %s" % (what, diff.shape[0], diff[0].tolist())


def shard_of(full, rank, world):
    b, e = rows(rank, world, full.shape[0])
    return full[b:e]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2")
    ref = dist_util.ok(dist_util.run_ranks(1, reference, timeout=120))[0]
    out = {"ref": ref, "root": root, "w": {}}
    for w in (1, 2, 3, 4):
        out["w"][w] = dist_util.ok(dist_util.run_ranks(w, fsdp_train, str(root / ("w%d" % w)), timeout=180))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dtensor_params_registered_as_local_rows(runs, world):
    shapes = F32 + BF16
    total = sum(math.prod(s) for s in shapes)
    stepped = 0
    for rank, res in enumerate(runs["w"][world]):
        facts = res["facts"]
        assert all(facts["dtensor"]), "fully_shard's params are DTensors with placements (Shard(0),)"
        assert facts["global_shapes"] == [tuple(s) for s in shapes]
        for i, s in enumerate(shapes):
            b, e = rows(rank, world, s[0])
            assert facts["local_shapes"][i] == (e - b,) + tuple(s[1:]), "rank %d param %d: FSDP2's rows" % (rank, i)
        sharding = facts["sharding"]
        assert sharding["dtensor"] == len(shapes) and sharding["replicated"] == 0
        assert sharding["all_gather"] is None  # FSDP2 gathers its params itself
        expected = sum((rows(rank, world, s[0])[1] - rows(rank, world, s[0])[0]) * math.prod(s[1:]) for s in shapes)
        assert sharding["local_numel"] == expected
        stepped += sharding["local_numel"]
        # The engine stepped the DTensor's own local storage: it never changed hands.
        assert all(facts["same_storage"])
    assert stepped == total
    # A rank with no rows of a param: (3, 4) on 4 ranks, (1, 9) on every rank but 0.
    if world == 4:
        assert runs["w"][4][3]["facts"]["local_shapes"][3] == (0, 4)
    assert runs["w"][world][1]["facts"]["local_shapes"][4] == (0, 9)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bit_identical_to_single_process(runs, world):
    ref = runs["ref"]
    clipped = [n > CLIP for n in ref["norms"]]
    assert any(clipped) and not all(clipped), "the run clips in some steps only: %s" % ref["norms"]
    for rank, res in enumerate(runs["w"][world]):
        assert res["norms"] == ref["norms"], "rank %d: the global grad norm of every step" % rank
        for i, full in enumerate(ref["params"]):
            assert_same_bits(res["rows"][i], shard_of(full, rank, world),
                             "world %d rank %d param %d" % (world, rank, i))
        # state_dict(): every rank the whole state, the single process's bits.
        assert sorted(res["state"]) == sorted(ref["state"])
        for k, entry in ref["state"].items():
            for kind, t in entry.items():
                assert_same_bits(res["state"][k][kind].reshape(t.shape), t, "state[%d][%s]" % (k, kind))
    start = plain_params()[0][1]
    assert not torch.equal(ref["params"][1], start.detach()), "the run moved the params"


def test_single_process_close_to_torch_adamw(runs):
    from test_adamw_match import FP32_ULPS, ulps
    ref = runs["ref"]
    for i, (a, b) in enumerate(zip(ref["params"], ref["adamw"])):
        assert ulps(a, b) <= FP32_ULPS, "param %d: %.1f ulps from torch.optim.AdamW" % (i, ulps(a, b))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(12, 30)   # 30 rows: uneven on 4 ranks
        self.l2 = torch.nn.Linear(30, 7)    # 7 rows
        self.l3 = torch.nn.Linear(7, 3)     # 3 rows: rank 3 of 4 holds none

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def real_training(rank, world, use_ferry):
    """Forward/backward through fully_shard for 6 steps (each rank its own batch; FSDP2 averages the
    grads), stepped by Ferry or by torch.optim.AdamW with clip_grad_norm_."""
    import ferry.torch
    fully_shard, _, _, init_device_mesh = fsdp2()
    mesh = init_device_mesh("cpu", (world,))
    model = Mlp()
    for layer in (model.l1, model.l2, model.l3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    if use_ferry:
        opt = ferry.torch.Optimizer(params, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, collective_timeout=60)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(6):
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not use_ferry:
            torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "rows": [p.to_local().detach().clone() for p in params]}


@pytest.mark.parametrize("world", [2, 4])
def test_real_fsdp2_training_follows_torch_adamw(world):
    from test_adamw_match import FP32_ULPS, ulps
    mine = dist_util.ok(dist_util.run_ranks(world, real_training, True, timeout=180))
    theirs = dist_util.ok(dist_util.run_ranks(world, real_training, False, timeout=180))
    for rank in range(world):
        a, b = mine[rank], theirs[rank]
        assert a["losses"][0] == b["losses"][0]  # the same model and batch before any step
        for i, (pa, pb) in enumerate(zip(a["rows"], b["rows"])):
            if pa.numel() == 0:
                continue
            assert ulps(pa, pb) <= 4 * FP32_ULPS, "rank %d param %d: %.1f ulps from AdamW" % (rank, i, ulps(pa, pb))
        for i, (pa, pb) in enumerate(zip(a["losses"][1:], b["losses"][1:])):
            assert abs(pa - pb) <= 1e-5 * abs(pb), "rank %d loss after step %d: %r vs %r" % (rank, i + 1, pa, pb)
    # The training moved the params (Ferry's updates reached FSDP2's storage and its forward).
    full = torch.cat([r.reshape(-1) for r in mine[0]["rows"]])
    start0 = [shard_of(p.detach().reshape(p.shape[0], -1), 0, world) for p in Mlp().parameters()]
    assert not torch.equal(full, torch.cat([s.reshape(-1) for s in start0]))


def fsdp_resume(rank, world, roots):
    """Fresh FSDP2 params (other values), each root's checkpoint loaded, the steps after SAVE_AT."""
    m, mesh = sharded_model(world, seed=42)
    f32, half = list(m.f32.parameters()), list(m.low.parameters())
    params = f32 + half
    opt = build([f32, half])
    out = {}
    for w, root in roots.items():
        opt.load_checkpoint(root)
        run_steps(opt, params, SAVE_AT, STEPS, lambda ps, step: assign_dtensor_grads(ps, step, rank, world, mesh))
        out[w] = [local_rows(p) for p in params]
    return out


@pytest.mark.parametrize("resume_world", [1, 2, 3, 4])
def test_checkpoint_saved_by_w_resumes_on_w2(runs, resume_world):
    roots = {w: str(runs["root"] / ("w%d" % w)) for w in (1, 2, 3, 4)}
    assert all(os.path.exists(os.path.join(r, "latest")) for r in roots.values())
    results = dist_util.ok(dist_util.run_ranks(resume_world, fsdp_resume, roots, timeout=180))
    for rank, res in enumerate(results):
        for save_world in (1, 2, 3, 4):
            for i, full in enumerate(runs["ref"]["params"]):
                assert_same_bits(res[save_world][i], shard_of(full, rank, resume_world),
                                 "saved by %d ranks, resumed on %d (rank %d), param %d"
                                 % (save_world, resume_world, rank, i))


def fsdp2_overlap(rank, world):
    """The same FSDP2 training three times, Ferry with overlap=True and attach(model), overlap=True
    alone, and overlap=False (one param group per layer, offloaded): 6 steps, step 2 accumulating two
    micro-batches (the first without gradient sync). FSDP2 calls the sharded params' post-accumulate-
    grad hooks once their reduce-scatter has landed (on its reduce-scatter stream), so the groups are
    announced during the backward; with attach() every step returns before its update, and each
    FSDP2 module's forward (Ferry's hook before FSDP2's all-gather) waits for its own params, and
    l1's for l2's too, which its pre-forward prefetches (set_modules_to_forward_prefetch)."""
    import ferry.torch
    fully_shard, _, _, init_device_mesh = fsdp2()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for overlap, attach in ((True, True), (True, False), (False, False)):
        model = Mlp()
        for layer in (model.l1, model.l2, model.l3):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if hasattr(model.l1, "set_modules_to_forward_prefetch"):  # torch >= 2.5
            model.l1.set_modules_to_forward_prefetch([model.l2])
        groups = [{"params": list(layer.parameters())} for layer in (model.l1, model.l2, model.l3)]
        opt = ferry.torch.Optimizer(groups, lr=1e-2, weight_decay=0.1, policy="offload_all", overlap=overlap,
                                    collective_timeout=60)
        hooks = 0
        if attach:
            opt.attach(model)
            hooks = len(opt._waits.handles)
        gen = torch.Generator().manual_seed(100 + rank)
        losses, announced = [], []
        for step in range(6):
            if step == 2:
                model.set_requires_gradient_sync(False)
                x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)
                torch.nn.functional.mse_loss(model(x), y).backward()
                model.set_requires_gradient_sync(True)
            x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            announced.append(len(opt._tracker.announced))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.wait_params()
        stats = opt.stats()
        out[(overlap, attach)] = {"losses": losses, "announced": announced, "hooks": hooks,
                                  "kept": stats["early_groups_kept"], "recomputed": stats["early_groups_recomputed"],
                                  "deferred": stats["deferred_steps"],
                                  "rows": [p.to_local().detach().clone() for p in model.parameters()]}
    return out


def test_fsdp2_overlap_and_attach_bit_identical_to_no_overlap():
    for rank, r in enumerate(dist_util.ok(dist_util.run_ranks(2, fsdp2_overlap, timeout=180))):
        attached, on, off = r[(True, True)], r[(True, False)], r[(False, False)]
        for run in (attached, on):
            # Every param (a weight and a bias per layer) announced at every step, in buckets.
            assert run["announced"] == [6] * 6, "rank %d: params announced per step %s" % (rank, run["announced"])
            assert run["kept"] == 18 and run["recomputed"] == 0, (rank, run["kept"], run["recomputed"])
        assert off["announced"] == [0] * 6
        # attach(): a pre-hook on each FSDP2 module (l1, l2, l3 and the root, which holds no param), a
        # grad hook per param, a state_dict and a load_state_dict hook on the root and on each module
        # owning params (l1, l2, l3); every step deferred.
        assert attached["hooks"] == 4 + 6 + 2 * 4 and attached["deferred"] == 6, (attached["hooks"], attached["deferred"])
        assert on["deferred"] == 0 and off["deferred"] == 0
        for name, run in (("attach", attached), ("overlap", on)):
            assert run["losses"] == off["losses"], "rank %d, %s: %s vs %s" % (rank, name, run["losses"], off["losses"])
            for i, (a, b) in enumerate(zip(run["rows"], off["rows"])):
                assert_same_bits(a, b, "rank %d, %s, param %d" % (rank, name, i))


class HeadMlp(torch.nn.Module):
    """A body and a head of 1,240 params (of 1,630), as a language model's head outweighs its blocks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.body = torch.nn.Linear(12, 30)
        self.head = torch.nn.Linear(30, 40)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def root_unit_warnings(rank, world):
    """attach() under the real fully_shard, the head left in the root's unit (torch's FSDP2 example) and
    in a unit of its own (torchtitan's): the root-unit warnings each gives, and the loss of a step after."""
    import warnings
    import ferry.torch
    fully_shard, _, _, init_device_mesh = fsdp2()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for own_unit in (False, True):
        model = HeadMlp()
        fully_shard(model.body, mesh=mesh)
        if own_unit:
            fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = ferry.torch.Optimizer(model.parameters(), lr=1e-2, policy="offload_all", overlap=True,
                                    collective_timeout=60)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.attach(model)
        gen = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 40, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        opt.wait_params()
        out[own_unit] = [str(w.message) for w in seen if "root unit" in str(w.message)]
    return out


def test_attach_warns_of_a_root_unit_holding_the_head_under_real_fsdp2():
    for rank, r in enumerate(dist_util.ok(dist_util.run_ranks(2, root_unit_warnings, timeout=180))):
        assert len(r[False]) == 1, "rank %d: %s" % (rank, r[False])
        # The head's 1,240 params of the 1,630 offloaded: 76%, the largest named first.
        assert "fully_shard(HeadMlp)" in r[False][0] and "76% of the offloaded params (head.weight, head.bias)" \
            in r[False][0], r[False][0]
        assert r[True] == [], "rank %d: the head in its own unit still warned: %s" % (rank, r[True])
