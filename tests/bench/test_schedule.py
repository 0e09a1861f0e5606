"""Server configurations onto GPU slots (pure): longest first, to whichever slot frees first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_ops.bench.plan import Cell, LaunchConfig, Sampling, ServerConfig, ServerGroup, SweepPlan
from ddtree_ops.bench.schedule import Job, Slot, make_jobs, plan_runs, schedule


def group(budget: int, cells: int = 1) -> ServerGroup:
    server = ServerConfig("ddtree", budget, 4)
    return ServerGroup(LaunchConfig.fresh(server), tuple(Cell(server, Sampling(), c + 1) for c in range(cells)))


def job(budget: int, measure_s: float) -> Job:
    g = group(budget)
    return Job(g.launch, tuple((c, 0) for c in g.cells), measure_s)


def plan(*budgets: int, repeats: int = 1) -> SweepPlan:
    return SweepPlan(groups=tuple(group(b) for b in budgets), repeats=repeats, warmup=0)


def slots(n: int, host: str = "h") -> list[Slot]:
    return [Slot(host, i, (i,)) for i in range(n)]


def measure(seconds: float):
    return lambda cell: seconds


def test_eight_configurations_on_four_slots_take_two_rounds_of_load_plus_measure() -> None:
    s4 = slots(4)
    jobs = make_jobs(plan_runs(plan(*range(1, 9))), cell_s=measure(10), load_s=30, slots=4)
    assert len(jobs) == 8  # one repeat each: nothing to spread
    sched = schedule(jobs, s4, load_s=dict.fromkeys(s4, 30.0))
    assert sched.wall_s == pytest.approx(2 * (30 + 10))
    one = schedule(jobs, slots(1), load_s={slots(1)[0]: 30.0})
    assert one.wall_s == pytest.approx(8 * (30 + 10))
    assert {len(sched.on(s)) for s in s4} == {2}


def test_longest_first_to_the_slot_that_frees_first() -> None:
    s2 = slots(2)
    jobs = [job(b, m) for b, m in ((1, 5.0), (2, 50.0), (3, 20.0), (4, 30.0))]
    sched = schedule(jobs, s2, load_s=dict.fromkeys(s2, 0.0))
    order = [(p.slot.index, p.job.launch.budget, p.start_s) for p in sched.placements]
    assert order == [(0, 2, 0.0), (1, 4, 0.0), (1, 3, 30.0), (0, 1, 50.0)]
    assert sched.wall_s == 55.0


def test_a_slot_already_serving_a_configuration_takes_it_without_a_load() -> None:
    s2 = slots(2)
    jobs = make_jobs(plan_runs(plan(8, 16)), cell_s=measure(10), load_s=60, slots=2)
    sched = schedule(jobs, s2, load_s=dict.fromkeys(s2, 60.0), running={s2[1]: LaunchConfig("ddtree", 16, 4)})
    by_budget = {p.job.launch.budget: p for p in sched.placements}
    assert (by_budget[16].slot, by_budget[16].load_s) == (s2[1], 0.0)
    assert (by_budget[8].slot, by_budget[8].load_s) == (s2[0], 60.0)


def test_repeats_spread_only_while_a_part_still_measures_longer_than_a_load() -> None:
    # Long measurement: 4 repeats x 100 s split across the idle slots.
    jobs = make_jobs(plan_runs(plan(8, repeats=4)), cell_s=measure(100), load_s=30, slots=4)
    assert sorted(j.repeats for j in jobs) == [(0,), (1,), (2,), (3,)]
    s4 = slots(4)
    sched = schedule(jobs, s4, load_s=dict.fromkeys(s4, 30.0))
    assert {p.slot for p in sched.placements} == set(s4)
    assert sched.wall_s == pytest.approx(130)
    # Short measurement: a second load would cost more than it saves.
    short = make_jobs(plan_runs(plan(8, repeats=4)), cell_s=measure(10), load_s=30, slots=4)
    assert [j.repeats for j in short] == [(0, 1, 2, 3)]


def test_per_slot_load_times_and_determinism() -> None:
    s2 = slots(2)
    jobs = make_jobs(plan_runs(plan(1, 2, 3)), cell_s=measure(10), load_s=20, slots=2)
    loads = {s2[0]: 100.0, s2[1]: 20.0}
    first = schedule(jobs, s2, load_s=loads)
    assert first == schedule(list(reversed(jobs)), s2, load_s=loads)
    assert first.wall_s == pytest.approx(110)  # the fast-loading slot runs two


def test_no_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="no slots"):
        schedule([], [], load_s={})


@settings(max_examples=200, deadline=None)
@given(
    measures=st.lists(st.floats(0.5, 500), min_size=1, max_size=12),
    n_slots=st.integers(1, 8),
    load=st.floats(0, 300),
)
def test_every_job_runs_once_without_overlap_and_within_the_list_scheduling_bound(
    measures: list[float], n_slots: int, load: float
) -> None:
    ss = slots(n_slots)
    jobs = [job(i + 1, m) for i, m in enumerate(measures)]
    sched = schedule(jobs, ss, load_s=dict.fromkeys(ss, load))
    assert sorted(p.job.launch.budget for p in sched.placements) == list(range(1, len(jobs) + 1))
    for s in ss:
        spans = sorted((p.start_s, p.end_s) for p in sched.on(s))
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:], strict=False))
    durations = [m + load for m in measures]
    lower = max(max(durations), sum(durations) / n_slots)
    # Graham's bound for any list schedule; LPT is usually far inside it.
    graham = sum(durations) / n_slots + (1 - 1 / n_slots) * max(durations)
    assert lower - 1e-6 <= sched.wall_s <= graham + 1e-6
    assert sched.wall_s <= sum(durations) + 1e-6


def test_a_live_launch_is_one_job_for_all_its_trees() -> None:
    live = LaunchConfig("ddtree", 4, 2, budgets=(4, 8, 16), topk_max=4)
    cells = [Cell(ServerConfig("ddtree", b, k), Sampling(), 1, via=live) for b in (4, 8, 16) for k in (2, 4)]
    ar = Cell(ServerConfig("autoregressive"), Sampling(), 1)
    jobs = make_jobs([(c, 0) for c in [ar, *cells]], cell_s=measure(10), load_s=30, slots=2)
    assert [(j.launch, len(j.runs)) for j in jobs] == [(LaunchConfig("autoregressive"), 1), (live, 6)]
