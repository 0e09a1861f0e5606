"""`ddtree-ops report`: ledgers -> tidy table, best configurations, CSV, plots, compare.

Only the command's options live here; the work (pandas) is in :mod:`.report_view`,
imported when the command runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from ddtree_ops.cli.common import WIDE_HELP, check_output_path
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.errors import ConfigError


@app.command("report")
def report_command(
    ctx: typer.Context,
    ledgers: list[Path] | None = typer.Argument(
        None, help="Ledger files or folders (default: every *.jsonl under results/)."
    ),
    csv: Path | None = typer.Option(None, "--csv", help="Write the tidy per-(host, cell) table here."),
    csv_best: Path | None = typer.Option(None, "--csv-best", help="Write the best configurations here."),
    csv_categories: Path | None = typer.Option(
        None, "--csv-categories", help="Write accept length and speedup per (cell, data set / category) here."
    ),
    plots: Path | None = typer.Option(None, "--plots", help="Write PNG plots into this folder."),
    group_by: str = typer.Option(
        "gpu", "--group-by", help="Machine for best configs and plots: gpu (GPU type) or host."
    ),
    min_repeats: int | None = typer.Option(
        None, "--min-repeats",
        help="Refuse cells with fewer ok repeats (default: the repeats each ledger's sweep planned).",
    ),
    mix_modes: bool = typer.Option(False, "--mix-modes", help="Rank eager and CUDA-graph cells together (flagged)."),
    pool_runs: bool = typer.Option(
        False, "--pool-runs",
        help="Pool the ledgers' runs: the same cell of two runs becomes one cell, its repeats pooled (said). "
        "Default: each run its own cells and best picks.",
    ),
    run: list[str] | None = typer.Option(
        None, "--run", help="Only this run: its id, or a --resume's run id (repeatable; --json lists the runs).",
    ),
    traffic_mix: str | None = typer.Option(
        None, "--mix", help="Also pick the best configuration for a traffic mix: data-set weights, "
        "e.g. humaneval=0.7,mtbench=0.3 (speedup per user over AR, weighted).",
    ),
    compare_with: list[Path] | None = typer.Option(
        None, "--compare", help="Other ledger(s): per-cell ratio against them."
    ),
    show_cells: int | None = typer.Option(
        None, "--show-cells", min=0,
        help="Show only the first N rows of the per-cell table (0 = none; default: every row).",
    ),
    wide: bool = typer.Option(
        False, "--wide", help=WIDE_HELP
    ),
    json_output: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
) -> None:
    """Aggregate benchmark ledgers: per-cell table, speedups, best config per machine, plots."""
    obj: AppContext = ctx.obj
    obj.json = as_json = json_output or obj.json  # either --json: the envelope, errors included
    if group_by not in ("gpu", "host"):
        raise ConfigError(f"--group-by must be 'gpu' or 'host', not {group_by!r}")
    files = {"--csv": csv, "--csv-best": csv_best, "--csv-categories": csv_categories}
    _check_output_files(files, ledgers or [], compare_with or [])
    for option, path in files.items():
        check_output_path(option, path)
    from ddtree_ops.report.mix import parse_mix

    weights = parse_mix(traffic_mix) if traffic_mix is not None else None
    check_output_path("--plots", plots, directory=True)
    from ddtree_ops.cli.report_view import run_report

    run_report(
        obj, ledgers=ledgers, csv=csv, csv_best=csv_best, csv_categories=csv_categories, plots=plots,
        group_by=group_by, min_repeats=min_repeats, weights=weights,
        mix_modes=mix_modes, compare_with=compare_with, show_cells=show_cells, wide=wide, as_json=as_json,
        pool_runs=pool_runs, runs=run or [],
    )


def _check_output_files(files: dict[str, Path | None], ledgers: list[Path], compare_with: list[Path]) -> None:
    """Before any work: a file ``report`` writes is never written through a symbolic link
    (the file it names may be anything), nor over a ledger this report reads."""
    from ddtree_ops.fsutil import IS_LINK, check_output_file

    for option, path in files.items():
        if path is None:
            continue
        try:
            check_output_file(path)
        except OSError as exc:
            if exc.strerror == IS_LINK:
                raise ConfigError(f"{option} {path}: {IS_LINK}; give the file's own path") from None
            # anything else (a directory, a FIFO) is check_output_path's to say
    existing = {option: path for option, path in files.items() if path is not None and path.is_file()}
    if not existing:
        return
    from ddtree_ops.report.loading import find_ledgers

    for ledger in [*find_ledgers(ledgers), *(find_ledgers(compare_with) if compare_with else [])]:
        for option, path in existing.items():
            if os.path.samefile(path, ledger):
                raise ConfigError(f"{option} {path}: is a ledger this report reads; a CSV written there would "
                                  "replace it: give another file name")
