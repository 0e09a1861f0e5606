"""``bench --predict`` on a simulated host (issue 43): round-time probes and trace runs on the
one live launch, every DDTree cell predicted into the ledger, only the top predicted cells
measured (plus the baselines); the report and tune keep predicted rows out of every
measured ranking."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_json import json_data

from ddtree_ops.bench import ledger
from ddtree_ops.bench.lifetime import SweepOptions
from ddtree_ops.bench.predictplan import plan_predict, predict_estimate, trace_groups
from ddtree_ops.bench.predictrun import PredictPhase, chosen_cells, kept_servers, traces_dir
from ddtree_ops.bench.prepare import prepare_sweep
from ddtree_ops.bench.runner import SweepRunner
from ddtree_ops.predict.trace import load_trace_file, union_bound
from ddtree_ops.report.loading import load_ledgers
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
    full = prepared.hosts[0].estimate_s
    assert predict_estimate(pplan, prepared.plan, load_s=2.0, num_prompts=4, max_new_tokens=24) < full
    workload = build_workload(spec.workload)
    out = tmp_path / "ledger.jsonl"
    runner = SweepRunner(prepared, workload, ledger_path=out, options=SweepOptions())
    try:
        predicted = PredictPhase(prepared, workload, ledger_path=out, run_id=runner.run_id).run()
        (one,) = predicted.values()
        assert one.error is None, one.error
        runner.only, runner.kept = chosen_cells(predicted), kept_servers(predicted)
        outcome = runner.run()
    finally:
        stop_all([h])
    assert not outcome.failed
    # The DDTree model loaded once: the measuring launched only the baseline.
    assert [h.restarts for h in outcome.hosts] == [1]
    rows = rows_of(out)
    probes = [r for r in rows if r["source"] == "probe"]
    preds = [r for r in rows if r["source"] == "predicted"]
    measured = [r for r in rows if r["source"] in (None, "measured")]
    assert {(r["budget"], r["concurrency"]) for r in probes} == {(4, 2), (8, 2), (16, 2)}
    assert all(r["round_ms"] > 0 and r["topk"] == 4 and r["gpu_name"] for r in probes)
    assert len(preds) == 12 and all(r["accept_length"] > 1 and r["output_tok_s"] > 0 for r in preds)
    assert all(r["predicted_accept_naive"] is not None for r in preds)
    # top 1 per (temperature, concurrency): two DDTree cells measured, each the fastest predicted.
    ddtree = [r for r in measured if r["algorithm"] == "DDTREE"]
    assert len(ddtree) == 2 and {r["temperature"] for r in ddtree} == {0.0, 0.6}
    for r in ddtree:
        same = [p for p in preds if p["temperature"] == r["temperature"]]
        best = max(same, key=lambda p: p["output_tok_s"])
        assert (best["budget"], best["topk"]) == (r["budget"], r["topk"])
    assert [r["algorithm"] for r in measured if r["algorithm"] != "DDTREE"] == ["AR", "AR"]
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
    assert len(report["cells"]) == len(measured)
    assert {(c["budget"], c["topk"]) for c in report["best"] if c["algorithm"] == "DDTREE"} <= {
        (r["budget"], r["topk"]) for r in ddtree}
    assert len(report["predicted"]) == 12 and sum(p["measured"] for p in report["predicted"]) == 2
    assert len(report["probes"]) == 3
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
def test_with_gpu_slots_the_predict_phases_slot_measures_on_its_server_and_the_other_loads_once(
        tmp_path: Path) -> None:
    inv, sweep_file = write_inventory(tmp_path), write_sweep(tmp_path)
    out = tmp_path / "ledger.jsonl"
    done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep_file), "--predict", "--out", str(out),
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [summary] = json_data(done.stdout)["hosts"]
    rows = ledger.read_ledger(out).rows
    probes = [r for r in rows if r["source"] == "probe"]
    ddtree = [r for r in rows if r["source"] in (None, "measured") and r["algorithm"] == "DDTREE"]
    # Both trees are in the top 3: every DDTree cell measured, split by repeat over the slots.
    assert len(ddtree) == 8 and {r["status"] for r in ddtree} == {"ok"} and {r["slot"] for r in ddtree} == {0, 1}
    # The predict phase ran on slot 0, which measures its DDTree share on that very server;
    # slot 1 loads the same launch once for its share. Every slot launches a launch at most
    # once, and the kept server is no launch of the measuring's.
    assert {r["slot"] for r in probes} == {0}
    (predict_launch,) = {r["launch_id"] for r in probes}
    assert {r["launch_id"] for r in ddtree if r["slot"] == 0} == {predict_launch}
    assert len({r["launch_id"] for r in ddtree if r["slot"] == 1} - {predict_launch}) == 1
    measured = [r for r in rows if r["source"] in (None, "measured")]
    launches = {(r["slot"], r["launch_id"]) for r in measured}
    assert len(launches) == len({(r["slot"], r["algorithm"]) for r in measured})
    assert summary["restarts"] == len(launches) - 1 and summary["failed_rows"] == 0
    # Both slots' servers were stopped at the end, the handed-over one too (no --keep-server).
    assert_slots_stopped(inv)


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
        (kept,) = kept_servers(predicted).values()
        stop_all([h])  # as `ddtree-ops stop` would, while no sweep holds the host
        runner.only, runner.kept = chosen_cells(predicted), kept_servers(predicted)
        outcome = runner.run()
    finally:
        stop_all([h])
    assert [(s.restarts, s.ok_rows, s.failed_rows) for s in outcome.hosts] == [(1, 1, 0)]
    rows = rows_of(out)
    (probe_launch,) = {r["launch_id"] for r in rows if r["source"] == "probe"}
    (row,) = [r for r in rows if r["source"] in (None, "measured")]
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
        assert one.chosen is None and one.kept is None
        assert one.error is not None and "too short to walk" in one.error and "measuring every cell" in one.error
        runner.only, runner.kept = chosen_cells(predicted), kept_servers(predicted)
        outcome = runner.run()
    finally:
        stop_all([h])
    measured = [r for r in rows_of(out) if r["source"] in (None, "measured")]
    assert not outcome.failed and len(measured) == 2  # both top-ks of the one budget
