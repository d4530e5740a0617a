"""Sharding for ferry.torch.Optimizer on several ranks: ZeRO-1 ranges of replicated params (DDP) and
FSDP2 local shards (DTensor params sharded on dim 0). Internal; see ferry.torch.Optimizer's
`process_group` and `shard` arguments.

Every param is registered with the engine as a range [begin, end) of its flattened global tensor:

  * a plain tensor (every rank holds the whole param, as under DDP): with shard=True, the params are
    cut into gather units: runs of about `unit_bytes` of params of one dtype, in the optimizer's
    param order, laid end to end. Each unit is cut into world_size pieces of ceil(n / world_size)
    elements; rank r holds piece r of every unit. A param's range on a rank is its overlap with the
    rank's piece of its unit: uneven, often empty for small params. A param of SOLO_BYTES or more
    whose elements split evenly is a unit of its own. NCCL all-gathers a unit of one param that splits
    evenly in place, without copies in and out (the units of the small params between two large ones are
    often such). After each step the updated pieces are all-gathered into every replica unit by unit, in
    unit order on every rank: each unit's all-gather waits only for the uploads of its own params, so it
    runs while later units still update; under NCCL, runs of consecutive units of up to COALESCE_BYTES
    (_gather_plan.py) go as one NCCL group, each run waiting for its own uploads (on a 4-GPU host the
    units of 1.07B params reached 84-85% of one all-gather of the same bytes grouped, 63-72% one by
    one). After a step of an attached optimizer (attach()) the gathers wait for the next forward: a
    module's forward pre-hook gathers every unit up to the last one holding its params
    (``Sharding.gather_through``), so the first layers run while the later ones still update and gather;
    its forward hook launches the gathers of the units ahead (``Sharding.launch_ahead``) once the
    module's kernels are queued. NCCL (the trainer's `process_group`) for CUDA params when that group's
    backend is NCCL, on a side stream, nothing waited for on the host; else the optimizer's gloo group
    (CPU params; CUDA params under a gloo group: see _gather_group), each all-gather waited for.
  * a DTensor (FSDP2's fully_shard, torch >= 2.4) with placements (Shard(0),) on a 1-D mesh: its local
    rows, as torch.chunk cuts dim 0 (ceil(rows / world) rows per rank, the last ranks fewer or none).
    The range is rows [r * c, r * c + local rows) times the row's elements. FSDP2 gathers params
    itself: no gather here. What this relies on, from torch's FSDPParam._init_sharded_param
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, 2.4 to 2.11): the shards are
    `_chunk_with_empty(param, world, dim=0)`; each rank's storage is padded to chunk 0's size
    (`_sharded_param_data`, what FSDP2's all-gather reads) and the DTensor's local tensor is
    `padded.narrow(0, 0, rows)`: contiguous, the unpadded rows, at the start of that storage, so an
    in-place update of the local tensor is what the next all-gather sends. DTensor.to_local() returns
    that `_local_tensor` (a view of it under autograd), so its data_ptr() is the storage's.

Both are exact: the engine's step is elementwise apart from the global clip and found-inf, which it
reduces exactly across ranks, so the params are bit-identical to one rank's.
"""
import contextlib
import os
import time

import torch
import torch.distributed as dist

from . import _buckets
from . import _gather_plan as plan
from . import distributed as fdist

_nothing = contextlib.nullcontext


def _copy_pairs(pairs):
    """dst.copy_(src) for each (dst, src) of a gather's copies in or out: one foreach launch where
    torch has it (the small params between two large ones: tens of copies a run, each a launch from
    the trainer's thread otherwise)."""
    if pairs:
        _buckets.copy_all([dst for dst, _ in pairs], [src for _, src in pairs])


# A replica param of at least this many bytes whose elements split evenly over the ranks is a gather
# unit of its own, all-gathered in place under NCCL (no copies in and out).
SOLO_BYTES = 1 << 20


def dtensor_class():
    """torch's DTensor class, or None where this torch has none."""
    for mod in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            m = __import__(mod, fromlist=["DTensor"])
            cls = getattr(m, "DTensor", None)
            if cls is not None:
                return cls
        except ImportError:
            continue
    return None


