"""What `ddtree-ops report` prints and writes: tidy table, best configurations, CSV, plots,
compare. Imported only when `report` runs, so that pandas does not slow every command's start."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ddtree_ops import report as rep
from ddtree_ops.cli.common import (
    EAGER,
    GRAPHS,
    TableColumn,
    fitted_table,
    print_table,
    printable,
    tok_s_column,
    with_spread,
)
from ddtree_ops.cli.main import AppContext
from ddtree_ops.errors import BenchError, ConfigError
from ddtree_ops.fsutil import replace_file, write_problem


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


def _repeats(n: Any) -> int | None:
    """A row's repeat count, None where the frame has none (NaN, NA)."""
    return None if n is None or pd.isna(n) else int(n)


def _spread(median: Any, mad: Any, n: Any) -> str:
    return with_spread(_fmt(median), _fmt(mad), _repeats(n))


def _tok_s_column(ns: Any) -> TableColumn:
    return tok_s_column(_repeats(n) for n in ns)


def _cell(row: Any) -> str:
    return rep.describe_cell(row) if row.get("algorithm") is not None else "—"


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    # The parent, and that the name is no link and a file if anything, were checked before
    # any work (cli/report.py). Replaced atomically: never written through a link that
    # appeared since, never half a file (a full disk leaves the old one).
    text = frame.to_csv(index=False, lineterminator="\n")
    try:
        replace_file(path, lambda fh: fh.write(text.encode("utf-8")))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the CSV: {write_problem(exc)}") from None


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    # to_json handles NA/NaN -> null and numpy scalars uniformly.
    return json.loads(frame.to_json(orient="records"))


def _machine(value: Any) -> str:
    """A GPU or host name as it fits a terminal column ('NVIDIA ' and '(simulated)' shortened)."""
    text = str(value)
    if text.startswith("NVIDIA "):
        text = text[len("NVIDIA "):]
    return text.replace(" (simulated)", " (sim)")


def _by_machine_run(frame: pd.DataFrame, *, sort: bool = True) -> list[tuple[Any, str | None, pd.DataFrame]]:
    """``frame``'s rows per (machine, run) (report.runs; run None where runs were pooled),
    sorted by machine then run (a run id starts with its start time), or in order of first
    appearance."""
    runs = frame["run"].astype(object).where(frame["run"].notna(), None) if "run" in frame else \
        pd.Series(None, index=frame.index, dtype=object)
    keys = list(dict.fromkeys(zip(frame["machine"].tolist(), runs.tolist(), strict=True)))
    if sort:
        keys.sort(key=lambda mr: (str(mr[0]), mr[1] or ""))
    return [(machine, run, frame[(frame["machine"] == machine) & (runs.isna() if run is None else runs == run)])
            for machine, run in keys]


def _apart(frame: pd.DataFrame) -> set[str]:
    """Machines of ``frame`` with rows of more than one run: their tables are named by run."""
    if "run" not in frame:
        return set()
    pairs = frame[["machine", "run"]].dropna().drop_duplicates()
    return {str(m) for m, n in pairs["machine"].value_counts().items() if n > 1}


def _named(machine: Any, run: str | None, apart: set[str], labels: dict[str, str]) -> str:
    """A table's machine as titles show it, with its run where the machine holds several."""
    text = _machine(machine)
    if run is not None and str(machine) in apart:
        text += f" — {labels.get(run, f'run {run}')}"
    return printable(text)


