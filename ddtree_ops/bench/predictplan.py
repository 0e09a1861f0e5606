"""A predicted sweep's plan (issue 43): what ``bench --predict`` runs per host instead of
measuring every DDTree cell. Pure: no I/O, no clock.

Per host, on the sweep's live DDTree launch (its runtime states, plus one state as big as
the grid's union where that is larger than the largest budget, up to the bundle's 256): a
round-time probe per (concurrency, budget) of the grid, then one trace run per sampling
setting and *trace group* -- a set of the grid's trees whose union fits the launch's
largest runtime state (the bundle verifies a traced round's union in the smallest state
that holds it: a grid of 256-node trees at three top-ks unites to more than the 256 the
bundle serves, so it is traced in three runs, one per top-k, each union at most 256).
Every DDTree cell is then predicted, and only the ``top`` fastest predicted cells per
(sampling, concurrency) are measured as today, with the baselines: the DDTree cells on the
same launch, left running (each of its budgets is a runtime state there, so they are
switched to live as ever), so a host loads the DDTree model once.
:func:`predict_estimate` is the GPU time of that plan, which ``--dry-run`` shows against
the full grid's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ddtree_ops.bench.plan import SWITCH_S, Cell, LaunchConfig, Sampling, SweepPlan, cell_seconds
from ddtree_ops.bench.sweep import PredictSpec, SweepSpec
from ddtree_ops.limits import MAX_DDTREE_BUDGET
from ddtree_ops.predict.trace import union_bound

Tree = tuple[int, int]
# A trace round commits at least one token: a request of M tokens needs at most M rounds.
_MAX_TRACE_ROUNDS = 4096


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

    @property
    def probes(self) -> tuple[tuple[int, int], ...]:
        """(concurrency, budget) of every round-time probe (at the launch's largest top-k)."""
        budgets = sorted({b for b, _ in self.trees})
        return tuple((c, b) for c in self.concurrencies for b in budgets)

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
    return PredictPlan(spec.predict or PredictSpec(), launch, trees, samplings, concurrencies, groups, block)


def predict_estimate(pplan: PredictPlan, plan: SweepPlan, *, load_s: float, num_prompts: int, max_new_tokens: int,
                     s_per_step: float = 0.02) -> float:
    """Rough wall time of the predicted plan on one host with one server: the predict
    phase's launch, its probes (a switch and ``probe_waves`` waves of ``probe_tokens`` steps
    each) and trace runs (the whole workload once per sampling and trace group, at the
    trace concurrency), then the measured part: the baselines' launches and their cells,
    and at most ``top`` DDTree cells per sampling and concurrency, every repeat, on the
    predict phase's launch (no load of their own: it is left running for them)."""
    spec = pplan.spec
    total = load_s
    total += len(pplan.probes) * (SWITCH_S + spec.probe_waves * spec.probe_tokens * s_per_step)
    trace_cell = Cell(plan.cells[0].server, Sampling(), pplan.trace_concurrency)
    per_trace = cell_seconds(trace_cell, num_prompts=num_prompts, max_new_tokens=max_new_tokens, warmup=0,
                             s_per_step=s_per_step)
    total += len(pplan.trace_groups) * len(pplan.samplings) * (2 * SWITCH_S + per_trace)
    baselines = [c for c in plan.cells if c.baseline]
    total += len({c.launch for c in baselines}) * load_s
    measured = list(baselines)
    per_group = min(spec.top, len(pplan.trees))
    measured += [Cell(plan.cells[-1].server, s, c) for s in pplan.samplings for c in pplan.concurrencies
                 for _ in range(per_group)]
    for cell in measured:
        total += plan.repeats * cell_seconds(cell, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                                             warmup=plan.warmup, s_per_step=s_per_step)
    total += plan.repeats * per_group * len(pplan.samplings) * len(pplan.concurrencies) * SWITCH_S
    return total


def probe_requests(concurrency: int, waves: int) -> int:
    return max(1, concurrency * waves)


__all__ = ["PredictPlan", "plan_predict", "predict_estimate", "probe_requests", "trace_groups"]