_DTensor = dtensor_class()


def is_dtensor(t):
    return _DTensor is not None and isinstance(t, _DTensor)


def local(t):
    """The tensor whose memory the engine uses: a DTensor's local shard, else the tensor.

    A DTensor's own `_local_tensor` (torch 2.0 to 2.11) where it has one: `to_local()` returns a view
    of it through an autograd function, and the optimizer reads the local tensors of every param at
    each step (the checks of _check_unchanged, the grads it takes), on the autograd thread of a host
    busy with CPU Adam."""
    if not is_dtensor(t):
        return t
    loc = getattr(t, "_local_tensor", None)
    return loc if isinstance(loc, torch.Tensor) else t.to_local()


def _shard0_group(p, where):
    mesh = p.device_mesh
    placements = tuple(p.placements)
    if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard() or placements[0].dim != 0:
        raise ValueError("%s is a DTensor with placements %s on a %d-D mesh: Ferry takes DTensors sharded on dim 0 "
                         "of a 1-D mesh (FSDP2's fully_shard; not HSDP or tensor parallelism)"
                         % (where, placements, mesh.ndim))
    return mesh.get_group(0) if hasattr(mesh, "get_group") else mesh.get_dim_groups()[0]


def process_group_of(params, wheres):
    """The group of the DTensor params' mesh (every one the same), or None when no param is one."""
    group, first = None, None
    for p, where in zip(params, wheres):
        if is_dtensor(p):
            g = _shard0_group(p, where)
            if group is None:
                group, first = g, where
            elif fdist.group_ranks(g) != fdist.group_ranks(group):
                raise ValueError("%s and %s are sharded over different ranks (%s, %s): one optimizer takes one mesh"
                                 % (first, where, fdist.group_ranks(group), fdist.group_ranks(g)))
    return group


def moved_shard_message(where):
    return ("%s: FSDP2 replaced this DTensor's local tensor after the optimizer registered its memory. "
            "From torch 2.5 (pytorch PR 132954) until PR 163130 (September 2025; torch 2.11 has it), "
            "FSDP2's lazy init re-pads every unevenly sharded param once, at the model's first forward "
            "(FSDPParam.reset_sharded_param): on those versions construct ferry.torch.Optimizer after the "
            "model's first forward and backward" % where)


