"""Tables fit an 80-column terminal: low-value columns are dropped (the caption names them),
free text wraps, every row is shown unless --show-cells limits it (and then it says so);
--wide shows every column. Run as the user runs them: the CLI in a subprocess, COLUMNS set."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from report_rows import make_row
from rich.console import Console

from ddtree_ops.bench.ledger import append_row

REPO = Path(__file__).resolve().parents[2]
HOSTS = {
    "sim-ct200": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition (simulated)",
    "sim-b300": "NVIDIA B300 SXM6 AC (simulated)",
}
CONFIGS = [("AR", None, None), ("DFLASH", None, None)] + [
    ("DDTREE", b, k) for b in (4, 8, 16) for k in (2, 4)
]
# One repeat (the demo's): no spread to show, so the header promises none.
ALL_HEADERS = ("temp", "conc", "config", "mode", "n", "tok/s", "accept len", "TTFT p50 ms", "ITL p50 ms",
               "vs AR", "vs DFlash")


def demo_ledger(path: Path, *, scale: float = 1.0) -> Path:
    """What `make demo` writes: two simulated hosts, 2 baselines + 6 DDTree configs x 2
    temperatures x 2 concurrencies, one repeat; the b300 falls back to eager above b=8."""
    for host, gpu in HOSTS.items():
        for i, (algorithm, budget, topk) in enumerate(CONFIGS):
            for temperature in (0.0, 0.6):
                for concurrency in (1, 4):
                    tok_s = scale * (1234.5 + 97.3 * i + 11.1 * concurrency - 50 * temperature)
                    append_row(path, make_row(
                        host=host, gpu_name=gpu, algorithm=algorithm, budget=budget, topk=topk,
                        cuda_graph=not (host == "sim-b300" and (budget or 0) > 8),
                        temperature=temperature, concurrency=concurrency, output_tok_s=tok_s,
                        accept_length=2.0 + i / 10, sweep="demo",
                    ))
    return path


def run_cli(*args: str, columns: int = 80) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ddtree_ops", *args], capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "COLUMNS": str(columns)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def table_rows(out: str, title: str) -> list[str]:
    """The body rows ('│ ... │' lines) of the table whose title line starts with ``title``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
    return [line for line in lines[start:end] if line.startswith("│")]


def header_of(out: str, title: str) -> str:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("┡"))
    return " ".join(" ".join(cell.split()) for line in lines[start + 2:end] for cell in line.split("┃"))


def every_cell(out: str, host: str) -> None:
    rows = table_rows(out, f"Cells — {host} (32 rows)")
    assert len(rows) == 32
    seen = set()
    for row in rows:
        temp, conc, config = (cell.strip() for cell in row.strip("│").split("│")[:3])
        seen.add((temp, conc, config.removesuffix(" eager")))
    labels = {a if a != "DDTREE" else f"DDTREE b={b} k={k}" for a, b, k in CONFIGS}
    assert seen == {(t, c, label) for t in ("0.00", "0.60") for c in ("1", "4") for label in labels}


def test_report_fits_80_columns_and_shows_every_row(tmp_path: Path) -> None:
    ledger = demo_ledger(tmp_path / "demo.jsonl")
    other = demo_ledger(tmp_path / "before.jsonl", scale=0.5)
    out = run_cli("report", str(ledger), "--compare", str(other))
    assert max(len(line) for line in out.splitlines()) <= 80, out
    for host in HOSTS:
        every_cell(out, host)
    assert "Hidden to fit 80 columns: mode" in out and "(--wide shows every column)" in out
    assert len(table_rows(out, "Comparison (b / a)")) == 64
    for title in ("Best configuration — B300 SXM6 AC (sim)",
                  "Best configuration — RTX PRO 6000 Blackwell Workstation Edition (sim)"):
        assert len(table_rows(out, title)) == (8 if "B300" in title else 4)
    # The runner-up notes wrap under their key instead of running past the edge.
    assert any(line.startswith("  T=0.00 c=1 graphs: runner-up ") for line in out.splitlines())


def test_wide_shows_every_column(tmp_path: Path) -> None:
    ledger = demo_ledger(tmp_path / "demo.jsonl")
    out = run_cli("report", str(ledger), "--wide")
    assert "Hidden to fit" not in out
    for host in HOSTS:
        every_cell(out, host)
        header = header_of(out, f"Cells — {host}")
        assert all(f" {h} " in f" {header} " for h in ALL_HEADERS) and "±" not in header, header
    best = header_of(out, "Best configuration — B300")
    assert "±" not in best and "±" not in out
    assert "accept len" in best and "vs DFlash" in best and " n " in best
    assert max(len(line) for line in out.splitlines()) > 80  # wider than the terminal, not cut