def _best_tables(
    best: pd.DataFrame, *, width: int, wide: bool, labels: dict[str, str] | None = None
) -> list[tuple[Table, Table | None]]:
    """One table of picks per machine (so no column is spent on long GPU names) and run
    (where a machine holds several: report.runs), each with a grid below it of one line per
    pick for its runner-up and notes, kept out of the table so that it fits an ordinary
    terminal."""
    out: list[tuple[Table, Table | None]] = []
    # Ledgers of several workloads give a pick per workload: the table says whose, or two
    # rows of one temperature and concurrency would read as a contradiction.
    several = best["workload_name"].nunique(dropna=False) > 1
    columns = (
        TableColumn("temp", "right"),
        TableColumn("conc", "right"),
        *([TableColumn("workload", wrap=True)] if several else []),
        TableColumn("mode"),
        TableColumn("best"),
        _tok_s_column(best["n"]),
        TableColumn("n", "right", drop=2),
        TableColumn("accept len", "right", drop=3),
        TableColumn("vs AR", "right"),
        TableColumn("vs DFlash", "right", drop=1),
    )
    apart = _apart(best)
    for machine, run, rows in _by_machine_run(best):
        cells: list[list[str | Text]] = []
        details = Table.grid(padding=(0, 1))
        details.add_column(no_wrap=True)
        details.add_column()
        # A note that every pick of the machine carries (the workload's "chat with ignore_eos")
        # is said once, not on every line.
        per_row = [[n for n in str(note).split("; ") if n] if note else [] for note in rows["note"]]
        shared = [n for n in per_row[0] if all(n in notes for notes in per_row)] if len(per_row) > 1 else []
        for _, row in rows.iterrows():
            picked = row["algorithm"] is not None
            # The modes column says "eager" already: the label does not repeat it.
            label = _cell(row).removesuffix(" eager")
            cells.append([
                _fmt(row["temperature"], 2),
                _fmt(row["concurrency"]),
                *([printable(str(row["workload_name"]))] if several else []),
                _modes(row["modes"]),
                Text(label, style="bold green") if picked else Text("none", style="red"),
                _spread(row["output_tok_s_median"], row["output_tok_s_mad"], row["n"]) if picked else "—",
                _fmt(row["n"]),
                _fmt(row["accept_length_median"], 2),
                _ratio(row["speedup_vs_ar"]) if picked else "—",
                _ratio(row["speedup_vs_dflash"]) if picked else "—",
            ])
            extra = [f"runner-up {row['runner_up']}"] if _fmt(row["runner_up"]) != "—" else []
            if row["algorithm"] == "AR":  # a pick of plain AR is news: say it
                extra.insert(0, "no DDTree or DFlash configuration beat AR here")
            extra += [n for n in (str(row["note"]).split("; ") if row["note"] else []) if n and n not in shared]
            if extra:
                details.add_row(
                    Text(f"  T={_fmt(row['temperature'], 2)} c={_fmt(row['concurrency'])} {_modes(row['modes'])}:"),
                    Text("; ".join(extra)),
                )
        for note in shared:
            details.add_row(Text("  every pick:"), Text(note))
        table = fitted_table(
            columns, cells, width=width, wide=wide,
            title=f"Best configuration — {_named(machine, run, apart, labels or {})}",
        )
        out.append((table, details if details.row_count else None))
    return out


def _category_tables(
    best: pd.DataFrame, cats: pd.DataFrame, *, width: int, wide: bool, labels: dict[str, str] | None = None
) -> list[Table]:
    """Per machine, each best pick broken down by data set / category: accept length and
    speedup over AR for that kind of traffic (a mixed workload's cell figure hides it)."""
    picks = best[best["algorithm"].notna()]
    if cats.empty or picks.empty:
        return []
    # The best table names its workload, not its hash.
    keys = ["machine", "run", "workload_name", *(k for k in rep.CELL_KEYS if k != "workload_hash")]
    joined = picks[keys].merge(cats, on=keys, how="inner")
    if joined.empty:
        return []
    columns = (
        TableColumn("temp", "right"),
        TableColumn("conc", "right"),
        TableColumn("best"),
        TableColumn("category", wrap=True),
        TableColumn("requests", "right", drop=1),
        TableColumn("accept len", "right"),
        TableColumn("user vs AR", "right"),
    )
    tables = []
    apart = _apart(joined)
    for machine, run, rows in _by_machine_run(joined):
        cells: list[list[str | Text]] = []
        for _, row in rows.iterrows():
            cells.append([
                _fmt(row["temperature"], 2), _fmt(row["concurrency"]), _cell(row), printable(str(row["category"])),
                _fmt(row["requests"]), _fmt(row["accept_length_median"], 2), _ratio(row["speedup_vs_ar"]),
            ])
        title = f"Best configurations per category — {_named(machine, run, apart, labels or {})}"
        tables.append(fitted_table(columns, cells, width=width, wide=wide, title=title))
    return tables