class Sharding:
    """Which range of each param this rank registers, and the collectives around the engine's step.
    One thread at a time (the optimizer's)."""

    def __init__(self, params, wheres, process_group, shard, timeout_s, device, unit_bytes=16 << 20):
        self.comm = fdist.make_comm(process_group, timeout_s)
        if self.comm is None:
            raise ValueError("ferry.torch.Optimizer: this rank (%d) is not in process_group %s"
                             % (dist.get_rank(), fdist.group_ranks(process_group)))
        self.rank, self.world = self.comm.rank, self.comm.world_size
        self.timeout_s = float(timeout_s)
        self.params = params
        self.wheres = wheres
        self.cuda = device.type == "cuda"
        self.gather_group, self.gather_via = self._gather_group(process_group)
        self.nccl = self.cuda and self.gather_group is not self.comm.group
        if self.nccl:
            # The step's gradient check all-reduces on the GPU too: gloo's ring of host threads
            # waited 10-14 ms a step for CPUs on a 4-GPU host whose cores ran the offloaded update.
            self.comm.reduce_on(self.gather_group, device)
        self.last_gather_seconds = 0.0  # host time of the last step's gathers (benchmarks read it)
        self.registered = []  # the local tensors whose memory the engine holds: kept alive here
        self.kind = []   # per param: "dtensor" or "replica"
        self.table = []  # per param: [(begin, end)] of every rank
        self.units = []  # gather units: {"dtype", "elem", "n", "piece", "members": [(k, offset)], "solo"} (+ _plan's keys)
        self.unit_of = []  # per param: its gather unit (None: a DTensor)
        unit = None
        for k, (p, where) in enumerate(zip(params, wheres)):
            if is_dtensor(p):
                self.kind.append("dtensor")
                self.table.append(self._dtensor_ranges(p, where))
                self.unit_of.append(None)
                continue
            if not shard:
                raise ValueError("%s is a plain tensor but the optimizer has %d ranks and shard=False: every rank "
                                 "would step the whole param; pass shard=True (ZeRO-1) or DTensor params"
                                 % (where, self.world))
            self.kind.append("replica")
            # A large param that splits evenly is a unit of its own: NCCL gathers it in place (each
            # rank's piece is its own range of the param, which the engine updates in place).
            solo = p.numel() * p.element_size() >= SOLO_BYTES and p.numel() % self.world == 0
            if solo or unit is None or unit["solo"] or unit["dtype"] != p.dtype or \
                    unit["n"] * p.element_size() >= unit_bytes:
                unit = {"dtype": p.dtype, "elem": p.element_size(), "n": 0, "members": [], "solo": solo}
                self.units.append(unit)
            self.unit_of.append(len(self.units) - 1)
            unit["members"].append((k, unit["n"]))
            unit["n"] += p.numel()
            self.table.append(None)
        self.unit_sizes = [unit["n"] * unit["elem"] for unit in self.units]  # bytes of each unit
        for unit in self.units:
            piece = unit["piece"] = -(-unit["n"] // self.world)
            for k, off in unit["members"]:
                n = params[k].numel()
                self.table[k] = [(min(max(r * piece - off, 0), n), min(max((r + 1) * piece - off, 0), n))
                                 for r in range(self.world)]
        # The gathers of the last step: units [next_unit, len(units)) are not gathered yet.
        self.next_unit = len(self.units)
        self._works = []  # NCCL: (unit, work) of the all-gathers no host wait finished yet
        self._arrival = None
        self._side = None  # NCCL: the side stream of the gathers (high priority, as FSDP2's)
        self._runs = []  # NCCL: (its last unit, an event recorded after it) of each run of gathers this step
        self._waited = -1  # NCCL: the current stream waits for the gathers of units up to this one
        self._all_gather_into = getattr(dist, "all_gather_into_tensor", None) or getattr(dist, "_all_gather_base", None)
        # NCCL: runs of units of about this many bytes gathered as one group (_gather_units_coalesced)
        # where this torch has the coalescing manager of all_gather_into_tensor (2.1 on); 0: unit by
        # unit (FERRY_ZERO_COALESCE_MB=0).
        self.coalesce = plan.coalesce_bytes() if self.nccl and plan.can_coalesce() else 0
        # Gathers ahead in a forward: NCCL's on a stream of their own (gloo's wait on the host: only
        # where FERRY_ZERO_GATHER_AHEAD_MB asks).
        self.ahead = plan.size_from_env("FERRY_ZERO_GATHER_AHEAD_MB", plan.GATHER_AHEAD_BYTES if self.nccl else 0)
        # Where the gathers ahead are launched: after a module's forward (launch_ahead: the host waits
        # for the uploads ahead with the module's kernels queued), or in its pre-hook before them
        # (FERRY_ZERO_AHEAD_AFTER=0).
        self.ahead_after = self.ahead > 0 and os.environ.get("FERRY_ZERO_AHEAD_AFTER", "1") != "0"

    def _gather_group(self, process_group):
        """(group, description) of ZeRO-1's bulk all-gather of the updated params. NCCL (the trainer's
        `process_group`, when its backend for CUDA tensors is NCCL) for CUDA params; otherwise Ferry's
        own gloo group: CPU params, and CUDA params whose process group is gloo (e.g. several ranks
        sharing one GPU, which NCCL refuses): gloo's all_gather takes CUDA tensors and stages them
        through host memory (ProcessGroupGloo's CUDA allgather work), slower than NCCL but correct."""
        if not self.cuda:
            return self.comm.group, "gloo (Ferry's group; CPU tensors)"
        backend = str(dist.get_backend(process_group)).lower()
        if "nccl" in backend:
            return process_group, "nccl (the process group; CUDA tensors)"
        return self.comm.group, ("gloo (Ferry's group; CUDA tensors staged through host memory: the process "
                                 "group's backend is %s, not NCCL)" % backend)

    def _dtensor_ranges(self, p, where):
        group = _shard0_group(p, where)
        if fdist.group_ranks(group) != fdist.group_ranks(self.comm.group):
            raise ValueError("%s is sharded over ranks %s, the optimizer's process group holds ranks %s"
                             % (where, fdist.group_ranks(group), fdist.group_ranks(self.comm.group)))
        rows = p.shape[0]
        row = p.numel() // rows if rows else 0
        c = -(-rows // self.world)
        ranges = [(min(r * c, rows) * row, min((r + 1) * c, rows) * row) for r in range(self.world)]
        loc = local(p)
        b, e = ranges[self.rank]
        if loc.numel() != e - b or (loc.numel() and not loc.is_contiguous()):
            raise ValueError("%s: its local shard on rank %d has shape %s (%s), but dim-0 sharding of %s over %d ranks "
                             "gives rows [%d, %d): Ferry needs torch.chunk's split of dim 0 and contiguous local "
                             "rows" % (where, self.rank, tuple(loc.shape),
                                       "contiguous" if loc.is_contiguous() else "not contiguous", tuple(p.shape),
                                       self.world, b // max(row, 1), e // max(row, 1)))
        return ranges

    # ---- registration --------------------------------------------------------------------------

    def range(self, k):
        return self.table[k][self.rank]

    def local_numel(self, k):
        b, e = self.range(k)
        return e - b

    def grad_buffer(self, k, p):
        """The grad buffer the engine reads: the whole param's (replica), the local rows' (DTensor)."""
        return torch.zeros_like(local(p), memory_format=torch.contiguous_format)

    def register(self, engine, name, group, k, p, buf, dtype_name):
        b, e = self.range(k)
        t = local(p)
        size = t.element_size()
        base = 0 if self.kind[k] == "dtensor" else b  # a DTensor's local tensor starts at its range
        pa = t.data_ptr() + base * size if e > b else 0
        ga = buf.data_ptr() + base * buf.element_size() if e > b else 0
        engine.add_param(name, group, list(p.shape) or [1], dtype_name, pa, ga, shard_begin=b, shard_end=e)
        # The engine writes into t's memory at every step: keep t alive even if its owner (FSDP2)
        # replaces a DTensor's local tensor (the optimizer then refuses to step; see torch.py).
        self.registered.append(t)

    def local_slice(self, k, full):
        """This rank's elements of a full (global) tensor `full`, flattened."""
        b, e = self.range(k)
        return full.reshape(-1)[b:e]

    def grad_of(self, k, g):
        """The local tensor of a grad: local(), a DTensor's local rows."""
        return local(g)

    # ---- after the step: every replica gets every rank's update, unit by unit ---------------------

    @property
    def gathers_pending(self):
        return self.next_unit < len(self.units)

    def begin_gathers(self):
        """At the end of a step: every unit is to be gathered (gather_through or gather_params). Checks
        that the last step's NCCL all-gathers finished (within the timeout: a rank that never arrived
        is named) and counts this step's arrival once for all its units."""
        if self.world == 1 or not self.units:
            return
        self.finish_gathers()
        self.next_unit = 0
        self.last_gather_seconds = 0.0
        if self.nccl:
            if self._side is None:
                self._side = torch.cuda.Stream(device=self.params[self.unit_first(0)].device, priority=-1)
            self._runs, self._waited = [], -1
            # The copies into the params wait for the forward and backward that read them.
            self._side.wait_stream(torch.cuda.current_stream(self._side.device))
            self.comm.check_aborts(fresh=False)
            self._arrival = self.comm.arrive("z")

    def _in_place(self, unit):
        """Whether NCCL gathers `unit` in place: a unit of one param that splits evenly (_plan)."""
        return self.nccl and len(unit["members"]) == 1 and unit["n"] % self.world == 0

    def units_in_place(self):
        return sum(1 for u in self.units if self._in_place(u))

    def unit_first(self, j):
        return self.units[j]["members"][0][0]

    @torch.no_grad()
    def gather_through(self, last, wait_local, ahead=0, wait=True):
        """Gathers units next_unit..last (in order: the same collectives on every rank), and after
        `last` the units of up to `ahead` bytes (gather_ahead). Returns the units gathered (a range).
        wait_local(ks, stream): makes `stream` (a raw CUDA stream handle, 0 on the host) wait until
        this rank's ranges of params ks hold the step's values. Under NCCL the current stream then
        waits for the gathers of units up to `last` (none where wait=False), not for those ahead."""
        first = self.next_unit
        through = plan.gather_ahead(self.unit_sizes, last, ahead) if ahead else last
        start = time.perf_counter()
        try:
            if not self.nccl:  # gloo: on the current stream, each waited for on the host
                while self.next_unit <= through:
                    j = self.next_unit
                    self._gather_unit_gloo(j, wait_local)
                    self.next_unit = j + 1
                return range(first, self.next_unit)
            # NCCL: every unit on the side stream (one stream switch for the call), an event after
            # each run of them; the current stream waits for the run holding `last`.
            if through >= first:
                with torch.cuda.stream(self._side):
                    runs = plan.coalesced_runs(self.unit_sizes, first, through, self.coalesce) if self.coalesce \
                        else [(j, j) for j in range(first, through + 1)]
                    for j, end in runs:
                        # Runs of units of about coalesce bytes: a run's gathers wait for all its
                        # uploads, the next run's uploads land meanwhile.
                        if self.coalesce:
                            self._gather_units_coalesced(j, end, wait_local)
                        else:
                            self._gather_unit_nccl(j, wait_local)
                        self.next_unit = end + 1
                        done = torch.cuda.Event()
                        done.record(self._side)
                        self._runs.append((end, done))
            if wait:
                self.wait_gathered(last)
            return range(first, self.next_unit)
        finally:
            self.last_gather_seconds += time.perf_counter() - start

    def wait_gathered(self, last):
        """NCCL: the current stream waits for the gathers of units up to `last` (launched already)."""
        if last <= self._waited:
            return
        for end, done in self._runs:
            if end >= last:
                torch.cuda.current_stream(self._side.device).wait_event(done)
                self._waited = end
                return

    def launch_ahead(self, last, wait_local):
        """After the forward of a module whose units end at `last`: where the units launched reach
        less than half of `ahead` bytes past it, launches the gathers through `ahead` bytes past it
        (launch_through). The host waits here for this rank's uploads of those units while the GPU
        runs the forward queued so far; under NCCL the current stream does not wait for them (the
        pre-hooks of their modules do; gloo's gathers are waited for on the host). Returns the units
        gathered (a range)."""
        if plan.launch_through(self.unit_sizes, self.next_unit, last, self.ahead) is None:
            return range(0)
        return self.gather_through(last, wait_local, self.ahead, wait=False)

    def gather_rest(self, wait_local):
        return self.gather_through(len(self.units) - 1, wait_local)

    def members(self, units):
        """The params (k) of gather units `units`."""
        return [k for j in units for k, _ in self.units[j]["members"]]

    def _plan(self, j):
        """Unit j's gather, worked out at its first gather: this rank's params in it, and where each
        member's elements go. A unit of one param that splits evenly is gathered in place under NCCL
        (each rank's piece is its own range of the param, which the engine updates in place); any other
        unit through a flat buffer, its members copied in and out."""
        unit = self.units[j]
        unit["ks"] = [k for k, _ in unit["members"] if self.local_numel(k)]
        device = self.params[self.unit_first(j)].device
        if self._in_place(unit):
            unit["flat"] = self.params[self.unit_first(j)].data.view(-1)
            unit["send"] = unit["flat"].narrow(0, self.rank * unit["piece"], unit["piece"])
            unit["copy_in"] = unit["copy_out"] = ()
            return unit
        with torch.cuda.stream(self._side) if self.nccl else _nothing():
            flat = unit["flat"] = torch.empty(unit["piece"] * self.world, dtype=unit["dtype"], device=device)
            send = unit["send"] = torch.empty(unit["piece"], dtype=unit["dtype"], device=device)
        lo = self.rank * unit["piece"]
        copy_in, copy_out = [], []
        for k, off in unit["members"]:
            b, e = self.range(k)
            # Through .data, as the engine's own uploads write: no version bump that autograd would
            # take for a change of a tensor a forward saved (a param read outside its module's forward).
            whole = self.params[k].data.view(-1)
            if e > b:
                copy_in.append((send[off + b - lo:off + e - lo], whole[b:e]))
            copy_out.append((whole, flat[off:off + whole.numel()]))
        unit["copy_in"], unit["copy_out"] = tuple(copy_in), tuple(copy_out)
        return unit

    def _what(self, j):
        unit = self.units[j]
        return "ZeRO-1 all-gather of unit %d of %d (%d %s params)" % (j, len(self.units), unit["n"], unit["dtype"])

    def _gather_unit_gloo(self, j, wait_local):
        unit = self.units[j] if "ks" in self.units[j] else self._plan(j)
        wait_local(unit["ks"], torch.cuda.current_stream(unit["flat"].device).cuda_stream if self.cuda else 0)
        _copy_pairs(unit["copy_in"])
        self._all_gather_flat(unit["flat"], unit["send"], unit["piece"], self._what(j))
        _copy_pairs(unit["copy_out"])

    def _gather_unit_nccl(self, j, wait_local):
        """Unit j on the side stream (current): after this rank's uploads of its params, copies in,
        NCCL's all-gather (the stream waits for it, the host does not), copies out."""
        unit = self.units[j] if "ks" in self.units[j] else self._plan(j)
        wait_local(unit["ks"], self._side.cuda_stream)
        _copy_pairs(unit["copy_in"])
        work = self._all_gather_into(unit["flat"], unit["send"], group=self.gather_group, async_op=True)
        work.wait()  # NCCL: the stream waits; the host does not
        self._works.append((j, work))
        _copy_pairs(unit["copy_out"])

    def _gather_units_coalesced(self, first, last, wait_local):
        """Units first..last on the side stream (current) as one NCCL group: after this rank's uploads
        of all their params, every copy in, the all-gathers launched together (one grouped NCCL
        call), then every copy out."""
        units = [self.units[j] if "ks" in self.units[j] else self._plan(j) for j in range(first, last + 1)]
        wait_local([k for unit in units for k in unit["ks"]], self._side.cuda_stream)
        _copy_pairs([pair for unit in units for pair in unit["copy_in"]])
        with dist._coalescing_manager(group=self.gather_group, async_ops=True) as cm:
            for unit in units:
                self._all_gather_into(unit["flat"], unit["send"], group=self.gather_group, async_op=True)
        cm.wait()  # NCCL: the stream waits; the host does not
        self._works.extend((first, work) for work in cm.works)
        _copy_pairs([pair for unit in units for pair in unit["copy_out"]])

    def finish_gathers(self):
        """Waits on the host (within the timeout, naming a rank that never arrived) for the NCCL
        all-gathers launched so far: at the next step, when they have long finished."""
        works, self._works = self._works, []
        if works:
            self.comm.finish("ZeRO-1 all-gathers of the last step (%s, ...)" % self._what(works[0][0]),
                             [w for _, w in works], self._arrival, self.timeout_s, channel="z")

    @torch.no_grad()
    def gather_params(self, wait_local=None):
        """Every unit, now (after a load_checkpoint or load_state_dict: each rank loaded its range)."""
        if self.world == 1 or not self.units:
            return
        if self.gathers_pending and wait_local is None:  # a step's gathers wait for its uploads
            raise RuntimeError("internal: gather_params() without wait_local while a step's gathers are pending")
        if not self.gathers_pending:
            self.begin_gathers()
        self.gather_rest(wait_local or (lambda ks, stream: None))
        self.finish_gathers()

    def _all_gather_flat(self, flat, send, piece, what):
        """gloo's all-gather, waited for on the host."""
        group = self.gather_group
        if flat.dtype in (torch.bfloat16, torch.float16):  # gloo (torch 1.13) has no bf16: move the bytes
            piece *= flat.element_size()
            flat, send = flat.view(torch.uint8), send.view(torch.uint8)
        outs = list(flat.split(piece))
        self.comm.run(what, lambda: dist.all_gather(outs, send, group=group, async_op=True), self.timeout_s)

    # ---- state_dict: the whole state on every rank ------------------------------------------------

    def gather_state(self, read_local):
        """{k: full fp32 tensor of the param's shape} for `read_local(k)` (this rank's range of the
        state as a flat fp32 CPU tensor). Collective (gloo, CPU)."""
        sizes = [sum(self.table[k][r][1] - self.table[k][r][0] for k in range(len(self.params)))
                 for r in range(self.world)]
        longest = max(sizes)
        send = torch.zeros(longest, dtype=torch.float32)
        at = 0
        for k in range(len(self.params)):
            n = self.local_numel(k)
            if n:
                send[at:at + n].copy_(read_local(k))
                at += n
        out = torch.empty(longest * self.world, dtype=torch.float32)
        outs = list(out.split(longest)) if longest else [torch.empty(0) for _ in range(self.world)]
        if longest:
            self.comm.run("state_dict all-gather of %d fp32 values per rank" % longest,
                          lambda: dist.all_gather(outs, send, group=self.comm.group, async_op=True), self.timeout_s)
        full = {}
        cursor = [0] * self.world
        for k, p in enumerate(self.params):
            parts = []
            for r in range(self.world):
                b, e = self.table[k][r]
                parts.append(outs[r][cursor[r]:cursor[r] + e - b])
                cursor[r] += e - b
            full[k] = torch.cat(parts).reshape(p.shape).clone()
        return full

    def abort(self, exc):
        self.comm.abort("%s: %s" % (type(exc).__name__, exc))


class ShardedStepMixin:
    """ferry.torch.Optimizer's step on several ranks: the engine's step, then ZeRO-1's gathers (now,
    or with attach() in the next forward). Uses the optimizer's _zero, _step(), _waits, _engine,
    _engine_lock, _names, _params and wait_params()."""

    def _step_ranks(self, closure, loss_scale, max_grad_norm, check_finite):
        if self._zero is None:
            return self._step(closure, loss_scale, max_grad_norm, check_finite)
        try:
            loss = self._step(closure, loss_scale, max_grad_norm, check_finite)
            if self._gathering():
                # ZeRO-1: every rank's updated range into every replica, unit by unit as the uploads
                # land; with attach(), in the next forward (ferry/_zero.py).
                self._zero.begin_gathers()
                if not self._left_to_forward:  # else the next forward's hooks gather
                    self._wait_params()
            return loss
        except BaseException as e:
            self._zero.abort(e)
            raise

    def _gathering(self):
        """ZeRO-1 over several ranks: the step's params are gathered after it (ferry/_zero.py)."""
        return self._zero is not None and self._zero.world > 1 and bool(self._zero.units)

    def _wait_local(self, ks, stream):
        """Sharding's wait_local: `stream` waits for this rank's ranges of params ks (the last step's)."""
        if ks:
            with _buckets.annotate("ferry.wait_params"):
                self._engine.wait_params_of([self._names[k] for k in ks], stream=stream)

    def _gather_through(self, ks, ahead=False, launch=False):
        """ZeRO-1 after a deferred step: the gather units up to the last one holding a param of ks
        (ahead: and the units of z.ahead bytes after it, from a forward pre-hook). The current stream
        waits for the gathers, so it waits for the buckets of their params here too, at once: the
        later modules' pre-hooks find them done. launch: from a module's forward post-hook, only the
        gathers ahead of ks (Sharding.launch_ahead), which the current stream does not wait for."""
        z = self._zero
        units = [z.unit_of[k] for k in ks if z.unit_of[k] is not None]
        if units:
            with self._engine_lock, _buckets.annotate("ferry.gather_ahead" if launch else "ferry.gather"):
                try:
                    if launch:
                        z.launch_ahead(max(units), self._wait_local)
                        return
                    done = z.gather_through(max(units), self._wait_local, z.ahead if ahead else 0)
                except BaseException as e:
                    z.abort(e)
                    raise
                if done and self._pending:
                    self._wait_units_locked({self._unit_of[k] for k in z.members(done)})
