"""A sweep planned once for its hosts: what ``bench --dry-run`` renders and the runner runs.

:func:`prepare_sweep` turns a sweep file and its target hosts into a
:class:`PreparedSweep`: the cells and server launches (:func:`~.plan.plan_sweep`), and
per host where its load comes from, what one launch is expected to cost there (learned
from its last restarts, else the inventory's ``expected_load_s``) and what one decode step
of a run costs (learned from its last sweeps' rows, else a guess), the estimate with one
server (with the sweep's ``relaunch`` mode, and with the other one beside it: live
switching against a launch per tree) and, for a host with several GPU slots, which slot
is expected to run which launch (:mod:`.schedule`). The runner queues a host's launches with :meth:`PreparedSweep.jobs`,
the same function over the runs that ``--resume`` left.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddtree_ops.bench.onhost import ClientMode, client_mode
from ddtree_ops.bench.plan import (
    STEP_S,
    Cell,
    LaunchConfig,
    StepTimes,
    SweepPlan,
    cell_steps,
    estimate_seconds,
    plan_sweep,
    run_seconds,
)
from ddtree_ops.bench.schedule import Job, Schedule, Slot, longest_first, make_jobs, plan_runs, schedule
from ddtree_ops.bench.sweep import RELAUNCH_MODES, SweepSpec
from ddtree_ops.inventory_types import Host


def expected_launch_s(host: Host) -> float:
    """What one server launch on ``host`` costs a sweep: its last whole restart (stopping
    the old server, load, capture, smoke; the state file), else its last load, else the
    inventory's ``expected_load_s``."""
    from ddtree_ops.state import StateStore

    state, model = StateStore(), _model(host)
    for learned in (state.learned_restart_s(host.name, model), state.learned_load_s(host.name, model)):
        if learned is not None:
            return learned
    return host.ddtree.server.expected_load_s


def expected_step_s(hosts: Sequence[Host]) -> StepTimes:
    """Seconds per decode step of a run (``plan.cell_steps``) on these server places: the
    mean over the places of what their last sweeps measured (the state file), in all, per
    concurrency and per (server configuration, concurrency) where learned; else the plan's
    guess."""
    from ddtree_ops.state import StateStore

    state = StateStore()
    learned: dict[tuple[int, str | None], list[float]] = {}
    for h in hosts:
        for key, value in state.learned_steps(h.name, _model(h)).items():
            learned.setdefault(key, []).append(value)
    mean = {key: sum(v) / len(v) for key, v in sorted(learned.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))}
    default = _learned_step_s(hosts, trace=False)
    return StepTimes(STEP_S if default is None else default,
                     tuple((c, v) for (c, server), v in mean.items() if server is None),
                     tuple((server, c, v) for (c, server), v in mean.items() if server is not None))


def learn_step(place: Host, cell: Cell, seconds: float, spec: SweepSpec) -> None:
    """Remember what a step of one measured run of ``cell`` took on ``place`` (all, at its
    concurrency, and its configuration's there), for the next dry run's
    :func:`expected_step_s`, as a restart remembers its load time."""
    from ddtree_ops.state import StateStore

    wl = spec.workload
    steps = cell_steps(cell, num_prompts=wl.num_prompts, max_new_tokens=wl.max_new_tokens, warmup=spec.warmup)
    if steps:
        StateStore().record_step_time(place.name, _model(place), seconds / steps, concurrency=cell.concurrency,
                                      server=cell.server.key)


def expected_trace_step_s(hosts: Sequence[Host]) -> float | None:
    """Seconds per step (the same unit) of a predicted sweep's trace run on these places:
    what their last trace runs took, else None (``predictplan.work_seconds`` charges the
    slowest tree's run step at the trace concurrency x :data:`~.plan.TRACE_STEP_FACTOR`)."""
    return _learned_step_s(hosts, trace=True)


def _model(host: Host) -> str:
    return host.ddtree.server.model_path or ""


