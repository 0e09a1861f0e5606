"""Server configurations -> GPU slots: which slot runs what, and when (expected).

Pure: no I/O, no clock. A host with several GPU slots runs one SGLang server per slot, so
a sweep's server configurations (baselines included) no longer wait in one queue per
host: each goes to whichever slot frees first, longest expected first (LPT — within 4/3
of the best possible wall time, and simple enough to predict in ``--dry-run``). The
physical limit it works against is (configurations / slots) x (load + measure).

A launch whose work would keep one slot busy while others idle is split into several jobs
of the same launch configuration (the same command, the same runtime states: a cell
measures the same server whatever slot serves it), one per slot, each loading once and
measuring its share: a live launch's cells, a relaunched configuration's repeats. The
split follows the schedule: a launch gets one more part only while that shortens the
expected wall time (:func:`make_jobs`), so a part never costs more load than it saves.
What is split is a launch's *work items*, in order (:func:`split_items`): the (cell,
repeat) runs here; a predicted sweep's trace runs and round-time probes the same way
(:func:`~.predictplan.split_work`), given their expected seconds.

A slot may already serve a launch when the schedule starts (``running``: a predicted
sweep's predict phase leaves its launch running on every slot): it measures that
launch's part first, without a load, as the runner's queue gives it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ddtree_ops.bench.plan import Cell, LaunchConfig, SweepPlan

T = TypeVar("T")


@dataclass(frozen=True, order=True)
class Slot:
    """One server place on a host: its GPUs (``CUDA_VISIBLE_DEVICES``) and its own port."""

    host: str
    index: int
    gpus: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.host}/{self.index}"


@dataclass(frozen=True)
class Job:
    """One server launch and the runs (cell, repeat) it serves, all of one launch
    configuration (a live DDTree launch serves cells of several trees)."""

    launch: LaunchConfig
    runs: tuple[tuple[Cell, int], ...]
    measure_s: float

    @property
    def repeats(self) -> tuple[int, ...]:
        return tuple(sorted({r for _, r in self.runs}))


@dataclass(frozen=True)
class Placement:
    slot: Slot
    job: Job
    start_s: float
    load_s: float
    end_s: float


@dataclass(frozen=True)
class Schedule:
    placements: tuple[Placement, ...]
    slots: tuple[Slot, ...]

    @property
    def wall_s(self) -> float:
        """Expected wall time: the last slot to finish."""
        return max((p.end_s for p in self.placements), default=0.0)

    def on(self, slot: Slot) -> list[Placement]:
        return [p for p in self.placements if p.slot == slot]


def plan_runs(plan: SweepPlan) -> list[tuple[Cell, int]]:
    """Every (cell, repeat) of ``plan``, a pass over the cells per repeat.

    Repeat-major so a slow stretch of the machine (a GPU's clocks throttling, a noisy
    neighbour: on a 2-core CPU host one cell's five back-to-back repeats scattered 0.8 %
    (sd), the same cell in two runs half an hour apart 7 %) falls on different cells in
    each pass instead of on every repeat of the few cells measured during it."""
    return [(cell, r) for r in range(plan.repeats) for cell in plan.cells]


def split_items(items: Sequence[T], cost: Callable[[T], float], parts: int) -> list[list[T]]:
    """``items`` cut into at most ``parts`` consecutive pieces of about equal expected
    seconds, order kept (an item goes to the piece its midpoint falls in); items of no
    expected cost are never split off. Pure and deterministic: the runner cuts what
    ``--resume`` left the same way the dry run cut the whole."""
    costs = [cost(i) for i in items]
    total = sum(costs)
    parts = max(1, min(parts, len(items)))
    pieces: list[list[T]] = [[]]
    done = 0.0
    for item, c in zip(items, costs, strict=True):
        if pieces[-1] and len(pieces) < parts and done + c / 2 > total * len(pieces) / parts:
            pieces.append([])
        pieces[-1].append(item)
        done += c
    return pieces


def make_jobs(
    runs: Sequence[tuple[Cell, int]],
    *,
    cell_s: Callable[[Cell], float],
    load_s: float,
    slots: int,
    running: LaunchConfig | None = None,
) -> list[Job]:
    """One job per launch configuration (in the order ``runs`` first names them), then,
    with several slots, launches split into parts (:func:`split_items`, repeat by repeat:
    each part a whole repeat where the parts are as many as the repeats, so repeats land
    on different GPUs) while that shortens the expected wall time of the schedule on
    ``slots`` slots loading in ``load_s`` each (``running``: a launch every slot serves
    already, whose parts cost no load). At most one part per slot and launch: each slot
    loads a launch once."""

    def job(launch: LaunchConfig, part: Sequence[tuple[Cell, int]]) -> Job:
        return Job(launch, tuple(part), sum(cell_s(c) for c, _ in part))

    by_launch: dict[LaunchConfig, list[tuple[Cell, int]]] = {}
    for cell, rep in runs:
        by_launch.setdefault(cell.launch, []).append((cell, rep))

    def build(parts: Mapping[LaunchConfig, int]) -> list[Job]:
        out: list[Job] = []
        for launch, items in by_launch.items():
            if parts[launch] == 1:
                out.append(job(launch, items))
            else:
                by_repeat = sorted(items, key=lambda run: run[1])  # stable: plan order within a repeat
                out += [job(launch, p) for p in split_items(by_repeat, lambda run: cell_s(run[0]), parts[launch])]
        return out

    parts = dict.fromkeys(by_launch, 1)
    jobs = build(parts)
    if slots < 2:
        return jobs
    places = [Slot("", i) for i in range(slots)]

    def finish(candidate: Sequence[Job]) -> list[float]:
        """The slots' finish times, latest first: the wall time, then what decides the next split."""
        sched = schedule(candidate, places, load_s=dict.fromkeys(places, load_s),
                         running=dict.fromkeys(places, running) if running is not None else None)
        return sorted((max((p.end_s for p in sched.on(s)), default=0.0) for s in places), reverse=True)

    unsplit = best = finish(jobs)
    while True:
        trials = []
        for launch, items in by_launch.items():
            if parts[launch] >= min(slots, len(items)):
                continue
            trial = parts | {launch: parts[launch] + 1}
            trial_jobs = build(trial)
            if sum(1 for j in trial_jobs if j.launch == launch) <= parts[launch]:
                continue  # nothing left to cut (items of no expected cost)
            ends = finish(trial_jobs)
            # A part of the launch every slot serves loads nothing: taken even where it
            # only moves work (the wall unchanged), which can free a slot for another
            # launch's part to shorten the schedule next.
            free = launch == running and ends <= best
            if ends[0] <= best[0] + 1e-9 and (ends < best or free):
                trials.append((ends, launch.sort_key(), trial, trial_jobs))
        if not trials:
            break
        best, _, parts, jobs = min(trials, key=lambda t: (t[0], t[1]))
    # Splits that only evened out the other slots cost loads without shortening the sweep.
    return jobs if best[0] < unsplit[0] - 1e-9 else build(dict.fromkeys(by_launch, 1))


