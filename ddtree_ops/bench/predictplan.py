"""A predicted sweep's plan (issue 43): what ``bench --predict`` runs per host instead of
measuring every DDTree cell. Pure: no I/O, no clock.

Per host, on the sweep's live DDTree launch (its runtime states, plus one state as big as
the grid's union where that is larger than the largest budget, up to the bundle's 256): a
round-time probe per (verify path, concurrency, budget) of the grid -- greedy and sampled
rounds cost differently (:attr:`PredictPlan.probe_samplings`) --, then one trace run per sampling
setting and *trace group* -- a set of the grid's trees whose union fits the launch's
largest runtime state (the bundle verifies a traced round's union in the smallest state
that holds it: a grid of 256-node trees at three top-ks unites to more than the 256 the
bundle serves, so it is traced in three runs, one per top-k, each union at most 256).
Every DDTree cell is then predicted, and only the ``top`` fastest predicted cells per
(sampling, concurrency) are measured as today, with the baselines: the DDTree cells on the
same launch, left running (each of its budgets is a runtime state there, so they are
switched to live as ever), so a host loads the DDTree model once.

On a host with several GPU slots every slot launches that launch once, and the phase's
work items -- each probe and each trace run, a trace run in parts of its prompts where the
slots outnumber the trace runs -- are split over them (:func:`split_work`: longest first,
each to the least loaded slot, by expected seconds); the predictions need every slot's
results, and each slot's server then measures that slot's share of the chosen cells.
:func:`predict_estimate` is the wall time of that plan, which ``--dry-run`` shows against
the full grid's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ddtree_ops.bench.plan import (
    STEP_S,
    SWITCH_S,
    TRACE_STEP_FACTOR,
    Cell,
    LaunchConfig,
    Sampling,
    ServerConfig,
    StepTimes,
    SweepPlan,
    cell_seconds,
    run_seconds,
    step_at,
)
from ddtree_ops.bench.schedule import Slot, make_jobs, schedule
from ddtree_ops.bench.sweep import PredictSpec, SweepSpec
from ddtree_ops.limits import MAX_DDTREE_BUDGET
from ddtree_ops.predict.decide import repeats_floor
from ddtree_ops.predict.trace import union_bound

Tree = tuple[int, int]
# A trace round commits at least one token: a request of M tokens needs at most M rounds.
_MAX_TRACE_ROUNDS = 4096


@dataclass(frozen=True)
class ProbeRun:
    """One round-time probe: :meth:`PredictPlan.probe_waves` waves of
    :attr:`PredictPlan.probe_tokens` at (concurrency, budget), sampled as ``sampling`` (one
    of :attr:`PredictPlan.probe_samplings`)."""

    concurrency: int
    budget: int
    sampling: Sampling


@dataclass(frozen=True)
class TraceRun:
    """One trace run: the whole workload once at ``sampling``, tracing the trees of
    ``trace_groups[group]``; or, split over GPU slots (:func:`split_work`), its ``shard``-th
    of ``shards`` parts: the workload's prompts ``shard::shards`` (requests are walked one
    by one, so the parts' traces together are the whole run's)."""

    sampling: Sampling
    group: int
    shard: int = 0
    shards: int = 1

    def prompts(self, num_prompts: int) -> range:
        """Which of the workload's prompts this run (or part) sends, by index."""
        return range(self.shard, num_prompts, self.shards)

    @property
    def whole(self) -> TraceRun:
        return TraceRun(self.sampling, self.group)


WorkItem = ProbeRun | TraceRun


