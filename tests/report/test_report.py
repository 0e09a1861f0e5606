"""Report aggregation, best pick, compare, CSV schema and plots on hand-built ledgers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from cli_json import json_data
from report_rows import make_row

from ddtree_ops import report as rep
from ddtree_ops.bench.ledger import append_row
from ddtree_ops.errors import ConfigError


def write(path: Path, rows: list[dict]) -> Path:
    for row in rows:
        append_row(path, row)
    return path


def known_ledger(path: Path) -> Path:
    """AR ~100, DFLASH ~200, DDTREE b=8 ~297, b=16 ~300 (within 1%), b=32 eager ~400."""
    rows = []
    for rep_i, (ar, df, b8, b16, b32) in enumerate(
        [(100, 200, 297, 300, 400), (104, 190, 299, 290, 410), (98, 210, 295, 310, 390)]
    ):
        rows += [
            make_row(algorithm="AR", repeat=rep_i, output_tok_s=ar),
            make_row(algorithm="DFLASH", repeat=rep_i, output_tok_s=df),
            make_row(budget=8, repeat=rep_i, output_tok_s=b8, accept_length=2.0 + rep_i),
            make_row(budget=16, repeat=rep_i, output_tok_s=b16),
            make_row(budget=32, repeat=rep_i, output_tok_s=b32, cuda_graph=False),
        ]
    return write(path, rows)


def cell(tidy: pd.DataFrame, algorithm: str, budget: int | None = None) -> pd.Series:
    sel = tidy[(tidy["algorithm"] == algorithm) & ((tidy["budget"] == budget) if budget else tidy["budget"].isna())]
    assert len(sel) == 1
    return sel.iloc[0]


@pytest.mark.parametrize("use_arrow", [True, False])
def test_aggregation_known_answers(tmp_path: Path, use_arrow: bool) -> None:
    r = rep.build_report([known_ledger(tmp_path / "l.jsonl")], group_by="host", use_arrow=use_arrow)
    tidy = r.tidy
    ar = cell(tidy, "AR")
    assert (ar["n"], ar["output_tok_s_median"], ar["output_tok_s_mad"]) == (3, 100.0, 2.0)  # |dev| = 0, 4, 2
    assert (ar["output_tok_s_min"], ar["output_tok_s_max"]) == (98.0, 104.0)
    b16 = cell(tidy, "DDTREE", 16)
    assert b16["output_tok_s_mad"] == 10.0
    assert b16["score"] == pytest.approx(300 - 1.4826 * 10)
    assert b16["speedup_vs_ar"] == pytest.approx(3.0)
    assert b16["speedup_vs_dflash"] == pytest.approx(1.5)
    assert cell(tidy, "DDTREE", 8)["accept_length_median"] == 3.0
    eager = cell(tidy, "DDTREE", 32)
    # only graph-mode baselines exist: the speedup is given, flagged as mixed
    assert not eager["cuda_graph"] and eager["modes_mixed"] and bool(eager["ar_cuda_graph"])
    assert eager["speedup_vs_ar"] == pytest.approx(4.0)
    assert not b16["modes_mixed"]
    assert pd.isna(b16["dflash_width"])  # only the drafter's own block was measured


def test_a_ddtree_cell_is_compared_with_the_dflash_chain_of_its_verify_width(tmp_path: Path) -> None:
    rows = [make_row(algorithm="AR", output_tok_s=100), make_row(algorithm="DFLASH", output_tok_s=180)]
    rows += [make_row(algorithm="DFLASH", draft_tokens=n, output_tok_s=tok_s) for n, tok_s in ((5, 150), (9, 200),
                                                                                            (16, 250))]
    rows += [make_row(budget=b, output_tok_s=300) for b in (4, 8, 12, 32)]
    tidy = rep.build_report([write(tmp_path / "l.jsonl", rows)], group_by="host").tidy

    def versus(algorithm: str, budget: int | None) -> tuple[float, object]:
        row = cell(tidy, algorithm, budget)
        return round(float(row["speedup_vs_dflash"]), 3), None if pd.isna(row["dflash_width"]) else row["dflash_width"]

    # Root + 4 nodes against the chain of 4 drafted tokens (5 verified), root + 8 against 9;
    # a budget between widths takes the longest chain not wider than the tree; past the
    # drafter's block (16), the longest chain.
    assert versus("DDTREE", 4) == (2.0, 5) and versus("DDTREE", 8) == (1.5, 9)
    assert versus("DDTREE", 12) == (1.5, 9) and versus("DDTREE", 32) == (1.2, 16)
    assert versus("DFLASH", 9) == (1.0, 9)  # a chain is its own baseline
    assert versus("AR", None) == (round(100 / 180, 3), None)  # AR: DFlash at the drafter's block
    labels = {rep.describe_cell(row) for _, row in tidy[tidy["algorithm"] == "DFLASH"].iterrows()}
    assert labels == {"DFLASH", "DFLASH n=5", "DFLASH n=9", "DFLASH n=16"}


def test_best_pick_tie_rule_and_eager_separation(tmp_path: Path) -> None:
    r = rep.build_report([known_ledger(tmp_path / "l.jsonl")], group_by="host")
    best = r.best.best.set_index("modes")
    graph = best.loc["graph"]
    # b=8 scores 297-1.4826*2 = 294.03; b=16 scores 285.17: b=8 is best outright
    assert (graph["algorithm"], graph["budget"], graph["candidates"]) == ("DDTREE", 8, 4)
    assert best.loc["eager", "budget"] == 32 and best.loc["eager", "candidates"] == 1

    mixed = rep.best_configs(r.grouped, mix_modes=True).best
    assert len(mixed) == 1 and mixed.iloc[0]["budget"] == 32 and mixed.iloc[0]["modes"] == "graph+eager"
    assert "--mix-modes" in mixed.iloc[0]["note"]


def test_tie_within_one_percent_prefers_smaller_budget(tmp_path: Path) -> None:
    rows = []
    for i in range(3):
        rows += [make_row(budget=32, repeat=i, output_tok_s=1000.0), make_row(budget=16, repeat=i, output_tok_s=992.0),
                 make_row(budget=8, repeat=i, output_tok_s=980.0)]
    r = rep.build_report([write(tmp_path / "l.jsonl", rows)])
    best = r.best.best.iloc[0]
    assert best["budget"] == 16  # 0.8% below b=32: tie, smaller wins; b=8 is 2% below
    assert "DDTREE b=32 k=4 scored +0.8% higher" in best["note"]


def test_refusals_say_why(tmp_path: Path) -> None:
    rows = [make_row(budget=8, repeat=i, output_tok_s=500.0, failed=1 if i == 0 else 0) for i in range(3)]
    rows += [make_row(budget=16, repeat=i, output_tok_s=400.0) for i in range(2)]
    rows += [make_row(budget=32, repeat=i, output_tok_s=300.0, status="failed" if i == 2 else "ok") for i in range(3)]
    rows += [make_row(budget=64, repeat=i, output_tok_s=200.0) for i in range(3)]
    r = rep.build_report([write(tmp_path / "l.jsonl", rows)])
    reasons = dict(zip(r.best.refusals["cell"], r.best.refusals["reason"], strict=True))
    assert reasons == {
        "DDTREE b=8 k=4": "1 failed request(s)",
        "DDTREE b=16 k=4": "n=2 < min repeats 3",
        "DDTREE b=32 k=4": "1 failed repeat(s); n=2 < min repeats 3",
    }
    assert r.best.best.iloc[0]["budget"] == 64
    none_left = rep.best_configs(r.grouped[r.grouped["budget"] != 64]).best.iloc[0]
    assert none_left["algorithm"] is None and "all 3 refused" in none_left["note"]


def test_group_by_gpu_pools_hosts(tmp_path: Path) -> None:
    rows = [
        make_row(host=h, repeat=i, output_tok_s=v)
        for h, vals in (("a", (100, 110)), ("b", (120, 130)))
        for i, v in enumerate(vals)
    ]
    r = rep.build_report([write(tmp_path / "l.jsonl", rows)], group_by="gpu", min_repeats=1)
    assert list(r.tidy["machine"]) == ["a", "b"]
    pooled = r.grouped.iloc[0]
    got = (pooled["machine"], pooled["hosts"], pooled["n"], pooled["output_tok_s_median"])
    assert got == ("RTX PRO 6000", "a,b", 4, 115.0)


def test_bad_lines_counted_not_fatal(tmp_path: Path) -> None:
    path = known_ledger(tmp_path / "l.jsonl")
    with open(path, "ab") as fh:
        good = json.dumps({**make_row(), "cuda_graph": None}).encode()
        fh.write(b"garbage\n" + good + b"\n" + b'{"schema_version": 1, "ho')
    for use_arrow in (True, False):
        r = rep.build_report([tmp_path], use_arrow=use_arrow)
        assert len(r.loaded.frame) == 15
        assert [(n, reason.split(":")[0]) for _, n, reason in r.loaded.bad_lines] == [
            (16, "not valid JSON"), (17, "missing field(s)"), (18, "truncated last line (a writer stopped mid-line)")]


def test_empty_ledger_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no ledger"):
        rep.build_report([tmp_path])
    (tmp_path / "e.jsonl").write_text("{bad\n")
    with pytest.raises(ConfigError, match=r"no valid ledger rows in 1 file.*e.jsonl:1: not valid JSON"):
        rep.build_report([tmp_path])


def test_tidy_csv_schema_is_stable(tmp_path: Path) -> None:
    r = rep.build_report([known_ledger(tmp_path / "l.jsonl")])
    assert {c: str(t) for c, t in r.tidy.dtypes.items()} == {
        c: ("str" if t == "object" and str(r.tidy[c].dtype) == "str" else t) for c, t in rep.TIDY_DTYPES.items()
    }
    out = tmp_path / "t.csv"
    r.tidy.to_csv(out, index=False)
    back = pd.read_csv(out)
    assert list(back.columns) == list(rep.TIDY_DTYPES)
    assert list(r.best.best.columns) == list(rep.BEST_COLUMNS)
    empty = rep.aggregate(r.loaded.frame.iloc[:0])
    assert list(empty.columns) == list(rep.TIDY_DTYPES)


def test_compare_flags_changes_beyond_spread(tmp_path: Path) -> None:
    a = [
        make_row(budget=b, repeat=i, output_tok_s=v + d)
        for i, d in enumerate((0, 2, -2))
        for b, v in ((8, 300), (16, 400), (32, 500))
    ]
    b = [
        make_row(budget=b, repeat=i, output_tok_s=v + d)
        for i, d in enumerate((0, 2, -2))
        for b, v in ((8, 301), (16, 450), (64, 600))
    ]
    ta = rep.load_tidy([write(tmp_path / "a.jsonl", a)])
    tb = rep.load_tidy([write(tmp_path / "b.jsonl", b)])
    cmp = rep.compare(ta, tb).set_index("budget")
    assert not cmp.loc[8, "changed"]  # +1 tok/s is inside 2*(2.97+2.97)
    assert cmp.loc[16, "changed"] and cmp.loc[16, "direction"] == "faster"
    assert cmp.loc[16, "ratio"] == pytest.approx(450 / 400)
    assert (cmp.loc[32, "only_in"], cmp.loc[64, "only_in"]) == ("a", "b")


def test_plots_written_and_non_empty(tmp_path: Path) -> None:
    from ddtree_ops.report.plots import write_plots

    r = rep.build_report([known_ledger(tmp_path / "l.jsonl")])
    paths = write_plots(r.grouped, tmp_path / "plots")
    assert sorted(p.name for p in paths) == [
        "rtx-pro-6000-accept-length.png",
        "rtx-pro-6000-pareto.png",
        "rtx-pro-6000-speedup-heatmap.png",
        "rtx-pro-6000-throughput.png",
    ]
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_machine_names_a_file_system_refuses_still_get_their_plots(tmp_path: Path) -> None:
    from ddtree_ops.report.plots import write_plots

    long_name = "NVIDIA " + "X" * 300  # a 300-character gpu_name: "File name too long" before
    rows = [make_row(algorithm=a, host=name, gpu_name=name, output_tok_s=100.0 * (i + 1))
            for name in (long_name, "A B", "a-b") for i, a in enumerate(("AR", "DDTREE"))]
    r = rep.build_report([write(tmp_path / "l.jsonl", rows)])
    paths = write_plots(r.grouped, tmp_path / "plots")
    names = [p.name for p in paths]
    assert len(names) == len(set(names)) == 3 * 4
    assert all(len(n.encode()) < 100 for n in names)
    # "A B" and "a-b" clean to the same text: each keeps its own files.
    assert len({n.split("-throughput")[0] for n in names if "throughput" in n}) == 3


def test_heatmap_labels_read_on_their_cells() -> None:
    from ddtree_ops.report.plots import _label_colour

    assert _label_colour((0.65, 0.0, 0.15, 1.0)) == "white"  # RdYlGn's dark red end
    assert _label_colour((0.0, 0.41, 0.22, 1.0)) == "white"  # its dark green end
    assert _label_colour((1.0, 1.0, 0.75, 1.0)) == "black"  # its pale yellow middle


def test_the_pareto_frontier_keeps_only_points_nothing_beats_on_both_axes() -> None:
    from ddtree_ops.report.plots import _frontier

    points = pd.DataFrame({"user_tok_s": [100.0, 90.0, 80.0, 60.0, 50.0, 40.0],
                           "gpu_tok_s": [10.0, 30.0, 20.0, 60.0, 60.0, 100.0]})
    # 80/20 is beaten by 90/30, 50/60 by 60/60: neither is on the frontier.
    assert _frontier(points).index.tolist() == [5, 3, 1, 0]


def test_cli_end_to_end(tmp_path: Path) -> None:
    ledger = known_ledger(tmp_path / "l.jsonl")
    cmd = [sys.executable, "-m", "ddtree_ops", "report", str(ledger), "--csv", str(tmp_path / "t.csv"),
           "--csv-best", str(tmp_path / "b.csv"), "--compare", str(ledger), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json_data(done.stdout)
    assert len(out["cells"]) == 5 and len(out["best"]) == 2 and not any(c["changed"] for c in out["compare"])
    assert pd.read_csv(tmp_path / "b.csv")["budget"].tolist() == [32, 8]
    missing = subprocess.run(
        [sys.executable, "-m", "ddtree_ops", "report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "nope: no such ledger" in missing.stderr and "Traceback" not in missing.stderr


def test_terminal_tables_fit_80_columns(tmp_path: Path) -> None:
    """What `make demo` prints: one best-config table per machine, runner-ups below it, no
    line wider than an ordinary terminal."""
    ledger = known_ledger(tmp_path / "l.jsonl")
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "ddtree_ops", "report", str(ledger)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    titles = [line for line in lines if line.startswith("Best configuration — ")]
    assert len(titles) == 1 and "RTX PRO 6000" in titles[0]
    assert any("runner-up" in line for line in lines)


def test_duplicates_and_non_finite_rows_listed_in_the_output(tmp_path: Path) -> None:
    ledger = known_ledger(tmp_path / "l.jsonl")
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(ledger.read_bytes())  # the same rows again: counted once
    with open(ledger, "a") as fh:  # a row another writer left with a NaN metric
        fh.write(json.dumps({**make_row(repeat=9), "output_tok_s": float("nan")}) + "\n")
    alone = rep.build_report([known_ledger(tmp_path / "alone" / "l.jsonl")])
    both = rep.build_report([ledger, copy])
    pd.testing.assert_frame_equal(both.tidy, alone.tidy)
    assert both.loaded.duplicates == ((str(copy), 15),)

    cmd = [sys.executable, "-m", "ddtree_ops", "report", str(ledger), str(copy)]
    done = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json_data(done.stdout)
    assert out["duplicates"] == [{"file": str(copy), "rows": 15}]
    assert out["bad_lines"] == [{"file": str(ledger), "line": 16, "reason": "non-finite metric(s): output_tok_s=nan"}]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert text.returncode == 0, text.stderr
    assert f"Counted 15 duplicate row(s) once (same run_id, cell and repeat): {copy} (15)" in text.stdout
    assert "Skipped 1 bad line(s) (1 non-finite metric(s)):" in text.stdout
    assert f"{ledger}:16: non-finite metric(s): output_tok_s=nan" in text.stdout


@pytest.mark.parametrize(
    ("option", "value", "missing"),
    [
        ("--csv", "nodir/x.csv", "nodir"),
        ("--csv-best", "nodir/deeper/b.csv", "nodir/deeper"),
        ("--plots", "nodir/plots", "nodir"),
    ],
)
def test_output_paths_need_an_existing_parent(
    cli, tmp_path: Path, option: str, value: str, missing: str
) -> None:
    """A typo in an output path is one line before any work, not a directory tree created anywhere."""
    ledger = known_ledger(tmp_path / "l.jsonl")
    res = cli("report", str(ledger), option, str(tmp_path / value))
    assert res.exit_code == 2, res
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{option} {tmp_path / value}: directory {tmp_path / missing} does not exist" in lines[0]
    assert not (tmp_path / "nodir").exists() and res.stdout == ""


def test_plots_folder_is_created_when_its_parent_exists(cli, tmp_path: Path) -> None:
    ledger = known_ledger(tmp_path / "l.jsonl")
    res = cli("report", str(ledger), "--plots", str(tmp_path / "plots"), "--show-cells", "0")
    assert res.exit_code == 0, res.stderr
    assert any((tmp_path / "plots").glob("*.png"))


def test_min_repeats_default_is_what_the_sweep_planned(cli, tmp_path: Path) -> None:
    """A one-repeat sweep (the demo's) is reported without --min-repeats; a cell that lost
    a repeat of a three-repeat sweep is still refused."""
    one = write(tmp_path / "one.jsonl", [make_row(algorithm="AR", output_tok_s=100.0), make_row(output_tok_s=200.0)])
    res = cli("report", str(one), "--json")
    assert res.exit_code == 0, res.stderr
    out = json_data(res.stdout)
    assert out["min_repeats"] == 1 and out["refusals"] == [] and out["best"][0]["budget"] == 16

    rows = [make_row(algorithm="AR", repeat=i) for i in range(3)] + [make_row(repeat=i) for i in range(2)]
    r = rep.build_report([write(tmp_path / "three.jsonl", rows)])
    assert r.min_repeats == 3 and list(r.best.refusals["reason"]) == ["n=2 < min repeats 3"]
    assert rep.build_report([tmp_path / "three.jsonl"], min_repeats=2).best.refusals.empty  # explicit wins


def test_every_cell_refused_exits_non_zero_with_one_line(cli, tmp_path: Path) -> None:
    ledger = write(tmp_path / "l.jsonl", [make_row(algorithm="AR"), make_row()])
    res = cli("report", str(ledger), "--min-repeats", "3")
    assert res.exit_code == 6, res
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "every one of the 2 cell(s) was refused" in lines[0], res.stderr
    assert "n=1 < min repeats 3" in lines[0]
    as_json = cli("report", str(ledger), "--min-repeats", "3", "--json")
    assert as_json.exit_code == 6 and len(json.loads(as_json.stdout)["data"]["refusals"]) == 2


def test_one_repeat_shows_no_spread_and_speedups_read_one_way() -> None:
    from ddtree_ops.cli.report_view import _ratio, _spread, _tok_s_column

    assert _spread(412.0, 0.0, 1) == "412.0" and _spread(412.0, 3.5, 3) == "412.0 ± 3.5"
    assert _spread(float("nan"), float("nan"), pd.NA) == "—"
    assert _ratio(1.0) == "1.00x" and _ratio(float("nan")) == "—"
    # The column says "± MAD" only where a row has repeats to spread over.
    assert _tok_s_column([1, 1, pd.NA]).header == "tok/s" and _tok_s_column([1, 3]).header == "tok/s ± MAD"


def test_a_best_pick_of_plain_ar_says_nothing_beat_it(tmp_path: Path, cli) -> None:
    # DDTREE and DFlash both slower than AR at this cell: AR is the pick, and the report says why.
    rows = [make_row(algorithm=a, repeat=r, output_tok_s=v + r)
            for r in range(3) for a, v in (("AR", 300.0), ("DFLASH", 200.0), ("DDTREE", 250.0))]
    ledger = write(tmp_path / "l.jsonl", rows)
    res = cli("report", str(ledger), "--show-cells", "0")
    assert res.exit_code == 0, res.stderr
    assert "no DDTree or DFlash configuration beat AR here" in " ".join(res.stdout.split())


def test_a_pick_slower_than_ar_or_within_one_repeats_noise_says_so(tmp_path: Path) -> None:
    # Eager cells only in their mode (the B300's large trees), all slower than the graph AR baseline.
    rows = [make_row(algorithm="AR", repeat=0, output_tok_s=400.0),
            make_row(budget=16, repeat=0, output_tok_s=232.0, cuda_graph=False),
            make_row(budget=32, repeat=0, output_tok_s=225.0, cuda_graph=False)]
    r = rep.build_report([write(tmp_path / "l.jsonl", rows)], min_repeats=1)
    eager = r.best.best.set_index("modes").loc["eager"]
    assert "slower than the AR baseline (0.58x): not worth deploying" in eager["note"]
    # One repeat each, 3% apart: the pick is not told apart from its runner-up.
    assert "one repeat: DDTREE b=32 k=4 eager is within 3.0%" in eager["note"]


def test_a_note_every_pick_shares_is_said_once(tmp_path: Path, cli) -> None:
    rows = [make_row(algorithm=a, repeat=r, output_tok_s=v + r, concurrency=c, workload_ignore_eos=True,
                     workload_prompt_format="chat-template")
            for r in range(3) for c in (1, 4) for a, v in (("AR", 100.0), ("DDTREE", 250.0))]
    res = cli("report", str(write(tmp_path / "l.jsonl", rows)), "--show-cells", "0")
    assert res.exit_code == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert text.count("chat with ignore_eos") == 1 and "every pick: chat with ignore_eos" in text


def test_rows_no_server_measured_are_not_cells(tmp_path: Path, cli) -> None:
    # host "gone" was unreachable: its rows failed before any launch (no launch_id). As cells
    # they would read "AR eager: 1 failed repeat(s)", a configuration that never ran.
    rows = [make_row(algorithm=a, repeat=r, output_tok_s=v, launch_id=f"{a}.1.0")
            for r in range(3) for a, v in (("AR", 100.0), ("DDTREE", 250.0))]
    rows += [make_row(host="gone", algorithm=a, repeat=r, cuda_graph=False, status="failed", output_tok_s=None,
                      accept_length=None, error="cannot connect to 10.0.0.9:22: connection refused")
             for r in range(3) for a in ("AR", "DDTREE")]
    ledger = write(tmp_path / "l.jsonl", rows)
    r = rep.build_report([ledger], group_by="host")
    assert set(r.tidy["machine"]) == {"ct200-a"} and r.best.refusals.empty
    assert r.unmeasured.to_dict("records") == [
        {"host": "gone", "rows": 6, "reason": "cannot connect to 10.0.0.9:22: connection refused"}]
    res = cli("report", str(ledger), "--show-cells", "0")
    assert res.exit_code == 0, res.stderr
    assert "not measured: gone: 6 row(s) failed before any server served them" in " ".join(res.stdout.split())
    assert "failed repeat" not in res.stdout


def test_ledgers_of_several_workloads_say_so_and_name_each_picks_workload(tmp_path: Path, cli) -> None:
    rows = [make_row(algorithm=a, repeat=r, output_tok_s=v * k, workload_hash=w, workload_name=name)
            for r in range(3) for a, v in (("AR", 100.0), ("DDTREE", 250.0))
            for w, name, k in (("w1", "chat", 1.0), ("w2", "humaneval", 2.0))]
    res = cli("report", str(write(tmp_path / "l.jsonl", rows)), "--show-cells", "0")
    assert res.exit_code == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "These ledgers measured 2 workloads (chat, humaneval): each is picked for on its own" in text
    table = text.split("Best configuration — ")[1]
    assert "workload" in table and "humaneval" in table