def test_a_row_limit_says_so_and_how_to_see_all(tmp_path: Path) -> None:
    ledger = demo_ledger(tmp_path / "demo.jsonl")
    out = run_cli("report", str(ledger), "--show-cells", "40")
    assert len(table_rows(out, "Cells — sim-b300 (32 rows)")) == 32
    assert len(table_rows(out, "Cells — sim-ct200 (first 8 of 32 rows)")) == 8
    flat = " ".join(out.split())
    assert "Showed 40 of 64 cell rows (--show-cells 40): every row without --show-cells" in flat
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("columns", [80, 60])
def test_bench_plan_fits_and_wraps(tmp_path: Path, columns: int) -> None:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text("all:\n  hosts:\n    h1:\n      ansible_connection: local\n")
    out = run_cli("-i", str(inventory), "bench", "--sweep", "bench_configs/demo.yaml", "--target", "h1",
                  "--dry-run", columns=columns)
    assert max(len(line) for line in out.splitlines()) <= columns, out
    rows = table_rows(out, "sweep demo")
    numbers = [row.strip("│").split("│")[0].strip() for row in rows]
    # Live switching (the default): AR, DFlash at the verify widths of budgets 4, 8 and 16
    # (5, 9, and the drafter's block 16), and one DDTree launch for all six trees.
    assert [n for n in numbers if n] == ["1", "2", "3", "4", "5"]
    assert "live switching: 5 launches" in " ".join(out.split()), out
    assert "relaunching per tree: 10 launches" in " ".join(out.split()), out


def test_bench_outcome_wraps_a_long_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ddtree_ops.bench.runner import HostSummary, SweepOutcome
    from ddtree_ops.cli import bench as cli_bench
    from ddtree_ops.cli import main as cli_main

    buf = io.StringIO()
    monkeypatch.setattr(cli_main, "console", Console(file=buf, width=80))
    error = "server crashed: " + " ".join(f"word{i}" for i in range(60))
    outcome = SweepOutcome("run-1", tmp_path / "demo.jsonl", (
        HostSummary("sim-ct200", 32, 0, 32, 0, 8),
        HostSummary("sim-b300", 32, 3, 20, 9, 6, error=error),
    ))
    cli_bench._render_outcome(cli_main.AppContext(), outcome)
    out = buf.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "word59" in out and "sim-ct200" in out and "sim-b300" in out
    assert len([line for line in out.splitlines() if "word" in line]) > 3


def _progress_lines(tasks: list[tuple[str, str, int, int]]) -> list[str]:
    """The bench progress display at 80 columns, one task per (host, description, done,
    total): its non-empty lines."""
    import io

    from ddtree_ops.cli.bench import progress_bar
    from ddtree_ops.cli.terminal import SafeConsole

    buf = io.StringIO()
    console = SafeConsole(file=buf, width=80, force_terminal=False)
    with progress_bar(console, disable=False) as bar:
        for host, description, done, total in tasks:
            bar.update(bar.add_task(description, total=total, host=host), completed=done)
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()]


def test_bench_progress_line_keeps_its_description_and_labels_the_time_left() -> None:
    description = "measure DDTREE b16 k4 T0.6 c8 [sim-ct200/1]"
    (line,) = _progress_lines([("sim-ct200", description, 4, 32)])
    assert line.startswith("sim-ct200 ") and " left " in line and description in line and len(line) <= 80


def test_bench_progress_at_80_columns_cuts_a_long_description_not_the_bar() -> None:
    """A description longer than the line gives way (cut with "…"); host, bar, rows done and
    time left keep their width (rich used to squeeze them to "si…" and drop the bar)."""
    long = "running ddtree-states-b4,8,16-topk4 ddtree-b16-topk4|t0.7-top_p1-top_k-1|c8 repeat 2 [slot 1]"
    lines = _progress_lines([("sim-ct200/0", long, 12, 48), ("sim-b300", "restarting autoregressive", 0, 48)])
    assert len(lines) == 2 and all(len(ln) <= 80 for ln in lines), lines
    assert lines[0].startswith("sim-ct200/0 ━━") and " 12/48 " in lines[0] and " left running ddtree" in lines[0]
    assert lines[0].rstrip().endswith("…")
    assert lines[1].startswith("sim-b300 ") and " 0/48 " in lines[1] and lines[1].rstrip().endswith("autoregressive")
