"""Sweep spec -> ordered cells, grouped into server launches by what cannot be switched.

Pure: no I/O, no clock. A *cell* is one server configuration (algorithm, budget, top-k)
with one sampling setting and one concurrency. Temperature, top-p/top-k and concurrency
are request parameters and run on the live server. A DDTree server launched with runtime
states (``--speculative-adaptive-config``, the issue-25 contract) also switches its tree
(budget, top-k) live through ``/set_internal_state``, so with ``relaunch: never`` (the
default) every DDTree cell of a host shares ONE launch (:class:`LaunchConfig`: the
algorithm and the set of budgets, which are fixed at launch, with the largest top-k it
must serve) and only the algorithm, model and server flags need a launch of their own;
``relaunch: always`` keeps the old one launch per (budget, top-k) for comparison. The
model and the server flags are the host's, the same for every cell of a sweep there.

Groups are ordered to launch as rarely as possible (the launch already running on a
host goes first); within a live launch, cells go by tree, so a switch happens only where
the tree changes. Baselines run on every host with the same sampling grid and workload
as the DDTree cells, so every DDTree row has a comparable baseline row; DFlash runs one
chain per verify width the DDTree cells use (:func:`dflash_width`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ddtree_ops.bench.sweep import GRID_DEFAULTS, RELAUNCH_MODES, SweepSpec

_ALGO_ORDER = {"autoregressive": 0, "dflash": 1, "ddtree": 2}
# What one live switch costs a sweep between two cells, for the estimate only: the
# /set_internal_state request and the /server_info readback that proves it took (two
# requests, on the host over its transport: well under a second).
SWITCH_S = 0.5
# What one decode step of a run is charged where no sweep measured the host before (the
# state file's learned step time replaces it: ``StateStore.learned_step_s``).
STEP_S = 0.02
# A predicted sweep's trace run per step, over the step of the grid's slowest tree at the
# trace concurrency, where no trace run was timed on the host before
# (``StateStore.learned_step_s(trace=True)`` replaces it): a traced request commits one token
# a round where a DDTree run commits its acceptance (1.6 for a budget-96 chain), and verifies
# the grid's union (wider than its biggest tree). A guess: 3.2x on both simulated hosts of
# benchmarks/predict_plan.py (a union of 207 nodes at concurrency 16).
TRACE_STEP_FACTOR = 3.0


@dataclass(frozen=True, order=True)
class ServerConfig:
    """What the server is launched with.

    ``budget``: DDTree's node budget (its verify window is the root plus ``budget``); for
    DFlash, its draft tokens (``--speculative-num-draft-tokens``, the verify window
    itself), None for the drafter's own block; None for autoregressive. ``topk``: DDTree only.
    """

    algorithm: str
    budget: int | None = None
    topk: int | None = None

    @property
    def key(self) -> str:
        # The sweep's own names: ``topk`` is the tree's, ``top_k`` (Sampling.key) the sampler's.
        if self.algorithm == "ddtree":
            return f"ddtree-b{self.budget}-topk{self.topk}"
        if self.algorithm == "dflash" and self.budget is not None:
            return f"dflash-n{self.budget}"
        return self.algorithm

    def sort_key(self) -> tuple[int, int, int]:
        return (_ALGO_ORDER[self.algorithm], self.budget or 0, self.topk or 0)


@dataclass(frozen=True)
class LaunchConfig:
    """What one server launch is started with: the part of a cell that cannot change on
    a running server.

    ``budget``/``topk`` are the launch state (the tree the server starts at). A live
    launch (``budgets`` non-empty, DDTREE only) also holds the runtime-state set: one
    state per budget, any top-k up to ``topk_max``; its cells switch to their own tree.
    """

    algorithm: str
    budget: int | None = None
    topk: int | None = None
    budgets: tuple[int, ...] = ()
    topk_max: int | None = None

    @classmethod
    def fresh(cls, server: ServerConfig) -> LaunchConfig:
        """A launch at ``server``'s own tree, nothing switchable (``relaunch: always``)."""
        return cls(server.algorithm, server.budget, server.topk)

    @property
    def live(self) -> bool:
        """Whether its cells switch the tree live (the launch holds runtime states)."""
        return bool(self.budgets)

    @property
    def server(self) -> ServerConfig:
        """The launch state as a server configuration (what the launch command says)."""
        return ServerConfig(self.algorithm, self.budget, self.topk)

    @property
    def key(self) -> str:
        if not self.live:
            return self.server.key
        # Commas, not dots: "b4.8.16" read as a budget of 4.8.
        return f"ddtree-states-b{','.join(map(str, self.budgets))}-topk{self.topk_max}"

    def serves(self, server: ServerConfig) -> bool:
        """Whether a cell of ``server`` can be measured on this launch."""
        if not self.live:
            return server == self.server
        return (server.algorithm == self.algorithm and server.budget in self.budgets
                and server.topk is not None and self.topk_max is not None and server.topk <= self.topk_max)

    def sort_key(self) -> tuple[int, int, int, tuple[int, ...]]:
        return (*self.server.sort_key(), self.budgets)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1

    @property
    def key(self) -> str:
        return f"t{self.temperature:g}-top_p{self.top_p:g}-top_k{self.top_k}"

    def as_params(self) -> dict[str, float | int]:
        """SGLang ``sampling_params`` entries (top_k -1 = disabled, as SGLang spells it)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    @property
    def verify_path(self) -> str:
        """Which verify branch a batch of this sampling takes, which sets what a round costs:
        ``greedy`` (SGLang's ``is_all_greedy``: temperature 0 or top_k 1, an argmax walk) or
        ``sampled`` (target probabilities and tree rejection sampling), with the filters
        that add work to it (``+top_k``, ``+top_p``: SGLang's ``need_top_k_sampling`` /
        ``need_top_p_sampling``). The temperature's value only scales the logits: every
        sampled temperature costs the same."""
        if self.temperature <= 0 or self.top_k == 1:
            return "greedy"
        return "sampled" + ("+top_k" if self.top_k > 1 else "") + ("+top_p" if self.top_p < 1 else "")


@dataclass(frozen=True)
class Cell:
    server: ServerConfig
    sampling: Sampling
    concurrency: int
    baseline: bool = False
    # The launch that measures it; None: a launch at its own tree. Not part of its
    # identity: the same cell measured live or on a fresh launch is the same cell.
    via: LaunchConfig | None = None

    @property
    def key(self) -> str:
        """Stable identity of the cell; the ledger and ``--resume`` match on it."""
        return f"{self.server.key}|{self.sampling.key}|c{self.concurrency}"

    @property
    def launch(self) -> LaunchConfig:
        return self.via if self.via is not None else LaunchConfig.fresh(self.server)

    @property
    def switched(self) -> bool:
        """Whether its tree is set live on a running server before it is measured."""
        return self.launch.live


@dataclass(frozen=True)
class ServerGroup:
    """Cells that share one server launch."""

    launch: LaunchConfig
    cells: tuple[Cell, ...]

    @property
    def switches(self) -> int:
        """Live tree switches between its cells (one per cell: each is proven before it is measured)."""
        return len(self.cells) if self.launch.live else 0


@dataclass(frozen=True)
class SweepPlan:
    groups: tuple[ServerGroup, ...]
    repeats: int
    warmup: int
    relaunch: str = "never"

    @property
    def cells(self) -> tuple[Cell, ...]:
        return tuple(c for g in self.groups for c in g.cells)

    @property
    def restarts(self) -> int:
        """Server launches per host (with one server place)."""
        return len(self.groups)

    @property
    def switches(self) -> int:
        """Live tree switches per host (every repeat switches again)."""
        return sum(g.switches for g in self.groups) * self.repeats

    @property
    def runs(self) -> int:
        """Rows this plan writes per host (cells x repeats)."""
        return len(self.cells) * self.repeats


def _server_of(values: Mapping[str, Any]) -> ServerConfig:
    algo = values["algorithm"]
    if algo == "ddtree":
        return ServerConfig("ddtree", int(values["budget"]), int(values["topk"]))
    return ServerConfig(algo)


def _cell_of(values: Mapping[str, Any], *, baseline: bool = False) -> Cell:
    return Cell(
        server=_server_of(values),
        sampling=Sampling(float(values["temperature"]), float(values["top_p"]), int(values["top_k"])),
        concurrency=int(values["concurrency"]),
        baseline=baseline,
    )


def _excluded(values: Mapping[str, Any], rules: tuple[Mapping[str, tuple[Any, ...]], ...]) -> bool:
    for rule in rules:
        # budget/topk mean nothing to non-DDTree cells, so such a rule never excludes them.
        if values["algorithm"] != "ddtree" and ({"budget", "topk"} & set(rule)):
            continue
        if all(values[axis] in allowed for axis, allowed in rule.items()):
            return True
    return False


def expand_cells(spec: SweepSpec) -> list[Cell]:
    """Grid product minus ``exclude`` plus ``include`` plus baselines; no duplicates."""
    axes = list(GRID_DEFAULTS)
    cells: dict[str, Cell] = {}
    for combo in itertools.product(*(spec.grid[a] for a in axes)):
        values = dict(zip(axes, combo, strict=True))
        if _excluded(values, spec.exclude):
            continue
        cell = _cell_of(values)
        cells.setdefault(cell.key, cell)
    for extra in spec.include:
        values = {a: spec.grid[a][0] for a in axes} | dict(extra)
        cell = _cell_of(values)
        cells.setdefault(cell.key, cell)
    sampling_axes = ("temperature", "top_p", "top_k", "concurrency")
    for base in spec.baselines:
        for width in _baseline_widths(base, cells.values(), spec.dflash_block):
            for combo in itertools.product(*(spec.grid[a] for a in sampling_axes)):
                values = dict(zip(sampling_axes, combo, strict=True))
                values |= {"algorithm": base, "budget": None, "topk": None}
                if _excluded(values, spec.exclude):
                    continue
                cell = dataclasses.replace(_cell_of(values, baseline=True), server=ServerConfig(base, width))
                # A grid cell with the same key is replaced, so it is marked as the baseline it is.
                cells[cell.key] = cell
    return list(cells.values())


def dflash_width(ddtree_budget: int, block: int) -> int:
    """The DFlash chain (its ``--speculative-num-draft-tokens``) that verifies as many
    tokens per round as a DDTree of ``ddtree_budget`` nodes, the root plus the budget, up
    to the drafter's ``block``: a chain is never longer than what the drafter drafts,
    while a tree of more nodes is wider instead (the report compares such a tree with
    the longest chain)."""
    return min(ddtree_budget + 1, block)


def _baseline_widths(base: str, cells: Collection[Cell], block: int) -> tuple[int | None, ...]:
    """The launches a baseline runs at. DFlash: one chain per verify width the DDTree
    cells use, so that every DDTree cell is compared with the chain that costs the same
    verify forward (a tree of 8 nodes against a chain of 8 drafted tokens, not against
    whatever block the drafter defaults to); the drafter's own block where the sweep has
    no DDTree cells. Autoregressive: its one launch."""
    budgets = {c.server.budget for c in cells if c.server.algorithm == "ddtree" and c.server.budget}
    if base != "dflash" or not budgets:
        return (None,)
    return tuple(sorted({dflash_width(b, block) for b in budgets}))


def live_launch(cells: Collection[Cell]) -> LaunchConfig | None:
    """The one DDTree launch that can serve every DDTree cell of ``cells`` by switching:
    a runtime state per budget they use, top-k up to the largest they use, launched at the
    first tree they are measured at (the smallest budget, with the smallest top-k). None
    without DDTree cells."""
    trees = sorted({(c.server.budget, c.server.topk) for c in cells if c.server.algorithm == "ddtree"},
                   key=lambda t: (t[0] or 0, t[1] or 0))
    if not trees:
        return None
    budgets = tuple(sorted({b for b, _ in trees if b is not None}))
    topks = [k for _, k in trees if k is not None]
    first = trees[0]
    return LaunchConfig("ddtree", first[0], first[1], budgets=budgets, topk_max=max(topks))


def assign_launches(cells: Collection[Cell], relaunch: str) -> list[Cell]:
    """``cells`` with the launch that measures each: ``never`` puts every DDTree cell on one
    live launch (:func:`live_launch`), ``always`` gives each (budget, top-k) its own."""
    if relaunch not in RELAUNCH_MODES:
        raise ValueError(f"relaunch must be one of {', '.join(RELAUNCH_MODES)}, not {relaunch!r}")
    live = live_launch(cells) if relaunch == "never" else None
    out: list[Cell] = []
    for cell in cells:
        via = live if live is not None and live.serves(cell.server) else None
        out.append(dataclasses.replace(cell, via=via))
    return out


def plan_sweep(
    spec: SweepSpec,
    *,
    current: LaunchConfig | None = None,
    done: Collection[str] = (),
    relaunch: str | None = None,
) -> SweepPlan:
    """Group cells by launch and order them: the launch already running (``current``)
    first, then baselines, then DDTree by budget and top-k; inside a live launch by tree,
    then sampling and concurrency. ``done`` holds cell keys already complete (``--resume``);
    they are left out and so are groups left empty (the live launch keeps the whole
    sweep's set: the same launch whatever is left). ``relaunch`` overrides the sweep's
    ``relaunch`` key (``bench --dry-run`` estimates both)."""
    mode = relaunch if relaunch is not None else spec.relaunch
    by_launch: dict[LaunchConfig, list[Cell]] = {}
    for cell in assign_launches(expand_cells(spec), mode):
        if cell.key in done:
            continue
        by_launch.setdefault(cell.launch, []).append(cell)
    order = sorted(by_launch, key=lambda s: (s != current, s.sort_key()))

    def cell_order(c: Cell) -> tuple[int, int, float, float, int, int]:
        return (c.server.budget or 0, c.server.topk or 0, c.sampling.temperature, c.sampling.top_p,
                c.sampling.top_k, c.concurrency)

    groups = tuple(ServerGroup(launch=s, cells=tuple(sorted(by_launch[s], key=cell_order))) for s in order)
    return SweepPlan(groups=groups, repeats=spec.repeats, warmup=spec.warmup, relaunch=mode)


def cell_steps(cell: Cell, *, num_prompts: int, max_new_tokens: int, warmup: int) -> int:
    """The decode steps one run of ``cell`` is charged: ``ceil(num_prompts / concurrency)``
    waves of ``max_new_tokens`` steps, plus a warmup wave when there is one. The unit the
    runner learns a host's step time in (``StateStore.record_step_time``)."""
    waves = math.ceil(num_prompts / cell.concurrency) + (1 if warmup else 0)
    return waves * max_new_tokens


@dataclass(frozen=True)
class StepTimes:
    """Seconds per decode step (:func:`cell_steps`' unit) of a run on a host: ``default``
    (the host's rows of every kind together, else the guess :data:`STEP_S`), and where
    learned, per concurrency (``by_concurrency``: (concurrency, seconds)) and per server
    configuration at a concurrency (``by_server``: (``ServerConfig.key``, concurrency,
    seconds)). A step of a wider batch takes longer (a simulated B300: 16 ms at concurrency
    2, 61 ms at 16), and so does a bigger tree's (3.5x from budget 6 to 96 at 16), so each
    run is charged its own configuration's step at its concurrency (:meth:`at`)."""

    default: float = STEP_S
    by_concurrency: tuple[tuple[int, float], ...] = ()
    by_server: tuple[tuple[str, int, float], ...] = ()

    def at(self, concurrency: int, server: str | None = None) -> float:
        """The step of ``server`` (a ``ServerConfig.key``) at ``concurrency``: from that
        configuration's learned steps where it has any, else from every configuration's at
        each concurrency; learned at that concurrency, else interpolated in log(concurrency)
        between the learned ones around it, else the nearest learned one's; ``default``
        where nothing is learned."""
        mine = tuple((c, v) for k, c, v in self.by_server if k == server) if server is not None else ()
        known = sorted(mine or self.by_concurrency)
        if not known:
            return self.default
        below = [cv for cv in known if cv[0] <= concurrency]
        above = [cv for cv in known if cv[0] >= concurrency]
        if not below or not above:
            return (above or below)[0 if above else -1][1]
        (c0, s0), (c1, s1) = below[-1], above[0]
        if c0 == c1:
            return s0
        return s0 + (s1 - s0) * math.log(concurrency / c0) / math.log(c1 / c0)


def step_at(s_per_step: float | StepTimes, concurrency: int, server: str | None = None) -> float:
    """One figure a step of ``server`` at ``concurrency``: a bare float is every one's."""
    return s_per_step.at(concurrency, server) if isinstance(s_per_step, StepTimes) else s_per_step


def cell_seconds(
    cell: Cell, *, num_prompts: int, max_new_tokens: int, warmup: int, s_per_step: float | StepTimes = STEP_S
) -> float:
    """Rough measuring time of one run of ``cell``: :func:`cell_steps` x the step of its
    server configuration at its concurrency (:class:`StepTimes`: the host's learned step
    time where a sweep measured there before, else a guess)."""
    steps = cell_steps(cell, num_prompts=num_prompts, max_new_tokens=max_new_tokens, warmup=warmup)
    return steps * step_at(s_per_step, cell.concurrency, cell.server.key)


def run_seconds(
    cell: Cell, *, num_prompts: int, max_new_tokens: int, warmup: int, s_per_step: float | StepTimes = STEP_S
) -> float:
    """Rough time of one run of ``cell`` on a server that serves its launch: its
    :func:`cell_seconds`, and the live switch before it where its tree is switched."""
    measure = cell_seconds(cell, num_prompts=num_prompts, max_new_tokens=max_new_tokens, warmup=warmup,
                           s_per_step=s_per_step)
    return measure + (SWITCH_S if cell.switched else 0.0)


def estimate_seconds(
    plan: SweepPlan,
    *,
    load_s: float,
    num_prompts: int,
    max_new_tokens: int,
    s_per_step: float | StepTimes = STEP_S,
    switch_s: float = SWITCH_S,
) -> float:
    """Rough wall time for one host with one server: every restart costs ``load_s``
    (learned per host, see the state file), every live switch ``switch_s`` and every run
    :func:`cell_seconds`. An estimate for planning, not a promise: speculation makes
    steps emit several tokens, which only shortens it; a live launch captures one verify
    graph per budget, which lengthens its load by what capture takes there."""
    total = plan.restarts * load_s + plan.switches * switch_s
    for cell in plan.cells:
        total += plan.repeats * cell_seconds(
            cell, num_prompts=num_prompts, max_new_tokens=max_new_tokens, warmup=plan.warmup, s_per_step=s_per_step
        )
    return total
