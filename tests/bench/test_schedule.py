"""Server configurations onto GPU slots (pure): longest first, to whichever slot frees first."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_ops.bench.plan import Cell, LaunchConfig, Sampling, ServerConfig, ServerGroup, SweepPlan
from ddtree_ops.bench.schedule import Job, Slot, make_jobs, plan_runs, schedule, split_items


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


def test_repeats_spread_over_slots_that_would_idle_but_not_over_busy_ones() -> None:
    # Long measurement: 4 repeats x 100 s split across the idle slots.
    jobs = make_jobs(plan_runs(plan(8, repeats=4)), cell_s=measure(100), load_s=30, slots=4)
    assert sorted(j.repeats for j in jobs) == [(0,), (1,), (2,), (3,)]
    s4 = slots(4)
    sched = schedule(jobs, s4, load_s=dict.fromkeys(s4, 30.0))
    assert {p.slot for p in sched.placements} == set(s4)
    assert sched.wall_s == pytest.approx(130)
    # Short measurement, slots idle: loading in parallel still ends sooner (30 + 10 < 30 + 40).
    short = make_jobs(plan_runs(plan(8, repeats=4)), cell_s=measure(10), load_s=30, slots=4)
    assert sorted(j.repeats for j in short) == [(0,), (1,), (2,), (3,)]
    # Every slot busy with a launch of its own: a part would only add a load.
    busy = make_jobs(plan_runs(plan(8, 16, 32, 64, repeats=4)), cell_s=measure(10), load_s=30, slots=4)
    assert [j.repeats for j in busy] == [(0, 1, 2, 3)] * 4


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


def live_cells(budgets: tuple[int, ...] = (4, 8, 16, 32), topks: tuple[int, ...] = (2, 4)) -> list[Cell]:
    live = LaunchConfig("ddtree", budgets[0], topks[0], budgets=budgets, topk_max=max(topks))
    return [Cell(ServerConfig("ddtree", b, k), Sampling(), 2, via=live) for b in budgets for k in topks]


def test_a_live_launchs_cells_split_over_the_slots_each_loading_the_same_launch_once() -> None:
    cells = live_cells()
    runs = [(c, 0) for c in cells]
    jobs = make_jobs(runs, cell_s=measure(10), load_s=30, slots=4)
    # Four parts of the one live launch (the same runtime states), two trees each, in plan order.
    assert [j.launch for j in jobs] == [cells[0].launch] * 4
    assert [[c.server.key for c, _ in j.runs] for j in jobs] == [
        [c.server.key for c in cells[i:i + 2]] for i in range(0, 8, 2)]
    assert [j.measure_s for j in jobs] == [20.0] * 4
    s4 = slots(4)
    sched = schedule(jobs, s4, load_s=dict.fromkeys(s4, 30.0))
    assert [(p.slot, p.start_s, p.load_s) for p in sched.placements] == [(s, 0.0, 30.0) for s in s4]
    assert sched.wall_s == pytest.approx(30 + 2 * 10)  # one server: 30 + 8 x 10
    # What --resume left (the first three trees done) splits the same way over what is left.
    left = make_jobs(runs[3:], cell_s=measure(10), load_s=30, slots=4)
    assert sorted(len(j.runs) for j in left) == [1, 1, 1, 2]
    assert sorted((c.key for j in left for c, _ in j.runs)) == sorted(c.key for c in cells[3:])


def test_a_live_launch_splits_repeat_by_repeat_so_repeats_land_on_different_gpus() -> None:
    cells = live_cells()
    jobs = make_jobs([(c, r) for c in cells for r in range(2)], cell_s=measure(10), load_s=30, slots=2)
    assert [j.repeats for j in jobs] == [(0,), (1,)]
    assert all([c for c, _ in j.runs] == cells for j in jobs)


def test_a_split_is_kept_only_where_the_schedule_ends_sooner() -> None:
    # A live launch of 2 x 10 s beside a 40 s baseline on 2 slots: splitting the live launch
    # would put a third load on a slot (30 + 10, then 30 + 10 + 30 + 40): it stays whole.
    cells = live_cells(budgets=(4,))
    ar = Cell(ServerConfig("autoregressive"), Sampling(), 2)
    cost = {ar.key: 40.0} | {c.key: 10.0 for c in cells}
    jobs = make_jobs([(c, 0) for c in [ar, *cells]], cell_s=lambda c: cost[c.key], load_s=30, slots=2)
    assert [(j.launch.algorithm, len(j.runs)) for j in jobs] == [("autoregressive", 1), ("ddtree", 2)]
    # One slot: never split.
    assert len(make_jobs([(c, 0) for c in live_cells()], cell_s=measure(10), load_s=0, slots=1)) == 1


def test_split_items_cuts_any_work_items_in_order_by_expected_seconds() -> None:
    # Items of any kind (a predicted plan's trace runs and probes among them): consecutive
    # pieces of about equal cost, order kept, never more pieces than asked.
    items = ["trace-t0", "trace-t1", "probe-c1", "probe-c2", "probe-c4", "probe-c8"]
    cost = {"trace-t0": 40.0, "trace-t1": 40.0}
    assert split_items(items, lambda i: cost.get(i, 10.0), 2) == [items[:2], items[2:]]
    assert split_items(items, lambda i: cost.get(i, 10.0), 3) == [items[:1], items[1:2], items[2:]]
    assert split_items(items, lambda _i: 1.0, 4) == [items[:2], items[2:3], items[3:5], items[5:]]
    assert split_items(items, lambda _i: 1.0, 10) == [[i] for i in items]
    assert split_items(items, lambda _i: 0.0, 3) == [items]  # nothing to balance: one piece
    assert split_items(items, lambda _i: 1.0, 1) == [items]


def test_the_dry_run_estimate_charges_each_slot_one_launch_and_its_share_of_learned_steps(tmp_path: Path) -> None:
    from ddtree_ops.bench.plan import SWITCH_S
    from ddtree_ops.bench.prepare import prepare_sweep
    from ddtree_ops.bench.sweep import parse_sweep
    from ddtree_ops.inventory import load_inventory
    from ddtree_ops.state import StateStore

    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"h": {"ansible_connection": "local", "ddtree": {
        "run_dir": str(tmp_path / "run"), "server": {"model_path": "m", "expected_load_s": 100, "port": 31000,
                                                     "slots": {"count": 4, "gpus_per_slot": 1}}}}}}}))
    host = load_inventory([inv]).hosts["h"]
    state = StateStore()
    for i in range(4):  # what each slot's last restart took
        state.record_load_time(f"h/{i}", "m", 10.0, restart_s=20.0 + i)
    for seconds in (0.01, 0.03):  # rows' seconds per decode step: a running mean per slot
        state.record_step_time("h/0", "m", seconds)
    state.record_step_time("h/1", "m", 0.04)
    assert state.learned_step_s("h/0", "m") == pytest.approx(0.02)
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    spec = parse_sweep({"name": "t", "targets": ["h"], "repeats": 1, "warmup": 0,
                        "grid": {"budget": [4, 8, 16, 32], "topk": [2, 4], "temperature": [0.0], "concurrency": [2]},
                        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 8, "max_new_tokens": 100}},
                       tmp_path / "s.yaml")
    prepared = prepare_sweep(spec, [host])
    [hp] = prepared.hosts
    # The slots' learned step times, averaged; none learned per concurrency (rows recorded
    # without one): every run is charged that mean.
    assert hp.step_s.default == pytest.approx(0.03) and hp.step_s.at(2) == pytest.approx(0.03)
    assert hp.launch_s == (20.0, 21.0, 22.0, 23.0)
    run_s = 4 * 100 * 0.03 + SWITCH_S  # 4 waves of 100 steps, and the live switch before it
    # One server: one launch, then all 8 trees.
    assert hp.estimate_s == pytest.approx(20.0 + 8 * run_s)
    # Four slots: each launches the same live server once and measures two trees.
    assert hp.schedule is not None
    placements = hp.schedule.placements
    assert [(p.slot.index, p.load_s, len(p.job.runs)) for p in placements] == [(i, 20.0 + i, 2) for i in range(4)]
    assert {p.job.launch for p in placements} == {prepared.plan.groups[0].launch}
    assert hp.schedule.wall_s == pytest.approx(23.0 + 2 * run_s)
    # The runner queues the same parts.
    assert {j.runs for j in prepared.jobs(hp, plan_runs(prepared.plan))} == {p.job.runs for p in placements}


def test_each_run_is_charged_the_learned_step_of_its_own_tree_and_concurrency(tmp_path: Path) -> None:
    # A wider batch's step takes longer, and so does a bigger tree's: one mean over the
    # last rows charged every row the step of whichever rows ran last (a dry run 2.7x the
    # measured grid's wall time, benchmarks/predict_plan.py; after a predicted run, which
    # measures the fastest trees, half of it). Each row is learned under its concurrency,
    # and its tree's there, too.
    from ddtree_ops.bench.plan import SWITCH_S, StepTimes
    from ddtree_ops.bench.prepare import prepare_sweep
    from ddtree_ops.bench.sweep import parse_sweep
    from ddtree_ops.inventory import load_inventory
    from ddtree_ops.state import StateStore

    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"hosts": {"h": {"ansible_connection": "local", "ddtree": {
        "run_dir": str(tmp_path / "run"), "server": {"model_path": "m", "expected_load_s": 10, "port": 31000}}}}}}))
    host = load_inventory([inv]).hosts["h"]
    state = StateStore()
    small, big = "ddtree-b4-topk2", "ddtree-b32-topk2"
    for _ in range(3):  # the c=16 rows last, as a repeat-major grid ends
        state.record_step_time("h", "m", 0.01, concurrency=2, server=small)
    state.record_step_time("h", "m", 0.03, concurrency=2, server=big)
    state.record_step_time("h", "m", 0.06, concurrency=16, server=small)
    assert state.learned_step_s("h", "m", concurrency=2, server=small) == pytest.approx(0.01)
    assert state.learned_step_s("h", "m", concurrency=2) == pytest.approx(0.015)  # both trees' rows there
    assert state.learned_step_s("h", "m", concurrency=16) == pytest.approx(0.06)
    assert state.learned_step_s("h", "m") == pytest.approx(0.024)  # every row, as before
    assert state.learned_steps("h", "m") == pytest.approx(
        {(2, None): 0.015, (2, small): 0.01, (2, big): 0.03, (16, None): 0.06, (16, small): 0.06})
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    spec = parse_sweep({"name": "t", "targets": ["h"], "repeats": 1, "warmup": 0,
                        "grid": {"budget": [4, 32], "topk": [2], "temperature": [0.0], "concurrency": [2, 8, 16]},
                        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 16, "max_new_tokens": 100}},
                       tmp_path / "s.yaml")
    prepared = prepare_sweep(spec, [host])
    [hp] = prepared.hosts
    steps = hp.step_s
    assert steps.at(2, small) == pytest.approx(0.01) and steps.at(16, small) == pytest.approx(0.06)
    # Concurrency 8 was never run here: between 2 and 16 in log(concurrency), 2/3 of the way.
    assert steps.at(8, small) == pytest.approx(0.01 + 0.05 * 2 / 3)
    # The big tree was run at 2 only: its own step at every concurrency.
    assert steps.at(16, big) == pytest.approx(0.03)
    # A tree never run here: every tree's steps at each concurrency.
    assert steps.at(2, "ddtree-b8-topk2") == pytest.approx(0.015)
    waves = {2: 8, 8: 2, 16: 1}
    runs = sum(waves[c] * 100 * steps.at(c, tree) for c in waves for tree in (small, big))
    assert hp.estimate_s == pytest.approx(10 + prepared.plan.switches * SWITCH_S + runs)
    # Outside the learned ones: the nearest; none learned: the default for every one.
    assert StepTimes(0.5, ((2, 0.01), (16, 0.06))).at(1) == 0.01
    assert StepTimes(0.5, ((2, 0.01), (16, 0.06))).at(64) == 0.06
    assert StepTimes(0.5).at(8, small) == 0.5


def test_a_launch_every_slot_serves_already_splits_for_free_and_is_measured_first() -> None:
    # A predicted sweep's measuring: the predict launch runs on both slots (kept servers),
    # its cells (2 repeats) beside a baseline's. Its parts load nothing, so it splits even
    # where that alone only moves work, which lets the baseline split too: each slot
    # measures a repeat of each, loading only the baseline.
    cells = live_cells(budgets=(4, 8), topks=(2,))
    live = cells[0].launch
    ar = Cell(ServerConfig("autoregressive"), Sampling(), 2)
    runs = [(c, r) for c in [ar, *cells] for r in range(2)]
    cost = {ar.key: 1.0} | {c.key: 2.0 for c in cells}
    jobs = make_jobs(runs, cell_s=lambda c: cost[c.key], load_s=2, slots=2, running=live)
    assert sorted((j.launch.algorithm, j.repeats) for j in jobs) == [
        ("autoregressive", (0,)), ("autoregressive", (1,)), ("ddtree", (0,)), ("ddtree", (1,))]
    s2 = slots(2)
    sched = schedule(jobs, s2, load_s=dict.fromkeys(s2, 2.0), running=dict.fromkeys(s2, live))
    assert [(p.slot.index, p.job.launch.algorithm, p.start_s, p.load_s) for p in sched.placements] == [
        (0, "ddtree", 0.0, 0.0), (1, "ddtree", 0.0, 0.0), (0, "autoregressive", 4.0, 2.0),
        (1, "autoregressive", 4.0, 2.0)]
    # Unknown to the split, the kept servers would leave one slot the whole live launch.
    assert len(make_jobs(runs, cell_s=lambda c: cost[c.key], load_s=2, slots=2)) == 2
    # One slot serving it: its job first, though not the longest, without a load.
    one = slots(1)
    order = schedule([Job(ar.launch, ((ar, 0),), 50.0), Job(live, ((cells[0], 0),), 1.0)], one,
                     load_s={one[0]: 2.0}, running={one[0]: live})
    assert [(p.job.launch, p.load_s) for p in order.placements] == [(live, 0.0), (ar.launch, 2.0)]
