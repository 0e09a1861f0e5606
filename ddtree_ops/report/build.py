"""Ledger paths -> a whole report: load, aggregate per host and per machine, pick the best.

These are the entry points the CLI calls; each step lives in its own module
(:mod:`.loading`, :mod:`.aggregation`, :mod:`.best`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ddtree_ops.errors import ConfigError
from ddtree_ops.report import lossless
from ddtree_ops.report.aggregation import GroupBy, aggregate, aggregate_levels
from ddtree_ops.report.best import DEFAULT_MIN_REPEATS, BestConfigs, best_configs
from ddtree_ops.report.loading import LoadedLedgers, load_ledgers


@dataclass(frozen=True)
class Report:
    loaded: LoadedLedgers
    tidy: pd.DataFrame  # per (host, cell)
    grouped: pd.DataFrame  # per (group-by machine, cell): what best configs and plots use
    best: BestConfigs
    group_by: GroupBy
    min_repeats: int = DEFAULT_MIN_REPEATS  # what cells were held to (given, or planned_repeats)
    min_repeats_planned: bool = False  # True when it came from the ledgers' sweeps
    # Failed rows no server measured (host unreachable, lease refused, server never started):
    # per host, how many and the first reason; they are not cells (split_unmeasured).
    unmeasured: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=["host", "rows", "reason"]))

    @property
    def pooled_runs(self) -> bool:
        """``--pool-runs`` pooled more than one run's rows into cells (the output says so)."""
        return self.loaded.pooled and len(self.loaded.runs) > 1

    def runs_apart(self) -> dict[str, list[str]]:
        """Machine -> its runs, where a machine of the per-machine table holds cells of more
        than one run: shown apart, each with its own cells and best picks."""
        pairs = self.grouped[["machine", "run"]].dropna().drop_duplicates()
        out: dict[str, list[str]] = {}
        for machine, run in zip(pairs["machine"], pairs["run"], strict=True):
            out.setdefault(str(machine), []).append(str(run))
        return {machine: sorted(runs) for machine, runs in sorted(out.items()) if len(runs) > 1}

    def run_labels(self) -> Mapping[str, str]:
        """A run's id -> how the output names it (``run <id> (<started>)``)."""
        return {run.run: run.label for run in self.loaded.runs}

    @property
    def all_refused(self) -> bool:
        """Every cell refused: no configuration can be recommended from these ledgers."""
        return len(self.grouped) > 0 and len(self.best.refusals) >= len(self.grouped)


