"""Server configurations -> GPU slots: which slot runs what, and when (expected).

Pure: no I/O, no clock. A host with several GPU slots runs one SGLang server per slot, so
a sweep's server configurations (baselines included) no longer wait in one queue per
host: each goes to whichever slot frees first, longest expected first (LPT — within 4/3
of the best possible wall time, and simple enough to predict in ``--dry-run``). The
physical limit it works against is (configurations / slots) x (load + measure).

A configuration whose repeats alone would keep one slot busy while others idle is split
into several jobs (repeats spread across slots), but only while each half still measures
for longer than the extra model load it costs; otherwise the load would eat the gain.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ddtree_ops.bench.plan import Cell, LaunchConfig, SweepPlan


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
    """Every (cell, repeat) of ``plan``, in plan order."""
    return [(cell, r) for cell in plan.cells for r in range(plan.repeats)]


def make_jobs(
    runs: Sequence[tuple[Cell, int]],
    *,
    cell_s: Callable[[Cell], float],
    load_s: float,
    slots: int,
) -> list[Job]:
    """One job per launch configuration (in the order ``runs`` first names them), then the
    longest split by repeats while slots would otherwise idle and each part still
    measures longer than a load."""

    def job(launch: LaunchConfig, part: Sequence[tuple[Cell, int]]) -> Job:
        return Job(launch, tuple(part), sum(cell_s(c) for c, _ in part))

    by_launch: dict[LaunchConfig, list[tuple[Cell, int]]] = {}
    for cell, rep in runs:
        by_launch.setdefault(cell.launch, []).append((cell, rep))
    jobs = [job(launch, part) for launch, part in by_launch.items()]
    while len(jobs) < slots:
        longest = max(jobs, key=lambda j: j.measure_s, default=None)
        if longest is None or len(longest.repeats) < 2 or longest.measure_s / 2 <= load_s:
            break
        first = set(longest.repeats[: len(longest.repeats) // 2])
        at = jobs.index(longest)
        jobs[at : at + 1] = [
            job(longest.launch, [(c, r) for c, r in longest.runs if r in first]),
            job(longest.launch, [(c, r) for c, r in longest.runs if r not in first]),
        ]
    return jobs


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
    job's configuration (``running``) takes it without a load. Ties go to a slot already
    serving that configuration, then to a slot that has not run it yet (repeats land on
    different GPUs), then to slot order — so the same inputs always give the same schedule.
    """
    if not slots:
        raise ValueError("no slots to schedule on")
    current: dict[Slot, LaunchConfig | None] = {s: (running or {}).get(s) for s in slots}
    ran: dict[Slot, set[LaunchConfig]] = {s: set() for s in slots}
    free: list[tuple[float, int, Slot]] = [(0.0, i, s) for i, s in enumerate(slots)]
    heapq.heapify(free)
    order = longest_first(jobs)
    placements: list[Placement] = []
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