def _learned_step_s(hosts: Sequence[Host], *, trace: bool) -> float | None:
    """The mean of the places' learned step times (the state file), None where none has one."""
    from ddtree_ops.state import StateStore

    state = StateStore()
    learned = [v for h in hosts if (v := state.learned_step_s(h.name, _model(h), trace=trace)) is not None]
    return sum(learned) / len(learned) if learned else None


@dataclass(frozen=True)
class HostPlan:
    """One target host's part of the sweep."""

    host: Host
    client: ClientMode
    # Expected seconds per launch on each of its server places (its GPU slots, or itself).
    launch_s: tuple[float, ...]
    # Every launch and run with one server.
    estimate_s: float
    # Several GPU slots: which slot is expected to run which launch, and when.
    schedule: Schedule | None
    # The same estimate with one server for each ``relaunch`` mode (the sweep's among
    # them): what live switching saves here.
    estimate_by_mode: Mapping[str, float] | None = None
    # Seconds per decode step of a run there (:func:`expected_step_s`).
    step_s: StepTimes = StepTimes()
    # ... of a predicted sweep's trace run there (:func:`expected_trace_step_s`; None: none
    # timed there yet).
    trace_step_s: float | None = None


@dataclass(frozen=True)
class PreparedSweep:
    spec: SweepSpec
    plan: SweepPlan
    hosts: tuple[HostPlan, ...]
    # The plan of every ``relaunch`` mode (``plan`` is the sweep's own): --dry-run shows both.
    plans: Mapping[str, SweepPlan] | None = None

    def cell_s(self, cell: Cell, step_s: StepTimes | float = STEP_S) -> float:
        workload = self.spec.workload
        return run_seconds(cell, num_prompts=workload.num_prompts, max_new_tokens=workload.max_new_tokens,
                           warmup=self.plan.warmup, s_per_step=step_s)

    def jobs(self, hp: HostPlan, runs: Sequence[tuple[Cell, int]], *, running: LaunchConfig | None = None) -> list[Job]:
        """``runs`` of ``hp``'s host as server launches. One server: in plan order. Several
        slots: launches split where a slot would idle (the dry run's split, over what is
        left), longest expected first; ``running``: a launch every slot serves already (a
        predicted sweep's kept servers), whose parts cost no load."""
        if hp.schedule is None:
            return make_jobs(runs, cell_s=lambda _c: 0.0, load_s=0.0, slots=1)
        return longest_first(make_jobs(runs, cell_s=lambda c: self.cell_s(c, hp.step_s), load_s=min(hp.launch_s),
                                       slots=len(hp.launch_s), running=running))


def prepare_sweep(spec: SweepSpec, hosts: Sequence[Host]) -> PreparedSweep:
    plans = {mode: plan_sweep(spec, relaunch=mode) for mode in RELAUNCH_MODES}
    plan = plans[spec.relaunch]
    prepared = PreparedSweep(spec, plan, (), plans)
    planned = []
    for host in hosts:
        places = host.slot_hosts()
        launch_s = tuple(expected_launch_s(place) for place in places)
        step_s = expected_step_s(places)
        by_mode = {
            mode: estimate_seconds(p, load_s=launch_s[0], num_prompts=spec.workload.num_prompts,
                                   max_new_tokens=spec.workload.max_new_tokens, s_per_step=step_s)
            for mode, p in plans.items()
        }
        estimate = by_mode[spec.relaunch]
        sched = None
        if len(places) > 1:
            loads = {Slot(host.name, i, place.slot.gpus if place.slot else ()): s
                     for i, (place, s) in enumerate(zip(places, launch_s, strict=True))}
            jobs = make_jobs(plan_runs(plan), cell_s=functools.partial(prepared.cell_s, step_s=step_s),
                             load_s=min(launch_s), slots=len(places))
            sched = schedule(jobs, list(loads), load_s=loads)
        planned.append(HostPlan(host, client_mode(host, spec.client), launch_s, estimate, sched, by_mode, step_s,
                                expected_trace_step_s(places)))
    return PreparedSweep(spec, plan, tuple(planned), plans)


__all__ = ["HostPlan", "PreparedSweep", "expected_launch_s", "expected_step_s", "expected_trace_step_s", "learn_step",
           "prepare_sweep"]
