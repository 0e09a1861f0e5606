"""``bench --predict`` on a simulated host (issue 43): round-time probes and trace runs on the
one live launch, every DDTree cell predicted into the ledger, only the top predicted cells
measured (plus the baselines); the report and tune keep predicted rows out of every
measured ranking."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from cli_json import json_data

from ddtree_ops.bench import ledger
from ddtree_ops.bench.lifetime import SweepOptions
from ddtree_ops.bench.plan import SWITCH_S, TRACE_STEP_FACTOR, Sampling, StepTimes
from ddtree_ops.bench.predictplan import (
    PredictPlan,
    ProbeRun,
    TraceRun,
    first_probe,
    plan_predict,
    predict_estimate,
    predict_phase_estimate,
    probe_warmup,
    split_work,
    trace_groups,
    warmup_seconds,
    work_seconds,
)
from ddtree_ops.bench.predictrun import HostPrediction, PredictPhase, chosen_cells, kept_servers, traces_dir
from ddtree_ops.bench.prepare import PreparedSweep, prepare_sweep
from ddtree_ops.bench.rows import launch_identity
from ddtree_ops.bench.runner import SweepOutcome, SweepRunner
from ddtree_ops.inventory import load_inventory
from ddtree_ops.predict.estimate import RoundTime, smooth_round_times
from ddtree_ops.predict.trace import load_trace_file, union_bound
from ddtree_ops.report.loading import load_ledgers
from ddtree_ops.state import StateStore
from ddtree_ops.workload.draw import build_workload

from .test_cli_bench import cli
from .test_live_sweep import host
from .test_runner import rows_of, stop_all, sweep
from .test_slots_sweep import assert_slots_stopped, write_inventory, write_sweep

GRID = {"algorithm": ["ddtree"], "budget": [4, 8, 16], "topk": [2, 4], "temperature": [0.0, 0.6],
        "concurrency": [2]}


def test_trace_groups_fit_the_largest_state_and_the_bound_is_the_bundles() -> None:
    from ddtree_ops.ddtree_core import load_ddtree_trace

    bundle = load_ddtree_trace()
    for grid in ([(4, 2), (16, 4)], [(256, 2), (256, 8), (64, 4)], [(3, 1), (40, 1), (8, 3)]):
        for block in (4, 16, 64):
            assert union_bound(grid, block) == bundle.union_bound(grid, block), (grid, block)
    trees = ((4, 2), (16, 2), (4, 4), (16, 4), (256, 8))
    assert trace_groups(trees, 16, 256) == (((4, 2), (4, 4), (16, 2), (16, 4)), ((256, 8),))
    assert all(union_bound(g, 16) <= 256 for g in trace_groups(trees, 16, 256))


def test_probes_run_once_per_verify_path_at_the_first_sampling_on_it(tmp_path: Path) -> None:
    # SGLang's branches: greedy when the temperature is 0 or top_k is 1; sampled otherwise,
    # with top-k / top-p filtering where they are on. The temperature's value is no branch.
    assert [Sampling(t, p, k).verify_path for t, p, k in (
        (0.0, 0.9, 20), (0.7, 1.0, 1), (0.7, 1.0, -1), (1.0, 1.0, 40), (1.0, 0.95, -1), (0.6, 0.9, 20))] == [
        "greedy", "greedy", "sampled", "sampled+top_k", "sampled+top_p", "sampled+top_k+top_p"]
    spec = sweep(tmp_path, grid={**GRID, "temperature": [0.0, 0.6, 1.0], "top_p": [1.0, 0.9]}, baselines=[],
                 predict={"top": 1})
    pplan = plan_predict(spec, prepare_sweep(spec, []).plan)
    assert pplan is not None and len(pplan.samplings) == 6
    assert pplan.probe_samplings == (Sampling(0.0, 0.9), Sampling(0.6, 0.9), Sampling(0.6, 1.0))
    assert len(pplan.probes) == 3 * 3 and {p.sampling for p in pplan.probes} == set(pplan.probe_samplings)


def predict_then_measure(prepared: PreparedSweep, out: Path) -> tuple[HostPrediction, SweepRunner, SweepOutcome]:
    """``bench --predict`` on the one host of ``prepared``: the predict phase (which must
    work), then the chosen cells measured on its servers; every server stopped after."""
    workload = build_workload(prepared.spec.workload)
    runner = SweepRunner(prepared, workload, ledger_path=out, options=SweepOptions())
    try:
        predicted = PredictPhase(prepared, workload, ledger_path=out, run_id=runner.run_id).run()
        (one,) = predicted.values()
        assert one.error is None, one.error
        runner.only, runner.kept = chosen_cells(predicted), kept_servers(predicted)
        return one, runner, runner.run()
    finally:
        stop_all([place for hp in prepared.hosts for place in hp.host.slot_hosts()])


@pytest.mark.slow
def test_a_predicted_sweep_writes_predicted_and_measured_rows_kept_apart(tmp_path: Path) -> None:
    h = host(tmp_path, "sim-h", "h200")
    spec = sweep(tmp_path, grid=GRID, baselines=["autoregressive"], predict={"top": 1, "probe_tokens": 8},
                 workload={"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 24})
    prepared = prepare_sweep(spec, [h])
    pplan = plan_predict(spec, prepared.plan)
    # Budget 16 at top-k 2 and 4 unite to 32 nodes, more than the grid's largest state: the
    # predict launch adds one of 32, and the whole grid is one trace run per temperature.
    assert pplan is not None and pplan.launch.budgets == (4, 8, 16, 32) and len(pplan.trace_groups) == 1
    # No trace run timed here yet: the dry run charges the step of the grid's slowest tree
    # at the trace concurrency x the factor (none learned here: every tree's is the default).
    [hp0] = prepared.hosts
    assert hp0.trace_step_s is None
    [trace_run] = [item for item in pplan.work if isinstance(item, TraceRun)][:1]
    assert work_seconds(pplan, trace_run, num_prompts=4, max_new_tokens=24, s_per_step=hp0.step_s) == pytest.approx(
        2 * SWITCH_S + math.ceil(4 / pplan.trace_concurrency) * 24 * hp0.step_s.at(pplan.trace_concurrency)
        * TRACE_STEP_FACTOR)
    out = tmp_path / "ledger.jsonl"
    _one, _runner, outcome = predict_then_measure(prepared, out)
    assert not outcome.failed
    # The trace runs' step time is learned apart from the runs': one record of the 2 trace
    # runs, one of the measured rows, and the next dry run charges a trace run the former.
    state = StateStore()
    traced = state.learned_step_s("sim-h", h.ddtree.server.model_path or "", trace=True)
    assert traced is not None
    assert prepare_sweep(spec, [h]).hosts[0].trace_step_s == pytest.approx(traced)
    records = json.loads(state.path.read_text())["step_times"]
    model = h.ddtree.server.model_path or ""
    # The DDTree model loaded once: the measuring launched only the baseline.
    assert [h.restarts for h in outcome.hosts] == [1]
    rows = rows_of(out)
    probes = [r for r in rows if r["source"] == "probe"]
    preds = [r for r in rows if r["source"] == "predicted"]
    measured = [r for r in rows if r["source"] in (None, "measured")]
    # A probe per verify path (T = 0 greedy, T = 0.6 sampled), concurrency and budget, each
    # at its path's sampling.
    assert sorted((r["temperature"], r["budget"], r["concurrency"]) for r in probes) == [
        (t, b, 2) for t in (0.0, 0.6) for b in (4, 8, 16)]
    assert all(r["round_ms"] > 0 and r["topk"] == 4 and r["gpu_name"] for r in probes)
    assert len(preds) == 12 and all(r["accept_length"] > 1 and r["output_tok_s"] > 0 for r in preds)
    # Each predicted cell's round time is its own path's probes, pooled (smooth_round_times).
    raw = [RoundTime(r["concurrency"], r["budget"], r["round_ms"] / 1000, r["overhead_ms"] / 1000,
                     r["cuda_graph"], Sampling(r["temperature"], r["top_p"], r["top_k"]).verify_path) for r in probes]
    pooled = smooth_round_times(raw)
    for r in preds:
        rt = pooled[(Sampling(r["temperature"], r["top_p"], r["top_k"]).verify_path, r["concurrency"], r["budget"])]
        assert (r["round_ms"], r["overhead_ms"]) == pytest.approx((rt.round_s * 1000, rt.overhead_s * 1000)), r
    assert {pooled[("greedy", 2, b)].round_s for b in (4, 8, 16)} != {pooled[("sampled", 2, b)].round_s
                                                                       for b in (4, 8, 16)}
    assert all(r["predicted_accept_naive"] is not None for r in preds)
    # top 1 per (temperature, concurrency): two DDTree cells measured, each the fastest
    # predicted, by the predict phase on its server: twice each (the measured phase's least
    # repeats; a lone candidate is decided then), though the sweep asks one repeat.
    ddtree = [r for r in measured if r["algorithm"] == "DDTREE"]
    assert prepared.plan.repeats == 1
    assert sorted((r["temperature"], r["repeat"]) for r in ddtree) == [(t, r) for t in (0.0, 0.6) for r in (0, 1)]
    assert len({(r["budget"], r["topk"], r["temperature"]) for r in ddtree}) == 2
    assert [(d.verdict.decided, d.verdict.why, d.verdict.repeats) for d in _one.decisions] == [(True, "ahead", 2)] * 2
    assert (_one.measured_ok, _one.measured_failed, _one.took) == (4, 0, 2)
    for r in ddtree:
        same = [p for p in preds if p["temperature"] == r["temperature"]]
        best = max(same, key=lambda p: p["output_tok_s"])
        assert (best["budget"], best["topk"]) == (r["budget"], r["topk"])
    assert [r["algorithm"] for r in measured if r["algorithm"] != "DDTREE"] == ["AR", "AR"]
    # ... and each measured row into its concurrency's record too (every row here at 2),
    # and its server configuration's there.
    by_server = Counter(f"sim-h|{model}|c2|{r['algorithm'].lower() if r['algorithm'] != 'AR' else 'autoregressive'}"
                        + (f"-b{r['budget']}-topk{r['topk']}" if r["algorithm"] == "DDTREE" else "") for r in measured)
    assert {k: v["rows"] for k, v in records.items()} == {f"sim-h|{model}|trace": 2, f"sim-h|{model}": len(measured),
                                                         f"sim-h|{model}|c2": len(measured), **by_server}
    # ... on the predict phase's server (its probes' launch id: the same process), whose
    # runtime states (with the union's 32) the measured rows' argv names.
    (launch_id,) = {r["launch_id"] for r in probes + preds + ddtree}
    assert launch_id not in {r["launch_id"] for r in measured if r["algorithm"] == "AR"}
    assert all(r["tree_switched"] is True and r["status"] == "ok" for r in ddtree)
    argv = ddtree[0]["server_argv"]
    states = json.loads((Path(h.ddtree.run_dir) / argv[argv.index("--speculative-adaptive-config") + 1]).read_text())
    assert states["ddtree"]["budgets"] == [4, 8, 16, 32]
    # Traces lie beside the ledger, loadable, never where the report reads ledgers.
    files = sorted(traces_dir(out).iterdir())
    assert len(files) == 2 and all(f.suffix == ".ndjson" for f in files)
    assert all(load_trace_file(f) for f in files)
    loaded = load_ledgers([out])
    assert loaded.bad_lines == ()
    assert loaded.predicted is not None and set(loaded.predicted["source"]) == {"predicted", "probe"}
    assert set(loaded.frame["source"].dropna()) <= {"measured"} and len(loaded.frame) == len(measured)

    # report: the measured cells ranked as ever, the predicted ones beside them, marked; tune:
    # chooses among measured cells, lists the predicted-only ones.
    report = json_data(_cli("report", str(out), "--json", "--min-repeats", "1"))
    assert len(report["cells"]) == 4  # two DDTree cells, AR at both temperatures
    assert {(c["budget"], c["topk"]) for c in report["best"] if c["algorithm"] == "DDTREE"} <= {
        (r["budget"], r["topk"]) for r in ddtree}
    assert len(report["predicted"]) == 12 and sum(p["measured"] for p in report["predicted"]) == 2
    assert len(report["probes"]) == 6 and {p["temperature"] for p in report["probes"]} == {0.0, 0.6}
    text = _cli("report", str(out), "--min-repeats", "1", env={"COLUMNS": "200"})
    assert "Predicted vs measured" in text and text.count("predicted only") == 10 + 1  # 10 cells, the title
    _cli("report", str(out), "--min-repeats", "1", "--plots", str(tmp_path / "plots"))
    assert [p.name for p in (tmp_path / "plots").glob("*predicted-vs-measured.png")] == [
        "nvidia-h200-simulated-predicted-vs-measured.png"]
    tuned = json_data(_cli("tune", str(out), "--json", "--min-repeats", "1"))
    (policy,) = tuned["policies"]
    assert len(tuned["predicted_only"]) == 5  # T = 0: six trees predicted, one measured
    measured_t0 = {(r["budget"], r["topk"]) for r in ddtree if r["temperature"] == 0.0}
    assert policy["entries"] and {(e["budget"], e["topk"]) for e in policy["entries"]} <= measured_t0, policy


@pytest.mark.slow
def test_with_gpu_slots_every_slot_predicts_its_share_and_measures_on_its_own_predict_launch(tmp_path: Path) -> None:
    inv, sweep_file = write_inventory(tmp_path), write_sweep(tmp_path)
    out = tmp_path / "ledger.jsonl"
    # The top 1 per concurrency: a lone candidate is decided at the measured phase's floor
    # (the sweep's 2 repeats), so the rows are known in advance.
    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep_file), "--predict-top", "1", "--out", str(out),
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [summary] = json_data(done.stdout)["hosts"]
    rows = ledger.read_ledger(out).rows
    probes = [r for r in rows if r["source"] == "probe"]
    measured = [r for r in rows if r["source"] in (None, "measured")]
    ddtree = [r for r in measured if r["algorithm"] == "DDTREE"]
    # Four probes (concurrency 1 and 2 x budget 4 and 8; of 24 tokens, the workload's, in as
    # many waves as a cell sends its 2 prompts: 2 at concurrency 1, 1 at 2) and one trace run
    # (a wave of 24 tokens) over two slots, longest first to the least loaded: the trace run
    # and a probe on slot 0 (its file named after the slot), three probes on slot 1.
    assert sorted(Counter(r["slot"] for r in probes).items()) == [(0, 1), (1, 3)]
    (trace_file,) = traces_dir(out).iterdir()
    assert "-sim-x_0-t0-" in trace_file.name
    # One DDTree cell per concurrency, measured twice (a pass each, split over both slots,
    # the second pass in the other order), each slot on the very server it probed on (its
    # launch id): no slot loaded the DDTree model twice, and the measuring launched only the
    # baseline, at most once per slot. The run's table counts the phase's rows as ok rows,
    # the other tree's as predicted only, none as resumed.
    cells = Counter((r["budget"], r["concurrency"]) for r in ddtree)
    assert sorted(c for _, c in cells) == [1, 2] and set(cells.values()) == {2}
    assert {r["status"] for r in ddtree} == {"ok"} and {r["slot"] for r in ddtree} == {0, 1}
    groups = json_data(done.stdout)["predicted"]["groups"]
    assert sorted(g["concurrency"] for g in groups) == [1, 2]
    for g in groups:
        assert g["chosen"] in ([4, 2], [8, 2]) and (g["repeats"], g["decided"], g["why"]) == (2, True, "ahead"), g
    chosen = json_data(done.stdout)["predicted"]["chosen"]
    assert [(c["repeats"], c["chosen"]) for c in chosen] == [(2, True)] * 2
    assert summary["ok_rows"] == len(measured) and summary["resumed"] == 0 and summary["predicted_only"] == 2 * 2
    for slot in (0, 1):
        (launch_id,) = {r["launch_id"] for r in probes if r["slot"] == slot}
        assert {r["launch_id"] for r in ddtree if r["slot"] == slot} == {launch_id}
    baseline_launches = {(r["slot"], r["launch_id"]) for r in measured if r["algorithm"] == "AR"}
    assert summary["restarts"] == len(baseline_launches) <= 2 and summary["failed_rows"] == 0
    # Both slots' servers were stopped at the end, the handed-over ones too (no --keep-server).
    assert_slots_stopped(inv)


@pytest.mark.slow
def test_with_gpu_slots_trace_runs_split_over_the_slots_as_planned_and_each_kept_server_is_adopted(
        tmp_path: Path) -> None:
    write_sweep(tmp_path)  # its prompts
    h = load_inventory([write_inventory(tmp_path)]).hosts["sim-x"]
    # Two sampled temperatures: one verify path, probed once per budget.
    spec = sweep(tmp_path, grid={**GRID, "budget": [4, 8], "topk": [2], "temperature": [0.6, 1.0]}, baselines=[],
                 predict={"top": 1, "probe_tokens": 8, "trace_concurrency": 1},
                 workload={"prompt_files": ["p.jsonl"], "num_prompts": 2, "max_new_tokens": 24})
    prepared = prepare_sweep(spec, [h])
    [hp] = prepared.hosts
    pplan = plan_predict(spec, prepared.plan)
    assert pplan is not None and pplan.probe_samplings == (Sampling(0.6),)
    # Two probes, then a trace run per temperature (as many as the slots: none cut in parts),
    # each longer than a probe: longest first, each slot a trace run and a probe.
    shares = split_work(pplan, 2, num_prompts=2, max_new_tokens=24, s_per_step=hp.step_s,
                        trace_s_per_step=hp.trace_step_s)
    assert [[type(i).__name__ for i in share] for share in shares] == [["ProbeRun", "TraceRun"]] * 2
    out = tmp_path / "ledger.jsonl"
    one, runner, outcome = predict_then_measure(prepared, out)
    assert not outcome.failed
    # Each slot ran its share: a probe and a trace file from each slot.
    rows = rows_of(out)
    assert {(r["slot"], r["budget"]) for r in rows if r["source"] == "probe"} == {(0, 4), (1, 8)}
    names = {f.name for f in one.traces}
    assert names == {f"{runner.run_id}-sim-x_{slot}-{item.sampling.key}-g0.ndjson"
                     for slot, share in enumerate(shares) for item in share if isinstance(item, TraceRun)}
    assert all(load_trace_file(f) for f in one.traces) and len(one.traces) == 2
    # Every slot measured its share of the chosen cells (top 1 per temperature, each twice:
    # a pass's runs split over the slots, every other pass in the other order) on its own
    # predict launch, then handed its server over: the measuring launched nothing.
    assert [k.place for k in one.kept] == ["sim-x/0", "sim-x/1"]
    measured = [r for r in rows if r["source"] in (None, "measured")]
    for slot, kept in enumerate(one.kept):
        mine = [r for r in measured if r["slot"] == slot]
        assert len(mine) == 2 and {r["launch_id"] for r in mine} == {launch_identity(kept.restart)[1]}, (slot, mine)
        assert {r["temperature"] for r in mine} == {0.6, 1.0}
    assert one.measured_ok == 4 and outcome.hosts[0].restarts == 0 and outcome.hosts[0].ok_rows == 0


@pytest.mark.slow
def test_a_kept_server_replaced_between_the_phases_is_launched_again_not_measured(tmp_path: Path) -> None:
    h = host(tmp_path, "sim-r", "h200")
    spec = sweep(tmp_path, grid={**GRID, "budget": [4], "temperature": [0.0]}, baselines=[],
                 predict={"top": 1, "probe_tokens": 8},
                 workload={"prompt_files": ["p.jsonl"], "num_prompts": 2, "max_new_tokens": 24})
    prepared = prepare_sweep(spec, [h])
    workload = build_workload(spec.workload)
    out = tmp_path / "ledger.jsonl"
    runner = SweepRunner(prepared, workload, ledger_path=out)
    try:
        predicted = PredictPhase(prepared, workload, ledger_path=out, run_id=runner.run_id).run()
        ((kept,),) = kept_servers(predicted).values()
        stop_all([h])  # as `ddtree-ops stop` would, while no sweep holds the host
        # A caller that has the runner measure the chosen cell on the kept server (the
        # predict phase measured it already, on that server, before handing it over).
        (one,) = predicted.values()
        assert one.chosen is not None and chosen_cells(predicted) == {"sim-r": frozenset()}
        runner.only, runner.kept = {"sim-r": one.chosen}, kept_servers(predicted)
        outcome = runner.run()
    finally:
        stop_all([h])
    assert [(s.restarts, s.ok_rows, s.failed_rows) for s in outcome.hosts] == [(1, 1, 0)]
    rows = rows_of(out)
    (probe_launch,) = {r["launch_id"] for r in rows if r["source"] == "probe"}
    assert len([r for r in rows if r["source"] in (None, "measured") and r["launch_id"] == probe_launch]) == 2
    (row,) = [r for r in rows if r["source"] in (None, "measured") and r["launch_id"] != probe_launch]
    # A new process of the same launch (the predict phase's states): its own launch id.
    assert row["launch_id"] != probe_launch and row["server_argv"] == list(kept.restart.argv)


def test_the_predicted_plans_estimate_loads_the_ddtree_model_once(tmp_path: Path) -> None:
    spec = sweep(tmp_path, grid=GRID, baselines=["autoregressive", "dflash"], predict={"top": 1})
    plan = prepare_sweep(spec, []).plan
    pplan = plan_predict(spec, plan)
    assert pplan is not None

    def estimate(load_s: float) -> float:
        return predict_estimate(pplan, plan, load_s=load_s, num_prompts=4, max_new_tokens=16)

    # One load per baseline launch (AR, DFlash chains of 5, 9 and 16) and one for DDTree,
    # whose measured cells run on the predict phase's launch.
    baselines = {c.launch for c in plan.cells if c.baseline}
    assert len(baselines) == 4
    assert estimate(100.0) - estimate(0.0) == pytest.approx(100.0 * (len(baselines) + 1))


def test_the_predict_phase_splits_over_the_slots_and_its_estimate_is_the_longest_share(tmp_path: Path) -> None:
    # Two sampled temperatures: one verify path, one probe per budget.
    spec = sweep(tmp_path, grid={**GRID, "temperature": [0.6, 1.0]}, baselines=[],
                 predict={"top": 1, "probe_tokens": 8},
                 workload={"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 24})
    plan = prepare_sweep(spec, []).plan
    pplan = plan_predict(spec, plan)
    assert pplan is not None
    step, trace_step = 0.01, 0.02  # a run's step; a trace run's (learned: a round per token)
    probes = [ProbeRun(2, b, Sampling(0.6)) for b in (4, 8, 16)]
    traces = [TraceRun(s, 0) for s in pplan.samplings]
    assert pplan.work == (*probes, *traces)
    # A probe: a switch and 2 waves of 8 tokens (probe_waves 4, but no more requests than a
    # cell at concurrency 2 sends: 4 prompts); a trace run: the workload once at concurrency
    # 2 (2 waves of 24 steps, at the trace's step time) between two switches; a measured cell:
    # the same waves at a run's step time after its switch.
    assert pplan.probe_waves(2) == 2 and pplan.probe_waves(1) == 4 and pplan.probe_tokens == 8
    probe_s, trace_s, run_s = SWITCH_S + 2 * 8 * step, 2 * SWITCH_S + 2 * 24 * trace_step, SWITCH_S + 2 * 24 * step

    def split(slots: int) -> tuple[tuple[object, ...], ...]:
        return split_work(pplan, slots, num_prompts=4, max_new_tokens=24, s_per_step=step,
                          trace_s_per_step=trace_step)

    def estimate(load_s: float | tuple[float, ...]) -> float:
        return predict_estimate(pplan, plan, load_s=load_s, num_prompts=4, max_new_tokens=24, s_per_step=step,
                                trace_s_per_step=trace_step)

    # No trace run timed on the host yet: a run's step x TRACE_STEP_FACTOR; where the host
    # learned its trees' steps, the slowest tree's at the trace concurrency (2 here), and a
    # probe its own budget's tree at the launch's largest top-k (4).
    assert work_seconds(pplan, traces[0], num_prompts=4, max_new_tokens=24, s_per_step=step) == pytest.approx(
        2 * SWITCH_S + 2 * 24 * step * TRACE_STEP_FACTOR)
    learned = StepTimes(step, ((2, step),), (("ddtree-b16-topk2", 2, 0.05), ("ddtree-b8-topk4", 2, 0.03),
                                             ("ddtree-b16-topk2", 8, 0.5)))
    assert work_seconds(pplan, traces[0], num_prompts=4, max_new_tokens=24, s_per_step=learned) == pytest.approx(
        2 * SWITCH_S + 2 * 24 * 0.05 * TRACE_STEP_FACTOR)
    assert work_seconds(pplan, probes[1], num_prompts=4, max_new_tokens=24, s_per_step=learned) == pytest.approx(
        SWITCH_S + 2 * 8 * 0.03)

    # One slot: everything in the plan's order. Two: longest first, each to the least loaded
    # share (ties to the first), a share in the plan's order.
    assert split(1) == (pplan.work,)
    assert split(2) == ((probes[0], probes[2], traces[0]), (probes[1], traces[1]))
    # One server: everything in a row, the load once. Two slots: the longest share, the load
    # once (in parallel), then the two measured cells (top 1 per temperature), each the
    # measured phase's least repeats (2: the sweep asks 1), split over the slots, on the
    # predict launch each slot still serves.
    assert estimate(0.0) == pytest.approx(3 * probe_s + 2 * trace_s + 2 * 2 * run_s)
    assert estimate((0.0, 0.0)) == pytest.approx(2 * probe_s + trace_s + 2 * run_s)
    for loads in ((100.0,), (100.0, 100.0), (100.0,) * 4):
        zero = estimate(tuple(0.0 for _ in loads))
        assert estimate(loads) - zero == pytest.approx(100.0), loads
    # Four slots: a trace run could be cut in two parts (2 prompts each, the trace
    # concurrency), but each part pays two switches: 1.48 s a part beside 0.82 s a probe is a
    # longest share of 2.30 s against 1.96 s whole. Whole runs, each on a slot of its own.
    part_s = 2 * SWITCH_S + 1 * 24 * trace_step
    assert 2 * part_s > trace_s and part_s + probe_s > trace_s
    assert split(4) == ((traces[0],), (traces[1],), (probes[0], probes[2]), (probes[1],))
    assert estimate((0.0,) * 4) == pytest.approx(max(trace_s, 2 * probe_s) + run_s)
    assert math.isclose(estimate(7.0), estimate((7.0,)))
    # Eight slots: in parts, every item on a slot of its own; the slot left over is last.
    parts = [TraceRun(t.sampling, 0, i, 2) for t in traces for i in range(2)]
    assert split(8) == (*((p,) for p in parts), *((p,) for p in probes), ())
    assert {t.prompts(4) for t in parts} == {range(0, 4, 2), range(1, 4, 2)}
    # Sixteen prompts (8 waves a trace run): parts pay off on four slots, 2.92 s a part and a
    # probe beside three of them, against 4.84 s a whole run.
    long = split_work(pplan, 4, num_prompts=16, max_new_tokens=24, s_per_step=step, trace_s_per_step=trace_step)
    assert long == ((probes[0], parts[0]), (probes[1], parts[1]), (probes[2], parts[2]), (parts[3],))


def test_each_places_first_probe_sends_the_sweeps_warmup_first_and_the_dry_run_charges_it(tmp_path: Path) -> None:
    """Without a warmup the first probe, the first load on a freshly launched server,
    measured its rounds 8-16 % slower than the next budget's on the real CPU server."""
    def plan_of(warmup: int) -> tuple[PredictPhase, PredictPlan]:
        spec = sweep(tmp_path, grid={**GRID, "temperature": [0.6]}, baselines=[], warmup=warmup,
                     predict={"top": 1, "probe_tokens": 8},
                     workload={"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": 24})
        prepared = prepare_sweep(spec, [])
        pplan = plan_predict(spec, prepared.plan)
        assert pplan is not None
        return PredictPhase(prepared, build_workload(spec.workload), ledger_path=tmp_path / "l.jsonl",
                            run_id="t"), pplan

    step = 0.01
    probes = [ProbeRun(2, b, Sampling(0.6)) for b in (4, 8, 16)]
    traces = [TraceRun(Sampling(0.6), 0)]
    for warmup in (0, 2):
        phase, pplan = plan_of(warmup)
        # Two slots: the trace run on one, the three probes on the other, whose first probe
        # alone is warmed; a share without a probe warms nothing.
        shares = split_work(pplan, 2, num_prompts=4, max_new_tokens=24, s_per_step=step)
        assert shares == ((*traces,), (*probes,))
        assert [first_probe(share) for share in shares] == [None, probes[0]]
        assert [probe_warmup(pplan, shares[1], p) for p in probes] == [warmup, 0, 0]
        load = phase.probe_load(phase.workload.prompts, pplan, probes[1], warmup=warmup)
        # Two waves at concurrency 2 (no more requests than the workload's 4), the probe's
        # tokens and sampling, the warmup requests before them (the client sends them first
        # and reports only the rest: tests/bench/test_client.py).
        assert (load.warmup, len(load.prompts), load.concurrency, load.max_new_tokens) == (warmup, 4, 2, 8)
        assert load.sampling == Sampling(0.6).as_params()
        # The dry run charges the warmup as one more wave of the probe's tokens, as a cell's.
        assert warmup_seconds(pplan, shares[1], s_per_step=step) == pytest.approx(8 * step if warmup else 0.0)
        assert warmup_seconds(pplan, shares[0], s_per_step=step) == 0.0
        items = sum(work_seconds(pplan, i, num_prompts=4, max_new_tokens=24, s_per_step=step) for i in shares[0])
        items1 = sum(work_seconds(pplan, i, num_prompts=4, max_new_tokens=24, s_per_step=step) for i in shares[1])
        assert predict_phase_estimate(pplan, load_s=[1.0, 1.0], num_prompts=4, max_new_tokens=24,
                                      s_per_step=step) == pytest.approx(
            1.0 + max(items + warmup_seconds(pplan, shares[0], s_per_step=step),
                      items1 + warmup_seconds(pplan, shares[1], s_per_step=step)))


