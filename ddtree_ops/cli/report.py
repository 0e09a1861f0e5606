"""`ddtree-ops report`: ledgers -> tidy table, best configurations, CSV, plots, compare."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import typer
from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

from ddtree_ops import report as rep
from ddtree_ops.cli.common import check_output_path
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.errors import BenchError, ConfigError


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _ratio(value: Any) -> str:
    """A speedup as '1.23x', or '—' where there was no baseline to compare with."""
    text = _fmt(value, 2)
    return text if text == "—" else f"{text}x"


def _cell(row: Any) -> str:
    return rep.describe_cell(row) if row.get("algorithm") is not None else "—"


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    try:  # the parent was checked before any work (check_output_path)
        frame.to_csv(path, index=False)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the CSV: {exc.strerror or exc}") from exc


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    # to_json handles NA/NaN -> null and numpy scalars uniformly.
    return json.loads(frame.to_json(orient="records"))


def _machine(value: Any) -> str:
    """A GPU or host name as it fits a terminal column ('NVIDIA ' and '(simulated)' shortened)."""
    text = str(value)
    if text.startswith("NVIDIA "):
        text = text[len("NVIDIA "):]
    return text.replace(" (simulated)", " (sim)")


def _best_tables(best: pd.DataFrame, group_by: str) -> list[tuple[Table, list[str]]]:
    """One table of picks per machine (so no column is spent on long GPU names), each with
    one line per pick for its runner-up and notes, kept out of the table so that it fits
    an ordinary terminal."""
    out: list[tuple[Table, list[str]]] = []
    for machine, rows in best.groupby("machine", sort=True):
        table = Table(
            title=f"Best configuration — {_machine(machine)}",
            title_justify="left",
        )
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("temp", "right"),
            ("conc", "right"),
            ("modes", "left"),
            ("best", "left"),
            ("tok/s ± MAD", "right"),
            ("n", "right"),
            ("accept len", "right"),
            ("vs AR", "right"),
            ("vs DFlash", "right"),
        )
        for col, justify in columns:
            table.add_column(col, justify=justify, overflow="fold")
        details: list[str] = []
        for _, row in rows.iterrows():
            picked = row["algorithm"] is not None
            table.add_row(
                _fmt(row["temperature"], 2),
                _fmt(row["concurrency"]),
                str(row["modes"]),
                f"[bold green]{_cell(row)}[/]" if picked else "[red]none[/]",
                f"{_fmt(row['output_tok_s_median'])} ± {_fmt(row['output_tok_s_mad'])}" if picked else "—",
                _fmt(row["n"]),
                _fmt(row["accept_length_median"], 2),
                _ratio(row["speedup_vs_ar"]) if picked else "—",
                _ratio(row["speedup_vs_dflash"]) if picked else "—",
            )
            extra = [f"runner-up {row['runner_up']}"] if _fmt(row["runner_up"]) != "—" else []
            if row["note"]:
                extra.append(str(row["note"]))
            if extra:
                details.append(
                    f"  T={_fmt(row['temperature'], 2)} c={_fmt(row['concurrency'])} {row['modes']}: "
                    + "; ".join(extra)
                )
        out.append((table, details))
    return out


def _tidy_table(tidy: pd.DataFrame, limit: int) -> Table:
    table = Table(
        title=f"Cells per host ({len(tidy)} rows{', first ' + str(limit) if len(tidy) > limit else ''})",
        title_justify="left",
    )
    # min–max and every percentile are in --csv; the terminal keeps what fits.
    for col in (
        "host",
        "temp",
        "conc",
        "config",
        "graph",
        "n",
        "tok/s ± MAD",
        "accept len",
        "TTFT p50 ms",
        "ITL p50 ms",
        "vs AR",
        "vs DFlash",
    ):
        table.add_column(col, justify="left" if col in ("host", "config", "graph") else "right")
    for _, row in tidy.head(limit).iterrows():
        table.add_row(
            _machine(row["machine"]),
            _fmt(row["temperature"], 2),
            _fmt(row["concurrency"]),
            _cell(row),
            "yes" if row["cuda_graph"] else "[yellow]eager[/]",
            _fmt(row["n"]),
            f"{_fmt(row['output_tok_s_median'])} ± {_fmt(row['output_tok_s_mad'])}",
            _fmt(row["accept_length_median"], 2),
            _fmt(row["ttft_ms_median"]),
            _fmt(row["itl_ms_median"], 2),
            _fmt(row["speedup_vs_ar"], 2) + ("†" if row["modes_mixed"] else ""),
            _fmt(row["speedup_vs_dflash"], 2),
        )
    return table


def _compare_table(cmp: pd.DataFrame) -> Table:
    table = Table(title="Comparison (b / a) — changes beyond 2·(σa+σb), σ = 1.4826·MAD", title_justify="left")
    for col in ("host", "temp", "conc", "config", "tok/s a", "tok/s b", "ratio", "change"):
        table.add_column(col, justify="left" if col in ("host", "config", "change") else "right")
    for _, row in cmp.iterrows():
        graph = row["cuda_graph_b"] if row["cuda_graph_b"] is not pd.NA else row["cuda_graph_a"]
        label = rep.describe_cell({**row.to_dict(), "cuda_graph": bool(graph) if graph is not pd.NA else True})
        if row["only_in"]:
            change = f"only in {row['only_in']}"
        elif row["changed"]:
            colour = "green" if row["direction"] == "faster" else "red"
            change = f"[{colour}]{row['direction']}[/]"
        else:
            change = ""
        table.add_row(
            str(row["machine"]), _fmt(row["temperature"], 2), _fmt(row["concurrency"]), label,
            _fmt(row["output_tok_s_a"]), _fmt(row["output_tok_s_b"]), _fmt(row["ratio"], 3), change,
        )
    return table


def _print_skipped(console: Console, loaded: rep.LoadedLedgers) -> None:
    """What was read but not counted: bad lines (unparsable, old schema, missing fields,
    non-finite metrics) with file and line, and copies of rows already read, per ledger.
    The terminal shows the first ten bad lines; ``--json`` lists them all."""
    if loaded.duplicates:
        where = escape(", ".join(f"{f} ({n})" for f, n in loaded.duplicates))
        console.print(
            f"[yellow]Counted {loaded.duplicate_rows} duplicate row(s) once (same run_id, cell and repeat):[/] "
            f"{where}",
            highlight=False, soft_wrap=True,
        )
    if loaded.bad_lines:
        kinds = Counter(reason.split(":")[0] for _, _, reason in loaded.bad_lines)
        summary = escape(", ".join(f"{n} {kind}" for kind, n in kinds.most_common()))
        console.print(f"[yellow]Skipped {len(loaded.bad_lines)} bad line(s)[/] ({summary}):", highlight=False,
                      soft_wrap=True)
        for f, n, r in loaded.bad_lines[:10]:
            console.print(f"  {f}:{n}: {r}", highlight=False, markup=False, soft_wrap=True)
        if len(loaded.bad_lines) > 10:
            console.print(f"  … and {len(loaded.bad_lines) - 10} more (see --json)", highlight=False)


@app.command("report")
def report_command(
    ctx: typer.Context,
    ledgers: list[Path] | None = typer.Argument(
        None, help="Ledger files or folders (default: every *.jsonl under results/)."
    ),
    csv: Path | None = typer.Option(None, "--csv", help="Write the tidy per-(host, cell) table here."),
    csv_best: Path | None = typer.Option(None, "--csv-best", help="Write the best configurations here."),
    plots: Path | None = typer.Option(None, "--plots", help="Write PNG plots into this folder."),
    group_by: str = typer.Option(
        "gpu", "--group-by", help="Machine for best configs and plots: gpu (GPU type) or host."
    ),
    min_repeats: int | None = typer.Option(
        None, "--min-repeats",
        help="Refuse cells with fewer ok repeats (default: the repeats each ledger's sweep planned).",
    ),
    mix_modes: bool = typer.Option(False, "--mix-modes", help="Rank eager and CUDA-graph cells together (flagged)."),
    compare_with: list[Path] | None = typer.Option(
        None, "--compare", help="Other ledger(s): per-cell ratio against them."
    ),
    show_cells: int = typer.Option(
        40, "--show-cells", help="Rows of the per-cell table shown in the terminal (0 = none)."
    ),
    json_output: bool = typer.Option(False, "--json", help="Machine-readable JSON on stdout."),
) -> None:
    """Aggregate benchmark ledgers: per-cell table, speedups, best config per machine, plots."""
    obj: AppContext = ctx.obj
    obj.json = as_json = json_output or obj.json  # either --json: the envelope, errors included
    if group_by not in ("gpu", "host"):
        raise ConfigError(f"--group-by must be 'gpu' or 'host', not {group_by!r}")
    check_output_path("--csv", csv)
    check_output_path("--csv-best", csv_best)
    check_output_path("--plots", plots, directory=True)
    result = rep.build_report(list(ledgers or []), group_by=group_by, min_repeats=min_repeats, mix_modes=mix_modes)  # type: ignore[arg-type]
    cmp = None
    if compare_with:
        other = rep.load_tidy(list(compare_with))
        cmp = rep.compare(other, result.tidy)
    if csv:
        _write_csv(result.tidy, csv)
    if csv_best:
        _write_csv(result.best.best, csv_best)
    written: list[Path] = []
    if plots:
        from ddtree_ops.report.plots import write_plots

        written = write_plots(result.grouped, plots)

    loaded = result.loaded
    if as_json:
        payload: dict[str, Any] = {
            "files": [str(p) for p in loaded.files],
            "rows": len(loaded.frame),
            "bad_lines": [{"file": f, "line": n, "reason": r} for f, n, r in loaded.bad_lines],
            "duplicates": [{"file": f, "rows": n} for f, n in loaded.duplicates],
            "cells": _records(result.tidy),
            "best": _records(result.best.best),
            "refusals": _records(result.best.refusals),
            "min_repeats": result.min_repeats,
            "plots": [str(p) for p in written],
        }
        if cmp is not None:
            payload["compare"] = _records(cmp)
        from ddtree_ops.cli.common import set_json_data

        set_json_data(obj, payload)
        _raise_if_all_refused(result)
        return

    console = obj.console
    console.print(f"Read {len(loaded.frame):,} rows from {len(loaded.files)} ledger(s).", highlight=False)
    _print_skipped(console, loaded)
    if show_cells:
        console.print(_tidy_table(result.tidy, show_cells))
        if result.tidy["modes_mixed"].any():
            console.print("† speedup measured against a baseline in the other CUDA-graph mode.", highlight=False)
    if cmp is not None:
        console.print(_compare_table(cmp))
    refusals = result.best.refusals
    if len(refusals):
        console.print(f"[yellow]{len(refusals)} cell(s) not eligible for best config:[/]", highlight=False)
        for _, refusal in refusals.head(10).iterrows():
            console.print(
                f"  {refusal['machine']} T={refusal['temperature']:g} c={refusal['concurrency']} {refusal['cell']}:"
                f" {refusal['reason']}",
                highlight=False,
            )
        if len(refusals) > 10:
            console.print(f"  … and {len(refusals) - 10} more (see --json)", highlight=False)
    for label, path in (("tidy CSV", csv), ("best CSV", csv_best)):
        if path:
            console.print(f"Wrote {label}: {path}", highlight=False)
    if written:
        console.print(f"Wrote {len(written)} plot(s) to {plots}", highlight=False)
    console.print(
        "Best configuration per machine, temperature and concurrency (score = median − 1.4826·MAD of "
        "output tok/s; within 1% the cheaper config wins):",
        highlight=False,
    )
    for table, details in _best_tables(result.best.best, group_by):
        console.print(table)
        for line in details:
            console.print(line, highlight=False, soft_wrap=True)
    _raise_if_all_refused(result)


def _raise_if_all_refused(result: rep.Report) -> None:
    """No cell may be recommended: a report of nothing but refusals is a failed report
    (exit 6, like a failed benchmark), so a script does not take "none" for an answer."""
    if not result.all_refused:
        return
    reasons = Counter(str(r).split("; ")[0] for r in result.best.refusals["reason"])
    reason, count = reasons.most_common(1)[0]
    source = " (planned by the ledgers' sweeps)" if result.min_repeats_planned else ""
    raise BenchError(
        f"every one of the {len(result.grouped)} cell(s) was refused, so no configuration can be recommended "
        f"(most common reason, {count} cell(s): {reason}; min repeats {result.min_repeats}{source})"
    )
