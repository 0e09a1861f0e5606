"""A report's best tree per machine type and concurrency -> the DDTREE per-batch-size policy.

The DDTree plugin (and the simulator) read a runtime-state file given with
``--speculative-adaptive-config`` (the server contract, issue 25):

    {"ddtree": {"budgets": [4, 8], "topk_max": 4,
                "policy": {"1": {"budget": 8, "topk": 4}, "4": {"budget": 4, "topk": 2}}}}

A round of batch size ``bs`` uses the entry of the largest key <= ``bs``. ``ddtree-ops
tune`` fills one such file per machine type from a ledger: for every concurrency the
ledger measured, the tree :func:`ddtree_ops.report.best.best_configs` recommends among the
DDTREE cells (highest median − 1.4826·MAD of output tok/s; within 1% the smaller tree),
the concurrency standing for the batch size.

Why the rules below:

- **One temperature.** The file keys trees by batch size only, so it is chosen for one
  sampling temperature (``--temperature``, default :data:`DEFAULT_TEMPERATURE`): greedy
  and sampled acceptance differ, and averaging them would fit neither.
- **Eager and CUDA-graph cells never meet.** Eager numbers are not comparable with graph
  numbers (a verify graph is worth several x), and one server serves a tree either way.
  A machine type with CUDA-graph DDTREE cells is tuned among those only (its eager cells,
  e.g. the B300's fallbacks above budget 8, are named in a note); one with none is tuned
  among its eager cells, and says so. ``best_configs`` keeps the two modes apart already
  (``mix_modes=False``); this module decides which mode a machine type is tuned in.
- **Refuse rather than guess.** No DDTREE rows for a machine type or temperature, a
  concurrency measured only in the mode not chosen, cells under several workloads, or a
  concurrency whose every cell was refused (failures, too few repeats): each is one line
  naming the ledger and what is missing. A policy with a hole would route those batch
  sizes to a neighbour's tree that nobody measured there.
- **One run** (:mod:`.runs`). A machine type's DDTREE cells at the temperature from two
  runs (the same sweep run twice into ``results/``) are refused, the runs named: pooled,
  two runs' conditions read as one cell's noise, and the latest run is not always the one
  to trust (it may be the interrupted one). ``--pool-runs`` pools them as repeats on
  purpose, ``--run RUN`` tunes one; a ``bench --resume`` continues its run, so a resumed
  sweep is one run.

Nothing here prints or touches a host; :func:`tune_ledgers` reads files, the rest is pure.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pandas as pd

from ddtree_ops.errors import BenchError, ConfigError
from ddtree_ops.limits import policy_problem
from ddtree_ops.report.aggregation import aggregate, machine_column
from ddtree_ops.report.best import TIE_TOLERANCE, best_configs, describe_cell
from ddtree_ops.report.build import planned_repeats
from ddtree_ops.report.loading import load_ledgers
from ddtree_ops.report.runs import Run

#: The temperature a policy is tuned for unless the user names one: greedy decoding,
#: the setting speculative decoding is usually deployed and compared at.
DEFAULT_TEMPERATURE = 0.0
#: Temperatures are floats read back from JSON; equal within this are the same setting.
_TEMPERATURE_TOLERANCE = 1e-9
#: What a policy is chosen under besides the temperature: one value each, or refused.
_CONDITION_COLUMNS: tuple[str, ...] = ("top_p", "top_k", "request_rate", "workload_hash")


@dataclass(frozen=True)
class PolicyEntry:
    """The tree chosen for one batch size (the ledger's concurrency), and its evidence."""

    concurrency: int
    budget: int
    topk: int
    output_tok_s: float  # median over the cell's ok repeats
    output_tok_s_mad: float
    n: int  # ok repeats
    accept_length: float | None
    speedup_vs_ar: float | None
    runner_up: str | None  # the next-best cell and how far below, as the report says it
    note: str | None  # the report's note on the pick (a cheaper tree kept within the tie tolerance)


@dataclass(frozen=True)
class Policy:
    """One machine type's per-batch-size trees at one temperature, in one graph mode."""

    machine: str  # the GPU type as the ledger names it (the report's machine), or a host
    temperature: float
    cuda_graph: bool  # the mode the trees were chosen in
    entries: tuple[PolicyEntry, ...]  # by concurrency, ascending; never empty
    hosts: tuple[str, ...]  # ledger hosts of this machine type
    notes: tuple[str, ...] = ()
    run: str | None = None  # the run its cells are of (report.runs); None: runs pooled (--pool-runs)

    def __post_init__(self) -> None:
        # Never a file the server would refuse (limits.policy_problem: its own checks and
        # bounds): written or deployed, it would fail the launch after the old server stopped.
        if problem := ("no batch sizes" if not self.entries else policy_problem(self.config())):
            raise ConfigError(f"policy for machine type {self.machine}: {problem}; not written")

    @property
    def budgets(self) -> tuple[int, ...]:
        """The runtime states the server builds: only the budgets the policy uses (each
        one costs a verify graph capture at launch)."""
        return tuple(sorted({e.budget for e in self.entries}))

    @property
    def topk_max(self) -> int:
        return max(e.topk for e in self.entries)

    @property
    def launch(self) -> PolicyEntry:
        """The state the server is launched at (its budget must be in ``budgets``): the
        smallest batch size's tree, the one a lone first request is decoded with."""
        return self.entries[0]

    def policy_map(self) -> dict[str, dict[str, int]]:
        """The contract's ``ddtree.policy``: decimal batch-size keys, ascending."""
        return {str(e.concurrency): {"budget": e.budget, "topk": e.topk} for e in self.entries}

    def config(self) -> dict[str, Any]:
        """The whole ``--speculative-adaptive-config`` document."""
        return {"ddtree": {"budgets": list(self.budgets), "topk_max": self.topk_max, "policy": self.policy_map()}}

    def render(self, eager_budgets: tuple[int, ...] = ()) -> str:
        """The file's text: deterministic, so that its sha256 names its content, and one
        line per batch size, so that a person reads it (and diffs two of them) at a glance.
        ``eager_budgets``: the bundle's ``ddtree.eager_budgets``, the budgets this machine
        is recorded to fail capturing (the eager fallbacks), left out when none."""
        tree = self.config()["ddtree"]
        entries = ",\n".join(f"      {json.dumps(bs)}: {json.dumps(e)}" for bs, e in tree["policy"].items())
        eager = f'    "eager_budgets": {json.dumps(sorted(eager_budgets))},\n' if eager_budgets else ""
        return (
            '{\n  "ddtree": {\n'
            f'    "budgets": {json.dumps(tree["budgets"])},\n'
            f"{eager}"
            f'    "topk_max": {json.dumps(tree["topk_max"])},\n'
            f'    "policy": {{\n{entries}\n    }}\n'
            "  }\n}\n"
        )

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.render().encode()).hexdigest()

    @property
    def file_name(self) -> str:
        """``--out DIR`` names: one file per machine type, named after it."""
        return policy_file_name(self.machine)