def test_dry_run_with_gpu_slots_compares_the_predicted_plans_wall_time_with_the_slot_schedule(tmp_path: Path) -> None:
    inv, sweep_file = write_inventory(tmp_path), write_sweep(tmp_path)
    # Eight trees, the top one measured: a grid worth predicting.
    doc = yaml.safe_load(sweep_file.read_text())
    doc["grid"] |= {"budget": [4, 8, 16, 32], "topk": [2, 4]}
    doc |= {"predict": {"top": 1, "probe_tokens": 8}, "workload": {**doc["workload"], "max_new_tokens": 256}}
    sweep_file.write_text(yaml.safe_dump(doc))
    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep_file), "--predict", "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json_data(done.stdout)
    predict = data["predict"]
    assert predict["slots"] == {"sim-x": 2}
    assert predict["full_grid_estimated_s"]["sim-x"] == data["slot_schedules"]["sim-x"]["wall_s"]
    assert 0 < predict["estimated_s"]["sim-x"] < predict["full_grid_estimated_s"]["sim-x"]
    text = cli("-i", str(inv), "bench", "--sweep", str(sweep_file), "--predict", "--dry-run", cwd=tmp_path)
    assert "sim-x: predicted plan" in text.stdout and "of wall time on 2 GPU slots against" in text.stdout


