"""T = 0 losslessness in the report: each DDTree / DFlash cell's output hashes against AR's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
from report_rows import make_row

from ddtree_ops import report as rep
from ddtree_ops.bench.ledger import append_row

SAME = ["a1", "b2", "c3", "d4"]


def ledger(path: Path) -> Path:
    rows = [
        make_row(algorithm="AR", output_tok_s=100, output_hashes=SAME),
        make_row(algorithm="DFLASH", output_tok_s=200, output_hashes=SAME),
        make_row(budget=8, output_tok_s=300, output_hashes=SAME),
        # A lossy verify: one prompt's greedy output is not the target's; a failed request
        # (None) is not compared.
        make_row(budget=16, output_tok_s=320, output_hashes=["a1", "XX", "c3", None]),
        # An eager cell is held to the graph-mode AR cell where there is no eager one.
        make_row(budget=32, output_tok_s=400, cuda_graph=False, output_hashes=SAME),
        # A later repeat does not replace the first; sampled cells are not compared.
        make_row(budget=8, output_tok_s=301, repeat=1, output_hashes=["zz"] * 4),
        make_row(algorithm="AR", temperature=0.6, output_hashes=SAME),
        make_row(budget=8, temperature=0.6, output_hashes=["q"] * 4),
        # A row from before output hashes: nothing to compare.
        make_row(budget=64, output_tok_s=250),
    ]
    for row in rows:
        append_row(path, row)
    return path


def test_each_cell_at_t0_is_compared_with_ar_prompt_for_prompt(tmp_path: Path) -> None:
    report = rep.build_report([ledger(tmp_path / "l.jsonl")], min_repeats=1)
    got = {(r.algorithm, None if pd.isna(r.budget) else int(r.budget), r.temperature):
           (None if r.t0_prompts is pd.NA else int(r.t0_prompts), r.t0_match_frac) for r in report.tidy.itertuples()}
    assert got[("DFLASH", None, 0.0)] == (4, 1.0) and got[("DDTREE", 8, 0.0)] == (4, 1.0)
    assert got[("DDTREE", 16, 0.0)] == (3, 2 / 3)
    assert got[("DDTREE", 32, 0.0)] == (4, 1.0)
    for key in (("AR", None, 0.0), ("DDTREE", 8, 0.6), ("DDTREE", 64, 0.0)):
        assert got[key][0] is None and pd.isna(got[key][1]), key
    # The per-machine table too, and a pick on a lossy cell would say so.
    grouped = report.grouped.set_index(["algorithm", "budget", "temperature"], drop=False)
    assert grouped.loc[("DDTREE", 16, 0.0), "t0_match_frac"] == 2 / 3


def test_the_cell_table_shows_outputs_equal_to_ar(tmp_path: Path) -> None:
    path = ledger(tmp_path / "l.jsonl")
    done = subprocess.run([sys.executable, "-m", "ddtree_ops", "report", str(path), "--min-repeats", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "140"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("T0=AR" in line for line in lines)
    b16 = next(line for line in lines if "DDTREE b=16" in line and "0.00" in line)
    b8 = next(line for line in lines if "DDTREE b=8 " in line and "0.00" in line)
    assert "2/3" in b16 and "4/4" in b8