def _mix_tables(
    mixed: pd.DataFrame, weights: dict[str, float], *, width: int, wide: bool, labels: dict[str, str] | None = None
) -> list[Table]:
    columns = (
        TableColumn("temp", "right"),
        TableColumn("conc", "right"),
        TableColumn("best for the mix"),
        TableColumn("user vs AR", "right"),
        TableColumn("per data set", wrap=True),
        TableColumn("cells", "right", drop=1),
    )
    mix = ", ".join(f"{name} {w:.0%}" for name, w in weights.items())
    tables = []
    apart = _apart(mixed)
    for machine, run, rows in _by_machine_run(mixed):
        cells: list[list[str | Text]] = [
            [_fmt(r["temperature"], 2), _fmt(r["concurrency"]), _cell(r), _ratio(r["mix_speedup"]),
             printable(str(r["per_set"])), _fmt(r["candidates"])]
            for _, r in rows.iterrows()
        ]
        title = f"Best for the traffic mix {mix} — {_named(machine, run, apart, labels or {})}"
        tables.append(fitted_table(columns, cells, width=width, wide=wide, title=title))
    return tables


def _tidy_columns(tok_s: TableColumn) -> tuple[TableColumn, ...]:
    return (
        TableColumn("temp", "right"),
        TableColumn("conc", "right"),
        TableColumn("config"),
        TableColumn("mode", drop=7),  # the config label says "eager" already
        TableColumn("n", "right", drop=4),
        tok_s,
        TableColumn("accept len", "right", drop=2),
        TableColumn("TTFT p50 ms", "right", drop=6),
        TableColumn("ITL p50 ms", "right", drop=5),
        TableColumn("vs AR", "right"),
        TableColumn("vs DFlash", "right", drop=3),
        # Kept longest: outputs that differ from AR's at T = 0 are a correctness problem.
        TableColumn("T0=AR", "right", drop=1),
    )


def _t0(row: Any) -> str | Text:
    """T = 0 outputs equal to AR's, as 'equal/compared' (red when any differs)."""
    compared, frac = row["t0_prompts"], row["t0_match_frac"]
    if compared is pd.NA or pd.isna(frac) or not compared:
        return "—"
    equal = round(float(frac) * int(compared))
    text = f"{equal}/{int(compared)}"
    return text if equal == int(compared) else Text(text, style="bold red")


def _graph(row: Any) -> str | Text:
    """The cell's CUDA-graph mode; ``to N`` where its concurrency is above the graph
    ceiling N (its rounds of more than N requests ran eager; the conc column says ‡ too,
    since this column is the first to go on a narrow terminal)."""
    if not row["cuda_graph"]:
        return Text(EAGER, style="yellow")
    if row["above_graph_ceiling"]:
        return Text(f"to {int(row['cuda_graph_max_bs'])}", style="yellow")
    return GRAPHS


def _modes(modes: Any) -> str:
    """The best table's mode of a pick ("graph", "eager", "graph+eager" in the data and the
    CSV) in the words every table uses (cli.common.graph_mode)."""
    return "+".join(GRAPHS if m == "graph" else m for m in str(modes).split("+"))


def _tidy_tables(
    tidy: pd.DataFrame, limit: int | None, *, width: int, wide: bool, labels: dict[str, str] | None = None
) -> list[Table]:
    """The per-(host, cell) table, one per host (its name is the title, not a column) and
    run (where a host holds several: report.runs).
    ``limit`` rows in all when given; each title says how many of its rows it shows.
    min–max and every percentile are in --csv; the terminal keeps what fits."""
    shown = tidy if limit is None else tidy.head(limit)
    cells: list[list[str | Text]] = []
    for _, row in shown.iterrows():
        cells.append([
            _fmt(row["temperature"], 2),
            _fmt(row["concurrency"]) + ("‡" if row["above_graph_ceiling"] else ""),
            _cell(row),
            _graph(row),
            _fmt(row["n"]),
            _spread(row["output_tok_s_median"], row["output_tok_s_mad"], row["n"]),
            _fmt(row["accept_length_median"], 2),
            _fmt(row["ttft_ms_median"]),
            _fmt(row["itl_ms_median"], 2),
            _ratio(row["speedup_vs_ar"]) + ("†" if row["modes_mixed"] else ""),
            _ratio(row["speedup_vs_dflash"]),
            _t0(row),
        ])
    runs = tidy["run"].astype(object).where(tidy["run"].notna(), None) if "run" in tidy else \
        pd.Series(None, index=tidy.index, dtype=object)
    places = list(zip(tidy["machine"].tolist(), runs.tolist(), strict=True))
    shown_places = places[: len(shown)]
    columns = _tidy_columns(_tok_s_column(shown["n"]))
    tables = []
    apart = _apart(tidy)
    for machine, run in dict.fromkeys(shown_places):
        rows = [c for place, c in zip(shown_places, cells, strict=True) if place == (machine, run)]
        total = places.count((machine, run))
        count = f"{len(rows)} rows" if len(rows) == total else f"first {len(rows)} of {total} rows"
        title = f"Cells — {_named(machine, run, apart, labels or {})} ({count})"
        # Sized by every host's rows: the tables show the same columns, equally wide.
        tables.append(fitted_table(columns, rows, width=width, wide=wide, title=title, sized_by=cells))
    return tables