def split_unmeasured(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rows a server measured, per-host summary of failed rows none did).

    A failed row without a ``launch_id`` was never served (the host could not be reached,
    another sweep's lease refused it, its server did not start): as a cell it would read
    "AR eager: 1 failed repeat(s)", a configuration that was never run. Ledgers from before
    ``launch_id`` existed have it null on every row; their runs are left as they are unless
    nothing in the run was measured at all."""
    columns = ["host", "rows", "reason"]
    if frame.empty:
        return frame, pd.DataFrame(columns=columns)
    no_launch = frame["launch_id"].isna()
    failed = frame["status"] != "ok"
    run_has_launch = (~no_launch).groupby(frame["run_id"], dropna=False).transform("any")
    run_has_ok = (~failed).groupby(frame["run_id"], dropna=False).transform("any")
    mask = failed & no_launch & (run_has_launch | ~run_has_ok)
    if not mask.any():
        return frame, pd.DataFrame(columns=columns)
    gone = frame[mask]
    summary = gone.groupby("host", sort=True).agg(rows=("status", "size"), reason=("error", "first")).reset_index()
    return frame[~mask].reset_index(drop=True), summary[columns]


def planned_repeats(frame: pd.DataFrame) -> int:
    """How many repeats the ledgers' sweeps planned: per sweep the highest ``repeat`` + 1
    (rows do not carry the planned count, and a sweep's last repeat index is it, failed
    rows included); the smallest of those when the ledgers hold several sweeps, so that no
    sweep's cells are held to another sweep's count."""
    if frame.empty:
        return 1
    per_sweep = (frame.groupby("sweep", dropna=False)["repeat"].max() + 1).dropna()
    return max(1, int(per_sweep.min())) if len(per_sweep) else 1


def build_report(
    paths: Sequence[Path | str],
    *,
    group_by: GroupBy = "gpu",
    min_repeats: int | None = None,
    mix_modes: bool = False,
    use_arrow: bool | None = None,
    pool_runs: bool = False,
    runs: Sequence[str] = (),
) -> Report:
    """Load, aggregate per host and per ``group_by`` machine, pick best configs.

    Cells are per run (:mod:`.runs`): the same cell of two runs is two cells, each with its
    own baselines and best pick; ``pool_runs`` pools them as repeats of one cell
    (:attr:`Report.pooled_runs` says it did). ``runs`` keeps only the runs it names
    (``--run``: a run's id or any of its invocations' run_id).

    ``min_repeats=None`` holds cells to the repeats their sweep planned
    (:func:`planned_repeats`): a one-repeat demo sweep is reported, a cell that lost
    repeats of a three-repeat sweep is refused.

    An empty result (no ledger files, or files with no valid row) is a ConfigError that
    says what was looked at, because an empty table would read as "nothing is faster".
    """
    if min_repeats is not None and min_repeats < 1:
        raise ConfigError(f"--min-repeats must be at least 1, not {min_repeats}")
    loaded = load_ledgers(paths, use_arrow=use_arrow)
    if runs:
        loaded = loaded.only_runs(runs)
    if pool_runs:
        loaded = loaded.pool_runs()
    if loaded.frame.empty:
        where = ", ".join(str(path) for path in paths) if paths else "results/"
        if not loaded.files:
            raise ConfigError(f"no ledger (*.jsonl) found in {where}; run `ddtree-ops bench --sweep ...` first")
        detail = ""
        if loaded.bad_lines:
            file, line, reason = loaded.bad_lines[0]
            detail = f" ({len(loaded.bad_lines)} bad line(s), first: {file}:{line}: {reason})"
        raise ConfigError(f"no valid ledger rows in {len(loaded.files)} file(s) under {where}{detail}")
    measured, unmeasured = split_unmeasured(loaded.frame)
    if measured.empty:
        first = unmeasured.iloc[0]
        raise ConfigError(f"no row of these ledgers was measured: {int(unmeasured['rows'].sum())} failed row(s) that "
                          f"no server served (first, {first['host']}: {first['reason']})")
    # Per-host rows always; grouping by GPU as well shares the one costly row grouping.
    levels = aggregate_levels(measured, ("host",) if group_by == "host" else ("host", group_by))
    tidy, grouped = levels["host"], levels[group_by]
    # T = 0 losslessness from the rows' output hashes (not in the loaded columns: lists).
    matches = lossless.output_matches(list(loaded.files), by=("host", group_by), run_of=loaded.run_of())
    tidy = lossless.attach(tidy, matches["host"])
    grouped = tidy if group_by == "host" else lossless.attach(grouped, matches[group_by])
    planned = min_repeats is None
    threshold = planned_repeats(measured) if min_repeats is None else min_repeats
    best = best_configs(grouped, min_repeats=threshold, mix_modes=mix_modes)
    return Report(
        loaded=loaded, tidy=tidy, grouped=grouped, best=best, group_by=group_by,
        min_repeats=threshold, min_repeats_planned=planned, unmeasured=unmeasured,
    )


def load_tidy(paths: Sequence[Path | str], *, by: GroupBy = "host", pool_runs: bool = False) -> pd.DataFrame:
    """Tidy table of other ledgers (for ``--compare``), per run unless ``pool_runs``;
    ConfigError when empty."""
    loaded = load_ledgers(paths)
    if pool_runs:
        loaded = loaded.pool_runs()
    if loaded.frame.empty:
        raise ConfigError(f"no valid ledger rows in {', '.join(str(path) for path in paths)}")
    return aggregate(loaded.frame, by=by)