def longest_first(jobs: Sequence[Job]) -> list[Job]:
    """LPT order; ties in configuration order, so the same jobs always come out the same."""
    return sorted(jobs, key=lambda j: (-j.measure_s, j.launch.sort_key(), j.repeats))


def schedule(
    jobs: Sequence[Job],
    slots: Sequence[Slot],
    *,
    load_s: Mapping[Slot, float],
    running: Mapping[Slot, LaunchConfig] | None = None,
) -> Schedule:
    """Longest expected first, each to the slot that frees first.

    ``load_s`` is each slot's learned (or expected) load time; a slot already serving a
    job's configuration (``running``) takes the longest job of it first, without a load
    (the runner's queue gives a slot a job of the launch it serves before any other: a
    running server is not replaced while it has work). Ties go to a slot already serving
    that configuration, then to a slot that has not run it yet (repeats land on different
    GPUs), then to slot order — so the same inputs always give the same schedule.
    """
    if not slots:
        raise ValueError("no slots to schedule on")
    current: dict[Slot, LaunchConfig | None] = {s: (running or {}).get(s) for s in slots}
    ran: dict[Slot, set[LaunchConfig]] = {s: set() for s in slots}
    order = longest_first(jobs)
    placements: list[Placement] = []
    free: list[tuple[float, int, Slot]] = []
    for i, slot in enumerate(slots):
        own = next((j for j in order if j.launch == current[slot]), None)
        if own is not None:
            order.remove(own)
            placements.append(Placement(slot, own, 0.0, 0.0, own.measure_s))
            ran[slot].add(own.launch)
        free.append((own.measure_s if own is not None else 0.0, i, slot))
    heapq.heapify(free)
    for job in order:
        t = free[0][0]
        tied = [entry for entry in free if entry[0] == t]
        pick = min(tied, key=lambda e: (current[e[2]] != job.launch, job.launch in ran[e[2]], e[1]))
        free.remove(pick)
        heapq.heapify(free)
        slot = pick[2]
        load = 0.0 if current[slot] == job.launch else load_s[slot]
        end = t + load + job.measure_s
        placements.append(Placement(slot, job, t, load, end))
        current[slot] = job.launch
        ran[slot].add(job.launch)
        heapq.heappush(free, (end, pick[1], slot))
    return Schedule(tuple(placements), tuple(slots))

