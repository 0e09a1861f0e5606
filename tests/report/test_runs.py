"""Runs are never pooled silently: two runs of one sweep are shown apart (each its own cells,
baselines and best pick), pooled only with ``--pool-runs`` (and said), and a run continued
by ``bench --resume`` is one run. ``tune`` refuses a machine type's cells of two runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from cli_json import json_data
from report_rows import make_row

from ddtree_ops import report as rep
from ddtree_ops.bench.ledger import append_row
from ddtree_ops.errors import ConfigError
from ddtree_ops.report.categories import category_table
from ddtree_ops.report.policy import tune_ledgers

B300 = "NVIDIA B300 SXM6 AC"
RUN_A, RUN_B = "20261201T100000-aaaaaa", "20261202T100000-bbbbbb"
START_A, START_B = "2026-12-01T10:00:00Z", "2026-12-02T10:00:00Z"


def _row(run_id: str, started: str, **kw: Any) -> dict[str, Any]:
    return make_row(gpu_name=B300, host=kw.pop("host", "b300-a"), run_id=run_id, sweep_hash="s1",
                    started_at=started, **kw)


def _run(run_id: str, started: str, ddtree: float, *, repeats: range = range(3)) -> list[dict[str, Any]]:
    """One run of the sweep: AR at ~200 tok/s, DDTREE b=8 k=4 at ~``ddtree``, ``repeats``."""
    rows = []
    for r in repeats:
        rows += [_row(run_id, started, algorithm="AR", repeat=r, output_tok_s=200.0 + r - 1),
                 _row(run_id, started, budget=8, repeat=r, output_tok_s=ddtree + 2 * (r - 1))]
    return rows


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    for row in rows:
        append_row(path, row)
    return path


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    """A results folder with two runs of one sweep on one B300: DDTREE at ~400 tok/s the
    first day, ~220 the next (AR ~200 both days). Pooled, DDTREE's six repeats spread over
    both days (median 310, MAD 90) and AR wins; apart, DDTREE wins each run."""
    results = tmp_path / "results"
    results.mkdir()
    _write(results / "first.jsonl", _run(RUN_A, START_A, 400.0))
    _write(results / "second.jsonl", _run(RUN_B, START_B, 220.0))
    return results


def _ddtree(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["algorithm"] == "DDTREE"]


def test_two_runs_of_one_sweep_are_shown_apart_each_with_its_own_cells_and_pick(two_runs: Path) -> None:
    r = rep.build_report([two_runs], min_repeats=3)
    assert [run.run for run in r.loaded.runs] == [RUN_A, RUN_B]
    assert r.loaded.runs[0].label == f"run {RUN_A} ({START_A})" and not r.pooled_runs
    assert r.runs_apart() == {B300: [RUN_A, RUN_B]}
    cells = _ddtree(r.grouped).set_index("run")
    # One cell per run, its own three repeats, its own spread and its own run's AR baseline.
    assert list(cells["n"]) == [3, 3] and list(cells["output_tok_s_median"]) == [400.0, 220.0]
    assert list(cells["output_tok_s_mad"]) == [2.0, 2.0]
    assert cells.loc[RUN_A, "speedup_vs_ar"] == pytest.approx(2.0)
    assert cells.loc[RUN_B, "speedup_vs_ar"] == pytest.approx(1.1)
    best = r.best.best.set_index("run")
    assert list(best.index) == [RUN_A, RUN_B] and list(best["algorithm"]) == ["DDTREE", "DDTREE"]


def test_pool_runs_pools_them_as_repeats_and_says_so(two_runs: Path) -> None:
    r = rep.build_report([two_runs], min_repeats=3, pool_runs=True)
    assert r.pooled_runs and r.runs_apart() == {}
    cell = _ddtree(r.grouped).iloc[0]
    assert len(_ddtree(r.grouped)) == 1 and cell["run"] is None
    assert (cell["n"], cell["output_tok_s_median"], cell["output_tok_s_mad"]) == (6, 310.0, 90.0)
    # Why pooling is never silent: the two days' difference reads as noise and the pick flips.
    (pick,) = r.best.best.to_dict("records")
    assert pick["algorithm"] == "AR" and pick["run"] is None


def test_the_report_names_each_run_or_says_it_pooled_them(two_runs: Path, cli: Callable[..., Any]) -> None:
    apart = cli("report", str(two_runs))
    assert apart.exit_code == 0, apart.stderr
    text = " ".join(apart.stdout.split())
    assert f"2 runs in these ledgers; several measured {B300.removeprefix('NVIDIA ')}: each run is shown apart" in text
    assert "--pool-runs pools them as repeats" in text
    for run_id, started in ((RUN_A, START_A), (RUN_B, START_B)):
        assert f"Best configuration — B300 SXM6 AC — run {run_id} ({started})" in text
        assert f"Cells — b300-a — run {run_id} ({started})" in text
    pooled = cli("report", str(two_runs), "--pool-runs")
    assert pooled.exit_code == 0, pooled.stderr
    text = " ".join(pooled.stdout.split())
    assert "Pooled 2 runs as repeats of their cells (--pool-runs):" in text
    assert f"run {RUN_A} ({START_A}); sweep test; 6 row(s); hosts b300-a" in text
    assert "These picks pool 2 runs as repeats of one cell (--pool-runs" in text
    assert "Best configuration — B300 SXM6 AC " in text and "— run " not in text
    data = json_data(cli("--json", "report", str(two_runs), "--pool-runs").stdout)
    assert data["pool_runs"] is True and [r["run"] for r in data["runs"]] == [RUN_A, RUN_B]
    assert {c["run"] for c in data["cells"]} == {None} and data["runs_apart"] == {}
    data = json_data(cli("--json", "report", str(two_runs)).stdout)
    assert data["pool_runs"] is False and data["runs_apart"] == {B300: [RUN_A, RUN_B]}
    assert sorted(b["run"] for b in data["best"]) == [RUN_A, RUN_B]


def test_run_keeps_one_run_and_an_unknown_run_is_one_line(two_runs: Path, cli: Callable[..., Any]) -> None:
    r = rep.build_report([two_runs], min_repeats=3, runs=[RUN_B])
    assert [run.run for run in r.loaded.runs] == [RUN_B] and set(r.tidy["run"]) == {RUN_B}
    bad = cli("report", str(two_runs), "--run", "nosuch")
    assert bad.exit_code == 2 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0
    assert f"--run nosuch: no such run in these ledgers (runs: run {RUN_A} ({START_A}), run {RUN_B}" in bad.stderr


def test_a_plain_rerun_into_the_same_ledger_is_a_second_run(tmp_path: Path) -> None:
    # `bench` twice without --resume appends to results/<sweep>.jsonl: it starts over at repeat 0.
    ledger = _write(tmp_path / "test.jsonl", _run(RUN_A, START_A, 400.0) + _run(RUN_B, START_B, 220.0))
    loaded = rep.load_ledgers([ledger])
    assert [(run.run, run.run_ids, run.rows) for run in loaded.runs] == [(RUN_A, (RUN_A,), 6), (RUN_B, (RUN_B,), 6)]


def test_a_resumed_run_is_one_run(tmp_path: Path) -> None:
    # The first invocation measured repeat 0 and AR of repeat 1, and its DDTREE repeat 1
    # failed; `bench --resume` (a run_id of its own) retried that row and ran repeat 2.
    first = _run(RUN_A, START_A, 400.0, repeats=range(1))
    first += [_row(RUN_A, START_A, algorithm="AR", repeat=1, output_tok_s=200.0),
              _row(RUN_A, START_A, budget=8, repeat=1, status="failed")]
    resumed = "20261201T120000-cccccc"
    later = "2026-12-01T12:00:00Z"
    second = [_row(resumed, later, budget=8, repeat=1, output_tok_s=400.0)] + _run(resumed, later, 400.0,
                                                                                    repeats=range(2, 3))
    # ... and the same sweep run afresh the next day, into the same ledger.
    ledger = _write(tmp_path / "test.jsonl", first + second + _run(RUN_B, START_B, 220.0))
    r = rep.build_report([ledger], min_repeats=1)
    assert [(run.run, run.run_ids, run.started_at, run.rows) for run in r.loaded.runs] == [
        (RUN_A, (RUN_A, resumed), START_A, 7), (RUN_B, (RUN_B,), START_B, 6)]
    cells = _ddtree(r.grouped).set_index("run")
    # The resumed run's repeats are repeats of one cell: 0 and 1 measured before, 1 and 2 after.
    assert cells.loc[RUN_A, "n"] == 3 and cells.loc[RUN_A, "n_failed_rows"] == 1
    assert cells.loc[RUN_B, "n"] == 3 and cells.loc[RUN_B, "n_failed_rows"] == 0
    assert "resumed 1x (20261201T120000-cccccc)" in r.loaded.runs[0].describe()
    # Named by a resume's own run_id, --run keeps its whole run.
    assert [run.run for run in rep.build_report([ledger], min_repeats=1, runs=[resumed]).loaded.runs] == [RUN_A]


def test_an_invocation_of_another_sweep_in_the_ledger_starts_its_own_run(tmp_path: Path) -> None:
    other = [dict(row, sweep_hash="s2") for row in _run(RUN_B, START_B, 220.0, repeats=range(1, 3))]
    ledger = _write(tmp_path / "test.jsonl", _run(RUN_A, START_A, 400.0, repeats=range(1)) + other)
    assert [run.run for run in rep.load_ledgers([ledger]).runs] == [RUN_A, RUN_B]


@pytest.mark.parametrize("use_arrow", [None, False])
def test_a_run_id_that_is_not_text_is_a_bad_line(tmp_path: Path, use_arrow: bool | None) -> None:
    lines = [json.dumps(row) for row in _run(RUN_A, START_A, 400.0, repeats=range(1))]
    lines += [json.dumps(dict(json.loads(lines[0]), run_id=["x"], repeat=1)),
              json.dumps(dict(json.loads(lines[0]), started_at=12, repeat=2))]
    (ledger := tmp_path / "l.jsonl").write_text("\n".join(lines) + "\n")
    loaded = rep.load_ledgers([ledger], use_arrow=use_arrow)
    assert [(n, r) for _, n, r in loaded.bad_lines] == [(3, "not a string: run_id=['x']"),
                                                        (4, "not a string: started_at=12")]
    assert [run.run for run in loaded.runs] == [RUN_A] and len(loaded.frame) == 2


def test_per_category_and_lossless_tables_follow_the_runs(tmp_path: Path) -> None:
    groups = [{"group": "code", "requests": 8, "accept_length": 3.0, "user_tok_s": 50.0}]
    rows = [dict(row, categories=groups, output_hashes=["h1", "h2"]) for row in
            _run(RUN_A, START_A, 400.0, repeats=range(1)) + _run(RUN_B, START_B, 220.0, repeats=range(1))]
    ledger = _write(tmp_path / "l.jsonl", rows)
    r = rep.build_report([ledger], min_repeats=1)
    cats = category_table([ledger], run_of=r.loaded.run_of())
    assert sorted(cats.loc[cats["algorithm"] == "DDTREE", "run"]) == [RUN_A, RUN_B]
    assert list(_ddtree(r.grouped)["t0_match_frac"]) == [1.0, 1.0]  # each against its own run's AR
    pooled = rep.build_report([ledger], min_repeats=1, pool_runs=True)
    cats = category_table([ledger], run_of=pooled.loaded.run_of())
    assert list(cats.loc[cats["algorithm"] == "DDTREE", "n"]) == [2]
    assert list(_ddtree(pooled.grouped)["t0_match_frac"]) == [1.0]


def test_compare_names_the_pair_of_runs_of_each_row(two_runs: Path) -> None:
    base = rep.load_tidy([two_runs])
    other = rep.build_report([two_runs / "second.jsonl"], group_by="host").tidy
    cmp = rep.compare(base, other)
    ddtree = cmp[cmp["algorithm"] == "DDTREE"].set_index("run_a")
    assert list(ddtree.index) == [RUN_A, RUN_B] and set(ddtree["run_b"]) == {RUN_B}
    assert list(ddtree["ratio"]) == [pytest.approx(0.55), 1.0] and list(ddtree["changed"]) == [True, False]


def test_tune_refuses_two_runs_unless_pooled_or_one_is_named(two_runs: Path, cli: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError) as refused:
        tune_ledgers([two_runs], min_repeats=3)
    message = refused.value.message
    assert f"machine type {B300}, temperature 0: DDTREE cells of 2 runs (run {RUN_A} ({START_A}); run {RUN_B} " \
           f"({START_B})); tune does not pool runs silently: --pool-runs pools them" in message
    done = cli("tune", str(two_runs))
    assert done.exit_code == 2 and done.stdout == "" and done.stderr.strip().count("\n") == 0, done.stderr
    (policy,) = tune_ledgers([two_runs], min_repeats=3, runs=[RUN_B]).policies
    assert policy.run == RUN_B and policy.entries[0].output_tok_s == 220.0
    pooled = tune_ledgers([two_runs], min_repeats=3, pool_runs=True)
    assert pooled.pooled_runs and pooled.policies[0].run is None and pooled.policies[0].entries[0].n == 6
    data = json_data(cli("--json", "tune", str(two_runs), "--pool-runs").stdout)
    assert data["pool_runs"] is True and [r["run"] for r in data["runs"]] == [RUN_A, RUN_B]
    text = " ".join(cli("tune", str(two_runs), "--pool-runs").stdout.split())
    assert "Pooled 2 runs as repeats of their cells (--pool-runs):" in text
    assert json.dumps(data["policies"][0]["run"]) == "null"