def _cli(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "ddtree_ops", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_dry_run_shows_the_predicted_plans_gpu_time_beside_the_full_grids() -> None:
    repo = Path(__file__).resolve().parents[2]
    out = json_data(_cli("-i", str(repo / "inventories" / "local.yaml"), "bench", "--sweep",
                         str(repo / "bench_configs" / "budgets_predicted.yaml"), "all", "--dry-run", "--json"))
    predict = out["predict"]
    assert predict["top"] == 3 and predict["measured_ddtree_cells_per_host"] == 27
    # Budget 256 at three top-ks unites to more than the 256 nodes the bundle serves: one trace
    # run per top-k and temperature.
    assert predict["trace_runs_per_host"] == 9 and len(predict["trace_groups"]) == 3
    for name, seconds in predict["estimated_s"].items():
        assert 0 < seconds < predict["full_grid_estimated_s"][name]
    text = _cli("-i", str(repo / "inventories" / "local.yaml"), "bench", "--sweep",
                str(repo / "bench_configs" / "demo.yaml"), "--predict", "--dry-run", env={"COLUMNS": "200"})
    assert "predicted plan" in text and "of GPU time against" in text and "for the full grid" in text


@pytest.mark.slow
def test_responses_too_short_to_walk_fail_the_predict_phase_and_the_host_is_measured_in_full(tmp_path: Path) -> None:
    """The walk needs more traced positions per response than the draft block is deep (16 on
    the simulator): 8-token responses cannot be predicted, so the host says why and its
    cells are measured in full, never guessed; the trace ran at predict.trace_concurrency."""
    h = host(tmp_path, "sim-s", "h200")
    spec = sweep(tmp_path, grid={**GRID, "budget": [4], "temperature": [0.0]}, baselines=[],
                 predict={"top": 1, "probe_tokens": 8, "trace_concurrency": 1},
                 workload={"prompt_files": ["p.jsonl"], "num_prompts": 2, "max_new_tokens": 8})
    prepared = prepare_sweep(spec, [h])
    pplan = plan_predict(spec, prepared.plan)
    assert pplan is not None and pplan.trace_concurrency == 1 and max(pplan.concurrencies) == 2
    workload = build_workload(spec.workload)
    out = tmp_path / "ledger.jsonl"
    runner = SweepRunner(prepared, workload, ledger_path=out)
    try:
        predicted = PredictPhase(prepared, workload, ledger_path=out, run_id=runner.run_id).run()
        (one,) = predicted.values()
        assert one.chosen is None and one.kept == ()
        assert one.error is not None and "too short to walk" in one.error and "measuring every cell" in one.error
        runner.only, runner.kept = chosen_cells(predicted), kept_servers(predicted)
        outcome = runner.run()
    finally:
        stop_all([h])
    measured = [r for r in rows_of(out) if r["source"] in (None, "measured")]
    assert not outcome.failed and len(measured) == 2  # both top-ks of the one budget


@pytest.mark.slow
def test_with_gpu_slots_a_failed_predict_phase_stops_every_slots_server(tmp_path: Path) -> None:
    """Responses too short to walk fail the phase once both slots have run their share:
    no server is handed over, both are stopped before the host is measured in full."""
    write_sweep(tmp_path)  # its prompts
    inv = write_inventory(tmp_path)
    h = load_inventory([inv]).hosts["sim-x"]
    spec = sweep(tmp_path, grid={**GRID, "budget": [4, 8], "topk": [2], "temperature": [0.6, 1.0]}, baselines=[],
                 predict={"top": 1, "probe_tokens": 8, "trace_concurrency": 1},
                 workload={"prompt_files": ["p.jsonl"], "num_prompts": 2, "max_new_tokens": 8})
    prepared = prepare_sweep(spec, [h])
    workload = build_workload(spec.workload)
    out = tmp_path / "ledger.jsonl"
    try:
        (one,) = PredictPhase(prepared, workload, ledger_path=out, run_id="r").run().values()
        assert one.chosen is None and one.kept == () and "too short to walk" in (one.error or "")
        # Both slots ran their share (a probe and a short trace run each).
        assert sorted(r["slot"] for r in rows_of(out) if r["source"] == "probe") == [0, 1]
        assert sorted(f.name.split("-sim-x_")[1][0] for f in traces_dir(out).iterdir()) == ["0", "1"]
        assert_slots_stopped(inv)
    finally:
        stop_all(list(h.slot_hosts()))
