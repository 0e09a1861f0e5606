"""Per data set / category: the report's breakdown of each cell from the rows' ``categories``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from cli_json import json_data
from report_rows import make_row

from ddtree_ops.bench.ledger import append_row
from ddtree_ops.report.categories import CATEGORY_DTYPES, category_table


def groups(**per_group: tuple[float | None, float]) -> list[dict]:
    """``categories`` records: group -> (accept length, per-user tok/s)."""
    return [{"group": g, "requests": 4, "completed": 4, "output_tokens": 64, "verify_ct": 16, "accept_length": a,
             "user_tok_s": u, "tpot_ms_median": 5.0} for g, (a, u) in per_group.items()]


def ledger(path: Path) -> Path:
    rows = []
    for r, jitter in enumerate((0.0, 2.0, -2.0)):
        rows += [
            make_row(algorithm="AR", repeat=r, output_tok_s=100 + jitter,
                     categories=groups(humaneval=(None, 20 + jitter), **{"mtbench/writing": (None, 20.0)})),
            make_row(budget=8, repeat=r, output_tok_s=300 + jitter,
                     categories=groups(humaneval=(5.0 + r, 80 + jitter), **{"mtbench/writing": (2.0, 30.0)})),
            make_row(budget=32, repeat=r, output_tok_s=400, cuda_graph=False,
                     categories=groups(humaneval=(6.0, 100.0), **{"mtbench/writing": (2.5, 36.0)})),
        ]
    # A failed row and a row from before the breakdown are not counted.
    rows.append(make_row(budget=64, repeat=0, status="failed"))
    rows.append(make_row(budget=16, repeat=0))
    for row in rows:
        append_row(path, row)
    return path


def test_each_cell_is_broken_down_by_category_with_its_own_speedup(tmp_path: Path) -> None:
    table = category_table([ledger(tmp_path / "l.jsonl")])
    assert list(table.columns) == list(CATEGORY_DTYPES)
    assert {str(k): str(v) for k, v in table.dtypes.items()} == CATEGORY_DTYPES
    by = {(row.algorithm, None if pd.isna(row.budget) else int(row.budget), row.category): row
          for row in table.itertuples()}
    assert len(by) == 6  # AR, b8, b32-eager x 2 categories; b16 had no breakdown
    code, chat = by[("DDTREE", 8, "humaneval")], by[("DDTREE", 8, "mtbench/writing")]
    assert (code.n, code.requests, code.accept_length_median) == (3, 12, 6.0)  # median of 5, 6, 7
    assert code.speedup_vs_ar == pytest.approx(80 / 20) and chat.speedup_vs_ar == pytest.approx(30 / 20)
    # The eager cell has no eager AR cell: it is compared with the graph-mode one, its own row.
    eager = by[("DDTREE", 32, "humaneval")]
    assert not eager.cuda_graph and eager.speedup_vs_ar == pytest.approx(100 / 20)
    assert pd.isna(by[("AR", None, "humaneval")].accept_length_median)


def test_the_report_shows_the_best_picks_per_category_and_writes_the_csv(tmp_path: Path) -> None:
    path = ledger(tmp_path / "l.jsonl")
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "ddtree_ops", "report", str(path), "--csv-categories",
                           str(tmp_path / "c.csv")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    start = next(i for i, line in enumerate(lines) if line.startswith("Best configurations per category"))
    section = "\n".join(lines[start:])
    assert "humaneval" in section and "mtbench/writing" in section and "4.00x" in section and "1.50x" in section
    assert pd.read_csv(tmp_path / "c.csv").shape == (6, len(CATEGORY_DTYPES))
    data = json_data(subprocess.run([sys.executable, "-m", "ddtree_ops", "report", str(path), "--json"],
                                    capture_output=True, text=True, timeout=120).stdout)
    assert {c["category"] for c in data["categories"]} == {"humaneval", "mtbench/writing"}


def test_chat_prompts_measured_with_ignore_eos_are_flagged(tmp_path: Path) -> None:
    from ddtree_ops import report as rep

    path = tmp_path / "l.jsonl"
    for r in range(2):
        append_row(path, make_row(algorithm="AR", repeat=r, workload_prompt_format="chat-template"))
        append_row(path, make_row(budget=8, repeat=r, output_tok_s=300, workload_prompt_format="chat-template"))
        for algorithm, tok_s in (("AR", 100), ("DDTREE", 300)):  # completion text: nothing to flag
            append_row(path, make_row(algorithm=algorithm, budget=8, repeat=r, output_tok_s=tok_s,
                                      workload_prompt_format="text", workload_hash="w2"))
    result = rep.build_report([path])
    flagged = dict(zip(result.tidy["workload_hash"], result.tidy["ignore_eos_on_chat"], strict=False))
    assert flagged == {"w1": True, "w2": False}
    notes = [str(n) for n in result.best.best["note"]]
    assert len(notes) == 2  # one situation per workload
    chat_note = [n for n in notes if "ignore_eos" in n]
    assert chat_note == ["chat with ignore_eos (lengths forced)"]


def test_the_best_configuration_for_a_named_traffic_mix(tmp_path: Path) -> None:
    from ddtree_ops.report.mix import best_for_mix, parse_mix

    cats = category_table([ledger(tmp_path / "l.jsonl")])
    picks = best_for_mix(cats, parse_mix("humaneval=7,mtbench=3"))
    by_mode = {bool(r.cuda_graph): r for r in picks.itertuples()}
    # Graph mode: budget 8 (AR's per-user rate 20 on both sets: 0.7 x 80/20 + 0.3 x 30/20);
    # eager mode is picked apart (budget 32, against the graph-mode AR cell).
    assert (by_mode[True].algorithm, by_mode[True].budget) == ("DDTREE", 8)
    assert by_mode[True].mix_speedup == pytest.approx(0.7 * 4.0 + 0.3 * 1.5)
    assert by_mode[True].per_set == "humaneval 4.00x, mtbench 1.50x"
    assert by_mode[False].budget == 32 and by_mode[False].mix_speedup == pytest.approx(0.7 * 5.0 + 0.3 * 1.8)


def test_a_mix_where_ar_ties_the_best_tree_picks_ar(tmp_path: Path) -> None:
    from ddtree_ops.report.mix import best_for_mix

    # The tree serves humaneval no faster per user than AR: AR (budget NA) is within the tie
    # tolerance and, cheapest, is the pick (its NA budget once raised a TypeError here).
    rows = [make_row(algorithm=algorithm, repeat=0, categories=groups(humaneval=(2.0, 20.0)))
            for algorithm in ("AR", "DDTREE")]
    for row in rows:
        append_row(tmp_path / "l.jsonl", row)
    (pick,) = best_for_mix(category_table([tmp_path / "l.jsonl"]), {"humaneval": 1.0}).itertuples()
    assert (pick.algorithm, pick.mix_speedup, pick.candidates) == ("AR", 1.0, 2)


@pytest.mark.parametrize(
    ("mix", "needle"),
    [
        ("gsm8k=1", "--mix: no rows measured 'gsm8k' (the ledgers hold: humaneval, mtbench)"),
        ("humaneval", "--mix: 'humaneval' is not data_set=weight with a positive weight"),
        ("humaneval=0.5,humaneval=0.5", "--mix: 'humaneval' is named twice"),
        ("humaneval=nan", "is not data_set=weight with a positive weight"),
    ],
)
def test_a_bad_mix_is_one_line_exit_2(tmp_path: Path, mix: str, needle: str) -> None:
    path = ledger(tmp_path / "l.jsonl")
    done = subprocess.run([sys.executable, "-m", "ddtree_ops", "report", str(path), "--mix", mix],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and needle in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_report_prints_the_mix_pick(tmp_path: Path) -> None:
    path = ledger(tmp_path / "l.jsonl")
    done = subprocess.run([sys.executable, "-m", "ddtree_ops", "report", str(path), "--mix",
                           "humaneval=0.7,mtbench=0.3"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert "Best for the traffic mix humaneval 70%, mtbench 30%" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