def _compare_table(cmp: pd.DataFrame, *, width: int, wide: bool) -> Table:
    columns = (
        TableColumn("host", wrap=True),
        TableColumn("temp", "right"),
        TableColumn("conc", "right"),
        TableColumn("config"),
        TableColumn("tok/s a", "right", drop=2),
        TableColumn("tok/s b", "right", drop=1),
        TableColumn("ratio", "right"),
        TableColumn("change"),
    )
    cells: list[list[str | Text]] = []
    several_runs = any(cmp[side].dropna().nunique() > 1 for side in ("run_a", "run_b") if side in cmp)
    for _, row in cmp.iterrows():
        graph = row["cuda_graph_b"] if row["cuda_graph_b"] is not pd.NA else row["cuda_graph_a"]
        label = rep.describe_cell({**row.to_dict(), "cuda_graph": bool(graph) if graph is not pd.NA else True})
        change: str | Text
        if row["only_in"]:
            change = f"only in {row['only_in']}"
        elif row["changed"]:
            change = Text(str(row["direction"]), style="green" if row["direction"] == "faster" else "red")
        else:
            change = ""
        machine = _machine(row["machine"])
        if several_runs:  # a side with cells of several runs: each row names its pair of runs
            machine += f" (run {row['run_a'] or '—'} / {row['run_b'] or '—'})"
        cells.append([
            printable(machine), _fmt(row["temperature"], 2), _fmt(row["concurrency"]), label,
            _fmt(row["output_tok_s_a"]), _fmt(row["output_tok_s_b"]), _fmt(row["ratio"], 3), change,
        ])
    return fitted_table(
        columns, cells, width=width, wide=wide,
        title="Comparison (b / a) — changes beyond 2·(σa+σb), σ = 1.4826·MAD",
    )


def _predicted_table(pvm: pd.DataFrame, *, width: int, wide: bool) -> Table:
    """Predicted cells (bench --predict) beside what was measured of them: never ranked.
    At 80 columns the acceptance columns give way (the caption says so), never a word."""
    columns = (
        TableColumn("host", wrap=True), TableColumn("T", "right"), TableColumn("c", "right"),
        TableColumn("tree"), TableColumn("tok/s pred", "right"),
        # A cell the sweep did not measure says so here, where its measurement would be.
        TableColumn("tok/s meas", "right"), TableColumn("tok/s err", "right", drop=1),
        TableColumn("accept pred", "right", drop=2), TableColumn("accept meas", "right", drop=3),
    )
    rows: list[list[str | Text]] = []
    for _, r in pvm.iterrows():
        measured = bool(r["measured"])
        rows.append([
            printable(str(r["host"])), f"{r['temperature']:g}", str(int(r["concurrency"])),
            f"b{int(r['budget'])} k{int(r['topk'])}", _fmt(r["predicted_tok_s"]),
            _fmt(r["measured_tok_s"]) if measured else Text("predicted only", style="yellow"),
            f"{r['tok_s_error']:+.1%}" if measured else "",
            _fmt(r["predicted_accept"], 2), _fmt(r["measured_accept"], 2) if measured else "",
        ])
    title = ("Predicted vs measured (bench --predict): predicted cells are never ranked, "
             "'predicted only' cells were not measured")
    return fitted_table(columns, rows, width=width, wide=wide, title=title)


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