@dataclass(frozen=True)
class PredictPlan:
    """What one host runs before measuring: probes, trace runs, then the chosen cells."""

    spec: PredictSpec
    launch: LaunchConfig
    trees: tuple[Tree, ...]
    samplings: tuple[Sampling, ...]
    concurrencies: tuple[int, ...]
    trace_groups: tuple[tuple[Tree, ...], ...]
    block: int
    # The workload's prompts and tokens a request (0: not known, nothing capped by them).
    num_prompts: int = 0
    max_new_tokens: int = 0
    # The sweep's warmup requests, sent on each place's server before its first probe, as
    # before a cell: without them that probe, the first load on a freshly launched server,
    # measured its rounds 8-16 % slower than the next budget's (the real CPU server, two
    # runs), which made the smallest tree look as slow as the largest. Once a launch: the
    # later probes, on the same warm server, showed no such step.
    warmup: int = 0

    def probe_waves(self, concurrency: int) -> int:
        """Waves of a probe at ``concurrency``: ``probe_waves``, but never more requests than
        a cell at that concurrency sends (the workload's prompts; one wave at least). A probe
        stands in for measuring cells, so it must cost less than one: at concurrency 16 with
        16 prompts, four waves of 32 tokens were 64 requests, 1.3 times the rounds of the
        cell they stood for (96 tokens, one wave); one wave is a third of it."""
        waves = self.spec.probe_waves
        if self.num_prompts:
            waves = min(waves, -(-self.num_prompts // concurrency))
        return max(1, waves)

    @property
    def probe_tokens(self) -> int:
        """Tokens a probe's request: ``probe_tokens``, at most the workload's."""
        tokens = self.spec.probe_tokens
        return max(2, min(tokens, self.max_new_tokens)) if self.max_new_tokens else tokens

    @property
    def probe_samplings(self) -> tuple[Sampling, ...]:
        """The samplings the probes run at: one per verify path of the grid's samplings
        (:attr:`~.plan.Sampling.verify_path`), the first of the grid's on that path. A
        sampled round costs more than a greedy one (target probabilities, the rejection
        walk), and more so the wider the verify: on the CPU server sampled rounds took 15 %
        longer than greedy ones at budget 2 and 22-25 % at budgets 12-16, so T = 0 probes
        alone over-predict the sampled cells, the big trees most."""
        paths: dict[str, Sampling] = {}
        for s in self.samplings:
            paths.setdefault(s.verify_path, s)
        return tuple(paths.values())

    @property
    def probes(self) -> tuple[ProbeRun, ...]:
        """Every round-time probe: per probe sampling, concurrency and budget (at the
        launch's largest top-k)."""
        budgets = sorted({b for b, _ in self.trees})
        return tuple(ProbeRun(c, b, s) for s in self.probe_samplings for c in self.concurrencies for b in budgets)

    @property
    def probe_topk(self) -> int:
        assert self.launch.topk_max is not None
        return self.launch.topk_max

    @property
    def trace_concurrency(self) -> int:
        """Trace runs go at ``predict.trace_concurrency``, else the grid's largest
        concurrency (acceptance does not depend on it)."""
        return self.spec.trace_concurrency or max(self.concurrencies)

    def max_rounds(self, max_new_tokens: int) -> int:
        return min(_MAX_TRACE_ROUNDS, max_new_tokens)

    @property
    def work(self) -> tuple[WorkItem, ...]:
        """The predict phase's work items: every probe, then every trace run (by sampling,
        then trace group)."""
        traces = tuple(TraceRun(s, g) for s in self.samplings for g in range(len(self.trace_groups)))
        return self.probes + traces

    @property
    def measured_cells(self) -> int:
        """DDTree cells measured per host (at most): ``top`` per (sampling, concurrency)."""
        return min(self.spec.top, len(self.trees)) * len(self.samplings) * len(self.concurrencies)


def trace_groups(trees: tuple[Tree, ...], block: int, largest_state: int) -> tuple[tuple[Tree, ...], ...]:
    """The grid's trees in as few trace runs as fit: top-ks joined, smallest first, while
    their union fits ``largest_state`` (one top-k's trees always fit: their union is the
    tree of its largest budget)."""
    by_k: dict[int, list[Tree]] = {}
    for tree in trees:
        by_k.setdefault(tree[1], []).append(tree)
    groups: list[list[Tree]] = []
    for k in sorted(by_k):
        if groups and union_bound(groups[-1] + by_k[k], block) <= largest_state:
            groups[-1].extend(by_k[k])
        else:
            groups.append(list(by_k[k]))
    return tuple(tuple(sorted(g)) for g in groups)


def plan_predict(spec: SweepSpec, plan: SweepPlan, *, block: int | None = None) -> PredictPlan | None:
    """The predicted plan of ``plan`` (the sweep's, ``relaunch: never``), or None without
    DDTree cells on a live launch. ``block``: the draft block (default the sweep's
    ``dflash_block``; the run re-plans with what the server reports)."""
    cells = [c for c in plan.cells if c.server.algorithm == "ddtree" and c.switched]
    if not cells:
        return None
    launch = cells[0].launch
    trees = tuple(sorted({(c.server.budget or 0, c.server.topk or 0) for c in cells}))
    samplings = tuple(sorted({c.sampling for c in cells}, key=lambda s: (s.temperature, s.top_p, s.top_k)))
    concurrencies = tuple(sorted({c.concurrency for c in cells}))
    block = block or spec.dflash_block
    # One more runtime state, for the trace runs only, where the grid's union outgrows the
    # largest budget: the whole grid in one trace run per sampling where it fits the bundle.
    state = min(MAX_DDTREE_BUDGET, union_bound(trees, block))
    if state > max(launch.budgets):
        launch = dataclasses.replace(launch, budgets=tuple(sorted({*launch.budgets, state})))
    groups = trace_groups(trees, block, max(launch.budgets))
    return PredictPlan(spec.predict or PredictSpec(), launch, trees, samplings, concurrencies, groups, block,
                       num_prompts=spec.workload.num_prompts, max_new_tokens=spec.workload.max_new_tokens,
                       warmup=spec.warmup)


def work_seconds(pplan: PredictPlan, item: WorkItem, *, num_prompts: int, max_new_tokens: int,
                 s_per_step: float | StepTimes = STEP_S, trace_s_per_step: float | None = None) -> float:
    """Expected seconds of one work item: a probe is a switch and its waves
    (:meth:`PredictPlan.probe_waves`) of :attr:`PredictPlan.probe_tokens` steps; a trace
    run is its prompts (the workload's, or its part's) once at the trace concurrency,
    charged ``trace_s_per_step`` a step (a traced request runs one round per token; None:
    :data:`~.plan.TRACE_STEP_FACTOR` x the step of the grid's slowest tree at the trace
    concurrency), with the switches turning the trace
    on and off."""
    if isinstance(item, ProbeRun):
        # A probe's rounds are its budget's tree at the launch's largest top-k.
        step = step_at(s_per_step, item.concurrency, ServerConfig("ddtree", item.budget, pplan.probe_topk).key)
        return SWITCH_S + pplan.probe_waves(item.concurrency) * pplan.probe_tokens * step
    trace_cell = Cell(ServerConfig("ddtree"), Sampling(), pplan.trace_concurrency)
    per_step = trace_s_per_step
    if per_step is None:
        # A traced round verifies the union, at least the grid's biggest tree, and commits one
        # token: charged against the slowest of the grid's trees there.
        per_step = TRACE_STEP_FACTOR * max(step_at(s_per_step, pplan.trace_concurrency,
                                                   ServerConfig("ddtree", b, k).key) for b, k in pplan.trees)
    return 2 * SWITCH_S + cell_seconds(trace_cell, num_prompts=len(item.prompts(num_prompts)),
                                       max_new_tokens=max_new_tokens, warmup=0, s_per_step=per_step)


def sharded_work(pplan: PredictPlan, shards: int) -> tuple[WorkItem, ...]:
    """:attr:`PredictPlan.work` with each trace run cut into ``shards`` parts of its prompts."""
    out: list[WorkItem] = []
    for item in pplan.work:
        if isinstance(item, TraceRun):
            out.extend(TraceRun(item.sampling, item.group, i, shards) for i in range(shards))
        else:
            out.append(item)
    return tuple(out)


def split_work(pplan: PredictPlan, slots: int, *, num_prompts: int, max_new_tokens: int,
               s_per_step: float | StepTimes = STEP_S,
               trace_s_per_step: float | None = None) -> tuple[tuple[WorkItem, ...], ...]:
    """:attr:`PredictPlan.work` over ``slots`` GPU slots: one share per slot, in slot order,
    each item (longest expected first) to the share that is shortest so far, a share's
    items in the plan's order (probes, then trace runs); empty shares last. Where slots
    outnumber the trace runs, each trace run is cut into parts of its prompts
    (:func:`sharded_work`; none with fewer prompts than the trace concurrency keeps in
    flight) so that a grid traced in one or two runs does not leave the other slots idle --
    as many parts as shorten the longest share most (each part pays its own switches).
    Pure: every slot of a run, and the dry run, cut the same way."""

    def seconds(item: WorkItem) -> float:
        return work_seconds(pplan, item, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                            s_per_step=s_per_step, trace_s_per_step=trace_s_per_step)

    slots = max(1, slots)
    runs = sum(1 for item in pplan.work if isinstance(item, TraceRun))
    most = max(1, min(slots // max(1, runs), num_prompts // pplan.trace_concurrency))
    best: tuple[float, list[list[WorkItem]]] | None = None
    for shards in range(1, most + 1):
        shares = _longest_first(sharded_work(pplan, shards), seconds, slots)
        longest = max(sum(seconds(item) for item in share) for share in shares)
        if best is None or longest < best[0]:
            best = (longest, shares)
    assert best is not None
    # Every item costs a switch at least, so the shares fill in slot order: empty ones last.
    return tuple(tuple(share) for share in best[1])


def _longest_first(items: Sequence[WorkItem], seconds: Callable[[WorkItem], float],
                   slots: int) -> list[list[WorkItem]]:
    """LPT: each item, longest first (ties in plan order), to the least loaded share (ties
    to the first); each share in plan order."""
    loads, picked = [0.0] * slots, [list[int]() for _ in range(slots)]
    for i in sorted(range(len(items)), key=lambda i: -seconds(items[i])):
        share = min(range(slots), key=lambda s: loads[s])
        picked[share].append(i)
        loads[share] += seconds(items[i])
    return [[items[i] for i in sorted(share)] for share in picked]


def predict_phase_estimate(pplan: PredictPlan, *, load_s: float | Sequence[float], num_prompts: int,
                           max_new_tokens: int, s_per_step: float | StepTimes = STEP_S,
                           trace_s_per_step: float | None = None) -> float:
    """Rough wall time of the predict phase on one host. ``load_s``: what a launch costs on
    each of its server places (its GPU slots; a bare figure: one server). Every place
    launches the predict launch (in parallel) and runs its share of the probes and trace
    runs (:func:`split_work`); the phase ends with its slowest place (the predictions need
    every result)."""
    loads = _loads(load_s)
    shares = split_work(pplan, len(loads), num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                        s_per_step=s_per_step, trace_s_per_step=trace_s_per_step)
    return max(
        load + warmup_seconds(pplan, share, s_per_step=s_per_step)
        + sum(work_seconds(pplan, item, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                           s_per_step=s_per_step, trace_s_per_step=trace_s_per_step) for item in share)
        for load, share in zip(loads, shares, strict=True)
    )


def first_probe(share: Sequence[WorkItem]) -> ProbeRun | None:
    """The probe of a place's share that its warmup goes before (:attr:`PredictPlan.warmup`)."""
    return next((item for item in share if isinstance(item, ProbeRun)), None)


def probe_warmup(pplan: PredictPlan, share: Sequence[WorkItem], probe: ProbeRun) -> int:
    """Warmup requests before ``probe``: the sweep's before the share's first probe (the
    first load on the place's fresh server), none before the others."""
    return pplan.warmup if probe == first_probe(share) else 0


def warmup_seconds(pplan: PredictPlan, share: Sequence[WorkItem], *, s_per_step: float | StepTimes = STEP_S) -> float:
    """The warmup before a share's first probe: one more wave of its tokens, as a cell's
    warmup is charged (:func:`~.plan.cell_steps`); none without a probe or a warmup."""
    probe = first_probe(share)
    if probe is None or not probe_warmup(pplan, share, probe):
        return 0.0
    return pplan.probe_tokens * step_at(s_per_step, probe.concurrency,
                                        ServerConfig("ddtree", probe.budget, pplan.probe_topk).key)


def predict_estimate(pplan: PredictPlan, plan: SweepPlan, *, load_s: float | Sequence[float], num_prompts: int,
                     max_new_tokens: int, s_per_step: float | StepTimes = STEP_S,
                     trace_s_per_step: float | None = None) -> float:
    """Rough wall time of the predicted plan on one host (``load_s`` as for
    :func:`predict_phase_estimate`): the predict phase, then the measuring, scheduled as
    the full grid's is with slots (:func:`~.schedule.schedule`, so the two figures
    compare): the baselines' launches and their cells, every repeat, and at most ``top``
    DDTree cells per sampling and concurrency, each measured the least repeats the measured
    phase takes (:func:`~ddtree_ops.predict.decide.repeats_floor`: a group not decided by
    then costs more passes, up to the cap), on the predict launch that every place still
    serves (no load of their own)."""
    loads = _loads(load_s)
    predict_s = predict_phase_estimate(pplan, load_s=loads, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                                       s_per_step=s_per_step, trace_s_per_step=trace_s_per_step)
    # The chosen trees are not known before the phase: any DDTree cell costs the same.
    ddtree = [Cell(ServerConfig("ddtree", b, k), s, c, via=pplan.launch) for s in pplan.samplings
              for c in pplan.concurrencies for b, k in pplan.trees[:min(pplan.spec.top, len(pplan.trees))]]
    runs = [(cell, r) for cell in plan.cells if cell.baseline for r in range(plan.repeats)]
    runs += [(cell, r) for cell in ddtree for r in range(repeats_floor(plan.repeats))]

    def cell_s(cell: Cell) -> float:
        return run_seconds(cell, num_prompts=num_prompts, max_new_tokens=max_new_tokens, warmup=plan.warmup,
                           s_per_step=s_per_step)

    places = [Slot("", i) for i in range(len(loads))]
    jobs = make_jobs(runs, cell_s=cell_s, load_s=min(loads), slots=len(places), running=pplan.launch)
    measured = schedule(jobs, places, load_s=dict(zip(places, loads, strict=True)),
                        running=dict.fromkeys(places, pplan.launch))
    return predict_s + measured.wall_s


def _loads(load_s: float | Sequence[float]) -> tuple[float, ...]:
    return (float(load_s),) if isinstance(load_s, int | float) else tuple(load_s)


def probe_requests(concurrency: int, waves: int) -> int:
    return max(1, concurrency * waves)


__all__ = [
    "PredictPlan", "ProbeRun", "TraceRun", "WorkItem", "first_probe", "plan_predict", "predict_estimate",
    "predict_phase_estimate", "probe_requests", "probe_warmup", "sharded_work", "split_work", "trace_groups",
    "warmup_seconds", "work_seconds",
]