def policy_file_name(machine: str) -> str:
    """``NVIDIA B300 SXM6 AC (simulated)`` -> ``nvidia-b300-sxm6-ac-simulated.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")
    return f"{slug or 'machine'}.json"


@dataclass(frozen=True)
class Tuning:
    """What ``tune`` read and chose: a policy per machine type, and where each ledger host
    belongs (which machine type's policy a host of the ledger gets)."""

    policies: tuple[Policy, ...]
    files: tuple[Path, ...]
    rows: int
    bad_lines: int
    min_repeats: int
    temperature: float
    host_machines: Mapping[str, str]  # ledger host -> machine type
    # bench --predict: DDTree cells predicted at the tuned temperature but never measured
    # (host, budget, topk, concurrency, predicted tok/s): not chosen from, listed so.
    predicted_only: tuple[Mapping[str, Any], ...] = ()
    runs: tuple[Run, ...] = ()  # the runs read (after --run), oldest first
    pooled: bool = False  # --pool-runs: their cells pooled

    @property
    def pooled_runs(self) -> bool:
        """``--pool-runs`` pooled more than one run's rows into cells (the output says so)."""
        return self.pooled and len(self.runs) > 1

    def policy_for(self, machine: str) -> Policy | None:
        return next((p for p in self.policies if p.machine == machine), None)


def tune_ledgers(
    paths: Sequence[Path | str],
    *,
    temperature: float = DEFAULT_TEMPERATURE,
    machines: Sequence[str] = (),
    min_repeats: int | None = None,
    tie_tolerance: float = TIE_TOLERANCE,
    pool_runs: bool = False,
    runs: Sequence[str] = (),
) -> Tuning:
    """Read ledgers and choose a policy per machine type (:func:`choose_policies`).

    ``min_repeats=None`` holds cells to the repeats their sweep planned, as ``report`` does.
    ``runs``: only these runs (``--run``); ``pool_runs``: their cells pooled (``--pool-runs``),
    else a machine type's cells of several runs are refused.
    """
    if min_repeats is not None and min_repeats < 1:
        raise ConfigError(f"--min-repeats must be at least 1, not {min_repeats}")
    loaded = load_ledgers(paths)
    if runs:
        loaded = loaded.only_runs(runs)
    if pool_runs:
        loaded = loaded.pool_runs()
    where = ", ".join(str(p) for p in paths) if paths else "results/"
    if loaded.frame.empty:
        if not loaded.files:
            raise ConfigError(f"no ledger (*.jsonl) found in {where}; run `ddtree-ops bench --sweep ...` first")
        raise ConfigError(f"{where}: no valid ledger rows in {len(loaded.files)} file(s)")
    threshold = planned_repeats(loaded.frame) if min_repeats is None else min_repeats
    grouped = aggregate(loaded.frame, by="gpu")
    try:
        policies = choose_policies(
            grouped, temperature=temperature, source=where, machines=machines, min_repeats=threshold,
            tie_tolerance=tie_tolerance, run_labels={run.run: run.label for run in loaded.runs},
        )
    except (ConfigError, BenchError) as exc:
        # "No DDTREE rows" where every DDTREE row was a bad line must say so: the rows
        # are there, refused (a budget of -4, a null top-k), not missing.
        if loaded.bad_lines:
            exc.message = f"{exc.message} ({len(loaded.bad_lines)} bad line(s) skipped: `report` lists them)"
        raise
    from ddtree_ops.report.predicted import predicted_vs_measured

    pvm = predicted_vs_measured(loaded.predicted, loaded.frame)
    pvm = pvm.loc[~pvm["measured"].astype(bool) & (pvm["temperature"] == temperature)]
    return Tuning(
        predicted_only=tuple({"host": r["host"], "budget": int(r["budget"]), "topk": int(r["topk"]),
                              "concurrency": int(r["concurrency"]), "predicted_tok_s": float(r["predicted_tok_s"])}
                             for _, r in pvm.iterrows()),
        policies=policies,
        files=loaded.files,
        rows=len(loaded.frame),
        bad_lines=len(loaded.bad_lines),
        min_repeats=threshold,
        temperature=temperature,
        host_machines=MappingProxyType(host_machines(loaded.frame)),
        runs=loaded.runs,
        pooled=loaded.pooled,
    )


def host_machines(frame: pd.DataFrame) -> dict[str, str]:
    """Ledger host -> its machine type, as the report groups it (GPU name, else the host).
    A host whose rows name several GPU types keeps the first (file order)."""
    machine = machine_column(frame, "gpu")
    pairs = pd.DataFrame({"host": frame["host"], "machine": machine}).drop_duplicates("host")
    return {str(h): str(m) for h, m in zip(pairs["host"], pairs["machine"], strict=True)}


def choose_policies(
    grouped: pd.DataFrame,
    *,
    temperature: float = DEFAULT_TEMPERATURE,
    source: str,
    machines: Sequence[str] = (),
    min_repeats: int = 1,
    tie_tolerance: float = TIE_TOLERANCE,
    run_labels: Mapping[str, str] | None = None,
) -> tuple[Policy, ...]:
    """One :class:`Policy` per machine type of ``grouped`` (the per-GPU-type tidy table,
    :func:`ddtree_ops.report.aggregation.aggregate` ``by="gpu"``), or of ``machines`` when
    given. ``source`` names the ledger(s) in refusals.

    Raises ConfigError (exit 2) when the ledger lacks what a policy needs (a machine type,
    its DDTREE rows, rows at ``temperature``, a concurrency in the chosen graph mode, one
    workload, one run) and BenchError (exit 6) when a concurrency has DDTREE cells but
    every one was refused, like ``report`` when nothing can be recommended. ``run_labels``:
    how a refusal names a run (its id where absent).
    """
    known = sorted({str(m) for m in grouped["machine"]})
    wanted = list(dict.fromkeys(machines)) or known
    for machine in wanted:
        if machine not in known:
            raise ConfigError(
                f"{source}: no rows for machine type {machine!r} (the ledger has: {', '.join(known) or 'none'})"
            )
    return tuple(
        _policy(grouped[grouped["machine"] == machine], machine, temperature=temperature, source=source,
                min_repeats=min_repeats, tie_tolerance=tie_tolerance, run_labels=run_labels or {})
        for machine in wanted
    )


def _same_temperature(column: pd.Series, temperature: float) -> pd.Series:
    return (column.astype("float64") - temperature).abs() <= _TEMPERATURE_TOLERANCE


def _temperatures(column: pd.Series) -> str:
    return ", ".join(f"{t:g}" for t in sorted(set(column.astype("float64"))))


def _policy(
    cells: pd.DataFrame, machine: str, *, temperature: float, source: str, min_repeats: int, tie_tolerance: float,
    run_labels: Mapping[str, str],
) -> Policy:
    where = f"{source}: machine type {machine}"
    trees = cells[cells["algorithm"] == "DDTREE"]
    if trees.empty:
        algorithms = ", ".join(sorted({str(a) for a in cells["algorithm"]}))
        raise ConfigError(f"{where}: no DDTREE rows (only {algorithms}); nothing to tune")
    at_t = trees[_same_temperature(trees["temperature"], temperature)]
    if at_t.empty:
        raise ConfigError(
            f"{where}: no DDTREE rows at temperature {temperature:g} (DDTREE rows at: "
            f"{_temperatures(trees['temperature'])}); choose one with --temperature"
        )
    runs = _runs_of(at_t)
    if len(runs) > 1:
        named = "; ".join(run_labels.get(run, f"run {run}") for run in runs[:5])
        named += f"; and {len(runs) - 5} more" if len(runs) > 5 else ""
        raise ConfigError(
            f"{where}, temperature {temperature:g}: DDTREE cells of {len(runs)} runs ({named}); tune does not pool "
            "runs silently: --pool-runs pools them as repeats of one cell, --run RUN tunes one"
        )
    graph_mask = at_t["cuda_graph"].astype(bool)
    cuda_graph = bool(graph_mask.any())
    chosen, left_out = (at_t[graph_mask], at_t[~graph_mask]) if cuda_graph else (at_t, at_t.iloc[0:0])
    notes: list[str] = []
    if cuda_graph and len(left_out):
        labels = ", ".join(dict.fromkeys(describe_cell(row) for _, row in left_out.iterrows()))
        notes.append(
            f"chosen among CUDA-graph cells; {len(left_out)} eager cell(s) left out ({labels}): "
            "eager and graph numbers are never compared"
        )
    elif not cuda_graph:
        notes.append("no CUDA-graph DDTREE cells: chosen among eager cells")
    only_other_mode = sorted(set(at_t["concurrency"].dropna().astype(int)) - set(chosen["concurrency"].astype(int)))
    if only_other_mode:
        shown = ", ".join(str(c) for c in only_other_mode)
        raise ConfigError(
            f"{where}, temperature {temperature:g}: concurrency {shown} has only eager DDTREE cells while the others "
            "have CUDA-graph cells, and eager and graph cells are never mixed in one policy; measure it with graphs"
        )
    conditions = chosen[list(_CONDITION_COLUMNS)].drop_duplicates()
    if len(conditions) > 1:
        names = [c for c in _CONDITION_COLUMNS if chosen[c].nunique(dropna=False) > 1]
        raise ConfigError(
            f"{where}, temperature {temperature:g}: DDTREE cells under {len(conditions)} different settings of "
            f"{', '.join(names)}; a policy is chosen under one: tune a ledger of one sweep"
        )
    best = best_configs(chosen, min_repeats=min_repeats, mix_modes=False, tie_tolerance=tie_tolerance)
    entries: list[PolicyEntry] = []
    for _, row in best.best.sort_values("concurrency").iterrows():
        concurrency = int(row["concurrency"])
        if row["algorithm"] is None:
            refused = best.refusals[best.refusals["concurrency"] == concurrency]
            reason = str(refused["reason"].iloc[0]) if len(refused) else "no eligible cell"
            raise BenchError(
                f"{where}, temperature {temperature:g}, concurrency {concurrency}: every one of its "
                f"{int(row['candidates'])} DDTREE cell(s) was refused (first: {reason}; min repeats {min_repeats}); "
                "nothing to choose"
            )
        entry = PolicyEntry(
            concurrency=concurrency,
            budget=int(row["budget"]),
            topk=int(row["topk"]),
            output_tok_s=float(row["output_tok_s_median"]),
            output_tok_s_mad=float(row["output_tok_s_mad"]),
            n=int(row["n"]),
            accept_length=_float_or_none(row["accept_length_median"]),
            speedup_vs_ar=_float_or_none(row["speedup_vs_ar"]),
            runner_up=row["runner_up"] if isinstance(row["runner_up"], str) else None,
            note=row["note"] or None,
        )
        entries.append(entry)
        if entry.speedup_vs_ar is not None and entry.speedup_vs_ar < 1:
            notes.append(
                f"concurrency {concurrency}: the best tree is slower than AR ({entry.speedup_vs_ar:.2f}x); "
                "a policy cannot switch speculation off"
            )
    hosts = sorted({h for text in chosen["hosts"] for h in str(text).split(",") if h})
    return Policy(
        machine=machine, temperature=temperature, cuda_graph=cuda_graph, entries=tuple(entries),
        hosts=tuple(hosts), notes=tuple(notes), run=runs[0] if runs else None,
    )


def _runs_of(cells: pd.DataFrame) -> list[str]:
    """The runs ``cells`` are of (report.runs), oldest id first; none where runs were pooled."""
    if "run" not in cells:
        return []
    return sorted({str(run) for run in cells["run"] if run is not None and not pd.isna(run)})


def _float_or_none(value: Any) -> float | None:
    if value is None or value is pd.NA:
        return None
    number = float(value)
    return None if math.isnan(number) else number


__all__ = [
    "DEFAULT_TEMPERATURE",
    "Policy",
    "PolicyEntry",
    "Tuning",
    "choose_policies",
    "host_machines",
    "policy_file_name",
    "tune_ledgers",
]