def _print_runs(console: Console, result: rep.Report) -> None:
    """Said once, before the tables, where runs decide what a table means: the runs a machine
    holds shown apart (each its own cells, baselines and best picks, its tables named by
    run), or pooled as repeats (``--pool-runs``). One run per machine needs no word."""
    runs = result.loaded.runs
    apart = result.runs_apart()
    if result.pooled_runs:
        console.print(f"[yellow]Pooled {len(runs)} runs as repeats of their cells (--pool-runs):[/]", highlight=False)
    elif apart:
        machines = escape(printable(", ".join(_machine(m) for m in apart)))
        console.print(f"[yellow]{len(runs)} runs in these ledgers; several measured {machines}:[/] each run is shown "
                      "apart (its own cells, baselines and best picks); --pool-runs pools them as repeats, --run RUN "
                      "shows one.", highlight=False)
    else:
        return
    for run in runs[:10]:
        console.print(f"  {printable(run.describe())}", highlight=False, markup=False, soft_wrap=True)
    if len(runs) > 10:
        console.print(f"  … and {len(runs) - 10} more (see --json)", highlight=False)


def run_report(
    obj: AppContext,
    *,
    ledgers: list[Path] | None,
    csv: Path | None,
    csv_best: Path | None,
    csv_categories: Path | None,
    plots: Path | None,
    group_by: str,
    min_repeats: int | None,
    weights: dict[str, float] | None,
    mix_modes: bool,
    compare_with: list[Path] | None,
    show_cells: int | None,
    wide: bool,
    as_json: bool,
    pool_runs: bool = False,
    runs: list[str] | None = None,
) -> None:
    """The report once its options are checked (see cli/report.py)."""
    result = rep.build_report(list(ledgers or []), group_by=group_by, min_repeats=min_repeats, mix_modes=mix_modes,  # type: ignore[arg-type]
                              pool_runs=pool_runs, runs=runs or ())
    labels = dict(result.run_labels())
    cmp = None
    if compare_with:
        other = rep.load_tidy(list(compare_with), pool_runs=pool_runs)
        cmp = rep.compare(other, result.tidy)
    if csv:
        _write_csv(result.tidy, csv)
    if csv_best:
        _write_csv(result.best.best, csv_best)
    from ddtree_ops.report.categories import category_table

    cats = category_table(list(result.loaded.files), by=result.group_by, run_of=result.loaded.run_of())
    if csv_categories:
        _write_csv(cats, csv_categories)
    mixed = None
    if weights is not None:
        from ddtree_ops.report.mix import best_for_mix

        mixed = best_for_mix(cats, weights)
    written: list[Path] = []
    if plots:
        from ddtree_ops.report.plots import write_plots

        written = write_plots(result.grouped, plots, run_labels=labels)
        from ddtree_ops.report.plots import write_predicted_plots
        from ddtree_ops.report.predicted import predicted_vs_measured as _pvm

        written += write_predicted_plots(_pvm(result.loaded.predicted, result.loaded.frame), plots)

    loaded = result.loaded
    from ddtree_ops.report.predicted import predicted_vs_measured, probes

    pvm = predicted_vs_measured(loaded.predicted, loaded.frame)
    if as_json:
        payload: dict[str, Any] = {
            # bench --predict: every predicted cell beside its measurement (measured: false =
            # predicted only); never part of "cells" or "best".
            "predicted": _records(pvm),
            "probes": _records(probes(loaded.predicted)),
            "files": [str(p) for p in loaded.files],
            "rows": len(loaded.frame),
            "bad_lines": [{"file": f, "line": n, "reason": r} for f, n, r in loaded.bad_lines],
            "duplicates": [{"file": f, "rows": n} for f, n in loaded.duplicates],
            "cells": _records(result.tidy),
            "best": _records(result.best.best),
            "refusals": _records(result.best.refusals),
            "unmeasured": _records(result.unmeasured),
            "categories": _records(cats),
            "min_repeats": result.min_repeats,
            "plots": [str(p) for p in written],
            # The runs read (report.runs; "run" in cells, best and refusals names one), whether
            # --pool-runs pooled them (cells' run null), and per machine the runs shown apart.
            "runs": [run.as_json() for run in loaded.runs],
            "pool_runs": loaded.pooled,
            "runs_apart": result.runs_apart(),
        }
        if cmp is not None:
            payload["compare"] = _records(cmp)
        if mixed is not None:
            payload["mix"] = {"weights": weights, "best": _records(mixed)}
        from ddtree_ops.cli.common import set_json_data

        set_json_data(obj, payload)
        _raise_if_all_refused(result)
        return

    console = obj.console
    console.print(f"Read {len(loaded.frame):,} rows from {len(loaded.files)} ledger(s).", highlight=False)
    _print_skipped(console, loaded)
    _print_runs(console, result)
    width = console.width
    if show_cells != 0:
        for table in _tidy_tables(result.tidy, show_cells, width=width, wide=wide, labels=labels):
            print_table(console, table)
        if show_cells is not None and show_cells < len(result.tidy):
            console.print(
                f"Showed {show_cells} of {len(result.tidy)} cell rows (--show-cells {show_cells}): every row without "
                "--show-cells, every row and column with --csv FILE.",
                highlight=False, markup=False,
            )
        if result.tidy["modes_mixed"].head(show_cells if show_cells is not None else len(result.tidy)).any():
            console.print("† speedup measured against a baseline in the other CUDA-graph mode.", highlight=False)
        if result.tidy["above_graph_ceiling"].head(show_cells if show_cells is not None else len(result.tidy)).any():
            console.print("‡ concurrency above the graph ceiling of the cell's tree (mode: to N, the largest batch "
                          "its verify graph replays): rounds of more requests ran eager; raise "
                          "--cuda-graph-max-bs-decode.",
                          highlight=False, markup=False)
    if cmp is not None:
        print_table(console, _compare_table(cmp, width=width, wide=wide))
    if len(pvm):
        print_table(console, _predicted_table(pvm, width=width, wide=wide))
    for _, gone in result.unmeasured.iterrows():
        console.print(f"[yellow]not measured:[/] {escape(str(gone['host']))}: {int(gone['rows'])} row(s) failed before "
                      f"any server served them (not cells): {escape(printable(str(gone['reason'])))}",
                      highlight=False)
    refusals = result.best.refusals
    if len(refusals):
        console.print(f"[yellow]{len(refusals)} cell(s) not eligible for best config:[/]", highlight=False)
        apart = _apart(result.grouped)
        for _, refusal in refusals.head(10).iterrows():
            where = _named(refusal["machine"], refusal["run"] if isinstance(refusal["run"], str) else None, apart,
                           labels)
            console.print(
                f"  {where} T={refusal['temperature']:g} c={refusal['concurrency']} {refusal['cell']}:"
                f" {refusal['reason']}",
                highlight=False, markup=False,
            )
        if len(refusals) > 10:
            console.print(f"  … and {len(refusals) - 10} more (see --json)", highlight=False)
    for label, path in (("tidy CSV", csv), ("best CSV", csv_best), ("per-category CSV", csv_categories)):
        if path:
            console.print(f"Wrote {label}: {path}", highlight=False)
    if written:
        console.print(f"Wrote {len(written)} plot(s) to {plots}", highlight=False)
    console.print(
        "Best configuration per machine, temperature and concurrency (score = median − 1.4826·MAD of "
        "output tok/s; within 1% the cheaper config wins):",
        highlight=False,
    )
    workloads = sorted(str(w) for w in result.best.best["workload_name"].dropna().unique())
    if len(workloads) > 1:
        console.print(f"[yellow]These ledgers measured {len(workloads)} workloads[/] ({escape(', '.join(workloads))}): "
                      "each is picked for on its own (the workload column); pass one sweep's ledger to compare "
                      "within it only.", highlight=False)
    for table, details in _best_tables(result.best.best, width=width, wide=wide, labels=labels):
        print_table(console, table)
        if details is not None:
            console.print(details)
    if result.pooled_runs:  # said under the picks too: they are what a reader acts on
        console.print(f"[yellow]These picks pool {len(loaded.runs)} runs as repeats of one cell (--pool-runs; the "
                      "runs are listed above).[/]", highlight=False)
    for table in _category_tables(result.best.best, cats, width=width, wide=wide, labels=labels):
        print_table(console, table)
    if mixed is not None and weights is not None:
        for table in _mix_tables(mixed, weights, width=width, wide=wide, labels=labels):
            print_table(console, table)
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
