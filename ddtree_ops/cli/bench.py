"""`ddtree-ops bench --sweep FILE`: run a benchmark sweep across hosts into a JSONL ledger.

All decisions live in :mod:`ddtree_ops.bench`; this module loads the sweep and the
inventory, renders the plan (``--dry-run``, with what each host's end will put back, observed
now) or the progress, handles Ctrl-C (first press: finish the current rows, put each host's
previous server back, exit 130; the ledger is complete up to there and ``--resume``
continues) and picks the exit code (7 when any row failed, or a host was not put back).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from ddtree_ops.bench.lifetime import PlannedPutBack, SweepOptions, plan_put_back
from ddtree_ops.bench.prepare import PreparedSweep, prepare_sweep
from ddtree_ops.bench.runner import Progress as RunProgress
from ddtree_ops.bench.runner import SweepOutcome, SweepRunner
from ddtree_ops.bench.schedule import Schedule
from ddtree_ops.bench.services import default_services
from ddtree_ops.bench.sweep import MAX_CELLS, SweepSpec, check_targets, load_sweep
from ddtree_ops.cli.common import (
    WIDE_HELP,
    TableColumn,
    fitted_table,
    print_table,
    printable,
    say_notice,
    set_json_data,
)
from ddtree_ops.cli.main import AppContext, app, err_console
from ddtree_ops.errors import BenchError, ConfigError, DdtreeOpsError, FleetError, Interrupted, recorded_error
from ddtree_ops.fleet import start_watched
from ddtree_ops.inventory_types import Host
from ddtree_ops.workload.draw import WorkloadPrompts, build_workload
from ddtree_ops.workload.prompt import chat_messages


def _hosts(obj: AppContext, spec: SweepSpec, target: str | None) -> list[Host]:
    from ddtree_ops.inventory import load_inventory

    if not obj.inventory:
        raise ConfigError("no inventory: pass -i FILE or set DDTREE_OPS_INVENTORY")
    inventory = load_inventory(obj.inventory)
    if target:
        return inventory.resolve(target)
    check_targets(spec, inventory.resolve)
    seen: dict[str, Host] = {}
    for t in spec.targets:
        for h in inventory.resolve(t):
            seen.setdefault(h.name, h)
    return list(seen.values())


def _prompts_json(workload: WorkloadPrompts) -> dict[str, Any]:
    return {
        "name": workload.name,
        "hash": workload.workload_hash,
        "prompt_format": workload.prompt_format,
        "max_new_tokens": workload.max_new_tokens,
        "ignore_eos": workload.ignore_eos,
        "prompts": [
            {"id": p.id, "dataset": p.dataset or None, "category": p.category or None,
             "format": "chat" if p.chat else "text",
             "messages": chat_messages(p.messages) if p.chat else None, "text": None if p.chat else p.text,
             "followups": list(p.followups)}
            for p in workload.prompts
        ],
    }


# How many prompts the dry run's table shows (--json lists every one).
_SHOWN_PROMPTS = 20


def _render_prompts(obj: AppContext, workload: WorkloadPrompts, *, wide: bool) -> None:
    columns = (
        TableColumn("#", "right"),
        TableColumn("id", drop=2),
        TableColumn("set / category", wrap=True),
        TableColumn("format"),
        TableColumn("prompt (start)", wrap=True),
    )
    rows: list[list[str | Text]] = []
    for i, p in enumerate(workload.prompts[:_SHOWN_PROMPTS], 1):
        shown = p.messages[-1][1] if p.chat else p.text
        fmt = "chat" + (f" (+{len(p.followups)} turns)" if p.followups else "") if p.chat else "text"
        rows.append([str(i), printable(p.id), printable(p.group), fmt, printable(shown, limit=70)])
    more = len(workload.prompts) - len(rows)
    title = (f"workload {workload.name}: {len(workload.prompts)} prompts ({workload.prompt_format}), "
             f"max_new_tokens {workload.max_new_tokens}, hash {workload.workload_hash}")
    caption = f"{more} more: bench --dry-run --json lists every prompt" if more > 0 else None
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, title=title,
                                          caption=caption))


def _plan_json(prepared: PreparedSweep, workload: WorkloadPrompts) -> dict[str, Any]:
    spec, plan = prepared.spec, prepared.plan
    return {
        "sweep": spec.name,
        "workload": _prompts_json(workload),
        "hosts": [hp.host.name for hp in prepared.hosts],
        # Where each host's load is generated: "host" (next to its server) or "local".
        "clients": {hp.host.name: hp.client for hp in prepared.hosts},
        "relaunch": plan.relaunch,
        "restarts_per_host": plan.restarts,
        "switches_per_host": plan.switches,
        "rows_per_host": plan.runs,
        "estimated_s": {hp.host.name: hp.estimate_s for hp in prepared.hosts},
        # Both relaunch modes side by side: launches per host and each host's estimate.
        "modes": {
            mode: {"launches_per_host": p.restarts, "switches_per_host": p.switches,
                   "estimated_s": {hp.host.name: (hp.estimate_by_mode or {}).get(mode) for hp in prepared.hosts}}
            for mode, p in (prepared.plans or {plan.relaunch: plan}).items()
        },
        "groups": [
            {"server": g.launch.key, "cells": [c.key for c in g.cells], "baseline": any(c.baseline for c in g.cells),
             "live": g.launch.live, "budgets": list(g.launch.budgets), "topk_max": g.launch.topk_max}
            for g in plan.groups
        ],
        # Hosts with GPU slots: the expected schedule, and its wall time against one server's.
        "slot_schedules": {hp.host.name: _schedule_json(hp.schedule) for hp in prepared.hosts
                           if hp.schedule is not None},
    }


def _schedule_json(sched: Schedule) -> dict[str, Any]:
    return {
        "wall_s": sched.wall_s,
        "slots": [
            {"slot": s.name, "gpus": list(s.gpus),
             "jobs": [{"server": p.job.launch.key, "repeats": list(p.job.repeats), "rows": len(p.job.runs),
                       "start_s": p.start_s, "load_s": p.load_s, "end_s": p.end_s} for p in sched.on(s)]}
            for s in sched.slots
        ],
    }


def _render_plan(
    obj: AppContext, prepared: PreparedSweep, workload: WorkloadPrompts, *, wide: bool = False,
    left: dict[str, tuple[int, int]] | None = None, ledger_path: Path | None = None,
    put_back: dict[str, tuple[PlannedPutBack, ...]] | None = None,
) -> None:
    spec, plan = prepared.spec, prepared.plan
    if obj.json:
        data = _plan_json(prepared, workload)
        if left is not None:
            data["resume"] = {"ledger": str(ledger_path),
                              "hosts": {h: {"done": d, "left": n} for h, (d, n) in left.items()}}
        data["predict"] = _predict_json(prepared)
        # Per host, each server place: what the sweep's end will put back (observed now).
        data["put_back"] = {h: [p.as_dict() for p in places] for h, places in (put_back or {}).items()}
        set_json_data(obj, data)
        return
    _render_prompts(obj, workload, wide=wide)
    columns = (
        TableColumn("#", "right"),
        TableColumn("server", wrap=True),
        TableColumn("cells", "right"),
        TableColumn("temperatures", wrap=True),
        TableColumn("concurrency", wrap=True),
    )
    rows: list[list[str | Text]] = []
    for i, g in enumerate(plan.groups, 1):
        temps = sorted({c.sampling.temperature for c in g.cells})
        conc = sorted({c.concurrency for c in g.cells})
        label = g.launch.key + (" (baseline)" if any(c.baseline for c in g.cells) else "")
        if g.launch.live:
            trees = len({(c.server.budget, c.server.topk) for c in g.cells})
            label += f" (live: {trees} trees switched)"
        rows.append([str(i), label, str(len(g.cells)), ", ".join(f"{t:g}" for t in temps), ", ".join(map(str, conc))])
    title = (f"sweep {spec.name}: {plan.restarts} server launches (relaunch: {plan.relaunch}), "
             f"{plan.runs} rows per host")
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, title=title))
    plans = prepared.plans or {}
    for hp in prepared.hosts:
        h, sched = hp.host, hp.schedule
        by_mode = hp.estimate_by_mode or {}
        # Both relaunch modes, whichever the sweep runs: what live switching saves here.
        modes = "; ".join(
            f"{'live switching' if mode == 'never' else 'relaunching per tree'}: {plans[mode].restarts} launches, "
            f"{by_mode[mode] / 60:.1f} min" for mode in ("never", "always") if mode in plans and mode in by_mode
        )
        if sched is None:
            obj.console.print(
                f"{h.name}: client {hp.client}, estimated {hp.estimate_s / 60:.1f} min "
                f"(learned or expected load time per launch){'; ' + modes if modes else ''}", markup=False,
                highlight=False,
            )
            continue
        obj.console.print(
            f"{h.name}: client {hp.client}, {len(sched.slots)} GPU slots, estimated "
            f"{sched.wall_s / 60:.1f} min (one server: {hp.estimate_s / 60:.1f} min{'; ' + modes if modes else ''})",
            markup=False, highlight=False,
        )
        # A launch split over slots: each slot launches it once and measures its share of the rows.
        shared = Counter(p.job.launch for p in sched.placements)
        for slot in sched.slots:
            placed = ", ".join(
                p.job.launch.key + (f" ({len(p.job.runs)} rows" + (f", {_repeats_text(p.job.repeats, plan.repeats)}"
                                                                   if len(p.job.repeats) < plan.repeats else "") + ")"
                                    if shared[p.job.launch] > 1 else "")
                for p in sched.on(slot)
            )
            gpus = ",".join(map(str, slot.gpus))
            obj.console.print(f"  {slot.name} (GPUs {gpus}): {placed or 'idle'}", markup=False, highlight=False)
    for host, (done, todo) in (left or {}).items():
        obj.console.print(f"--resume from {ledger_path}: {host}: {done} of {plan.runs} row(s) done, {todo} left",
                          markup=False, highlight=False)
    for line in _predict_lines(prepared):
        obj.console.print(line, markup=False, highlight=False)
    for places in (put_back or {}).values():
        for planned in places:
            # Run descriptions and errors come from the hosts: printable() keeps control characters out.
            obj.console.print(printable(planned.describe()), markup=False, highlight=False)


def _repeats_text(repeats: tuple[int, ...] | list[int], total: int) -> str:
    """Which passes over the cells a slot's share is, counted from 1 as people count ("repeat
    2 of 2"): the plan's repeat numbers are indices from 0, and "repeats 0" read as none."""
    numbers = [r + 1 for r in repeats]
    if len(numbers) == 1:
        return f"repeat {numbers[0]} of {total}"
    return f"repeats {', '.join(map(str, numbers[:-1]))} and {numbers[-1]} of {total}"


def _predict_json(prepared: PreparedSweep) -> dict[str, Any] | None:
    """The predicted plan's shape and time per host against the full grid's (None: the
    sweep does not predict). A host with GPU slots: both are wall times on its slots (the
    full grid's its slot schedule), the predicted plan's probes and trace runs split over
    them as its cells are."""
    from ddtree_ops.bench.predictplan import plan_predict, predict_estimate, predict_phase_estimate
    from ddtree_ops.predict.decide import repeats_cap, repeats_floor

    spec = prepared.spec
    pplan = plan_predict(spec, prepared.plan) if spec.predict is not None else None
    if pplan is None:
        return None
    wl = spec.workload
    return {
        "top": pplan.spec.top, "probes_per_host": len(pplan.probes),
        "trace_runs_per_host": len(pplan.trace_groups) * len(pplan.samplings),
        "trace_groups": [[list(t) for t in g] for g in pplan.trace_groups],
        "predicted_cells_per_host": len(pplan.trees) * len(pplan.samplings) * len(pplan.concurrencies),
        "measured_ddtree_cells_per_host": pplan.measured_cells,
        # Each measured in interleaved repeats until its group is decided: at least, at most.
        "measured_repeats": [repeats_floor(prepared.plan.repeats),
                             repeats_cap(prepared.plan.repeats, pplan.spec.max_repeats)],
        # The probes and trace runs alone (split over a host's GPU slots), per host.
        "predict_phase_estimated_s": {
            hp.host.name: predict_phase_estimate(pplan, load_s=hp.launch_s, num_prompts=wl.num_prompts,
                                                 max_new_tokens=wl.max_new_tokens, s_per_step=hp.step_s,
                                                 trace_s_per_step=hp.trace_step_s)
            for hp in prepared.hosts},
        "estimated_s": {hp.host.name: predict_estimate(pplan, prepared.plan, load_s=hp.launch_s,
                                                       num_prompts=wl.num_prompts, max_new_tokens=wl.max_new_tokens,
                                                       s_per_step=hp.step_s, trace_s_per_step=hp.trace_step_s)
                        for hp in prepared.hosts},
        "full_grid_estimated_s": {hp.host.name: hp.schedule.wall_s if hp.schedule is not None else hp.estimate_s
                                  for hp in prepared.hosts},
        "slots": {hp.host.name: len(hp.launch_s) for hp in prepared.hosts},
    }


def _predict_lines(prepared: PreparedSweep) -> list[str]:
    data = _predict_json(prepared)
    if data is None:
        return []
    least, most = data["measured_repeats"]
    lines = [f"predicted plan: {data['probes_per_host']} round-time probes and {data['trace_runs_per_host']} trace "
             f"run(s) per host predict {data['predicted_cells_per_host']} DDTree cells; the top {data['top']} per "
             f"(temperature, concurrency) are measured: {data['measured_ddtree_cells_per_host']} cells, each "
             f"{least} to {most} repeats (until its group is decided), plus baselines"]
    for host, seconds in data["estimated_s"].items():
        full, slots = data["full_grid_estimated_s"][host], data["slots"][host]
        phase = data["predict_phase_estimated_s"][host]
        time = f"wall time on {slots} GPU slots" if slots > 1 else "GPU time"
        lines.append(f"{host}: predicted plan {seconds / 60:.1f} min of {time} against {full / 60:.1f} min for the "
                     f"full grid ({seconds / full:.2f}x; the predict phase {phase / 60:.1f} min, {phase / full:.2f}x, "
                     f"measuring at least {(seconds - phase) / 60:.1f} min)")
    return lines


@dataclasses.dataclass(frozen=True)
class _Predicted:
    """What a predicted run left unmeasured, per host: the cells it chose (None: the host's
    predict phase failed and it was measured in full) and the plan's rows it predicted only."""

    chosen: dict[str, frozenset[str] | None]
    predicted_only: dict[str, int]
    top: int
    # Per host, each chosen cell as its ledger rows name it: (budget, topk, temperature,
    # top_p, top_k, concurrency).
    chosen_cells: dict[str, frozenset[tuple[Any, ...]]]
    # Per host: the planned runs of the chosen cells the predict phase measured (the runner
    # counts them skipped), its (ok, failed) rows, and each group's decision.
    took: dict[str, int] = dataclasses.field(default_factory=dict)
    measured: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    decisions: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)


def _predicted(prepared: PreparedSweep, predicted: dict[str, Any] | None) -> _Predicted | None:
    """The runner counts a planned row it did not run as skipped, for a cell it was told to
    leave out (not chosen) as for one the ledger had (--resume): told apart here, as the
    runner tells them apart (a baseline always runs, a cell not chosen never)."""
    from ddtree_ops.bench.schedule import plan_runs

    spec = prepared.spec
    if predicted is None or spec.predict is None:
        return None
    chosen = {host: p.chosen for host, p in predicted.items()}
    runs = plan_runs(prepared.plan)
    only = {host: sum(1 for cell, _ in runs if not cell.baseline and cell.key not in keys)
            for host, keys in chosen.items() if keys is not None}
    cells = {c.key: (c.server.budget, c.server.topk, c.sampling.temperature, c.sampling.top_p, c.sampling.top_k,
                     c.concurrency) for c in prepared.plan.cells}
    chosen_cells = {host: frozenset(cells[k] for k in keys if k in cells)
                    for host, keys in chosen.items() if keys is not None}
    return _Predicted(chosen, only, spec.predict.top, chosen_cells, took={h: p.took for h, p in predicted.items()},
                      measured={h: (p.measured_ok, p.measured_failed) for h, p in predicted.items()},
                      decisions={h: p.decisions for h, p in predicted.items()})


def _render_outcome(obj: AppContext, outcome: SweepOutcome, *, wide: bool = False,
                    predicted: _Predicted | None = None, resume: bool = False) -> None:
    """The run's table, one row per host: every planned row is ok, failed, predicted only
    (a predicted run's cells it did not choose to measure) or skipped (there already:
    --resume); each count said under its own name."""
    by_host = {h.host: h for h in outcome.hosts}
    only = predicted.predicted_only if predicted is not None else {}
    # The chosen cells' rows the predict phase measured (the runner skipped their runs).
    took = predicted.took if predicted is not None else {}
    phase = predicted.measured if predicted is not None else {}
    resumed = {h.host: max(0, h.skipped - only.get(h.host, 0) - took.get(h.host, 0)) for h in outcome.hosts}
    ok_rows = {h.host: h.ok_rows + phase.get(h.host, (0, 0))[0] for h in outcome.hosts}
    failed_rows = {h.host: h.failed_rows + phase.get(h.host, (0, 0))[1] for h in outcome.hosts}
    if obj.json:
        set_json_data(obj, {
            "run_id": outcome.run_id,
            "ledger": str(outcome.ledger),
            "hosts": [h.as_dict() | {"predicted_only": only.get(h.host, 0), "resumed": resumed[h.host],
                                     "ok_rows": ok_rows[h.host], "failed_rows": failed_rows[h.host]}
                      for h in outcome.hosts],
            "bad_ledger_lines": [list(b) for b in outcome.bad_ledger_lines],
            "ledger_healed": outcome.healed,
            "predicted": None if predicted is None else {"top": predicted.top, "chosen": _chosen_rows(
                outcome, predicted), "groups": _group_verdicts(predicted)},
        })
        return
    for lineno, reason in outcome.bad_ledger_lines:
        obj.console.print(Text(f"ledger {outcome.ledger}:{lineno}: {reason} (ignored)", style="yellow"))
    show_resumed = resume or any(resumed.values())
    columns = (
        TableColumn("host", wrap=True),
        TableColumn("ok rows", "right"),
        TableColumn("failed rows", "right"),
        *([TableColumn("predicted only", "right")] if predicted is not None else []),
        *([TableColumn("skipped (resume)", "right", drop=2)] if show_resumed else []),
        TableColumn("launches", "right", drop=1),
        TableColumn("put back", wrap=True),
        TableColumn("error", wrap=True),
    )
    rows: list[list[str | Text]] = []
    for h in outcome.hosts:
        err = h.error or ("interrupted" if h.interrupted else "")
        slots = len(h.put_back) > 1 or any(p.place != h.host for p in h.put_back)
        put = "; ".join((f"{p.place}: " if slots else "") + p.describe() for p in h.put_back)
        rows.append([h.host, str(ok_rows[h.host]), str(failed_rows[h.host]),
                     *([str(only.get(h.host, 0))] if predicted is not None else []),
                     *([str(resumed[h.host])] if show_resumed else []),
                     str(h.restarts), printable(put), printable(err)])
    title = f"run {outcome.run_id} -> {outcome.ledger}"
    caption = None
    if predicted is not None:
        caption = (f"predicted only: rows of the cells the prediction did not choose (each cell has its "
                   f"predicted row in the ledger); the top {predicted.top} per (temperature, concurrency) "
                   f"were measured, in repeats until one was ahead.")
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, title=title,
                                          caption=caption))
    if predicted is not None:
        _render_chosen(obj, outcome, predicted, [h for h in by_host if predicted.chosen.get(h) is None], wide=wide)


def _chosen_rows(outcome: SweepOutcome, predicted: _Predicted) -> list[dict[str, Any]]:
    """The cells each host's prediction chose, from this run's rows of the ledger: per
    (host, sampling, concurrency) fastest predicted first, with what was measured of each
    (median tok/s of its ok rows; None where none is ok)."""
    import statistics

    from ddtree_ops.bench import ledger

    try:
        rows = [r for r in ledger.read_ledger(outcome.ledger).rows if r.get("run_id") == outcome.run_id]
    except (OSError, DdtreeOpsError):
        return []  # the run's table is shown; this one needs the ledger read back

    def cell(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["budget"], r["topk"], r["temperature"], r["top_p"], r["top_k"], r["concurrency"])

    measured: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        if r.get("source") in (None, "measured") and r["algorithm"] == "DDTREE" and r["status"] == "ok":
            measured.setdefault((r["host"], *cell(r)), []).append(r["output_tok_s"])
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("source") == "predicted" and cell(r) in predicted.chosen_cells.get(r["host"], ()):
            groups.setdefault((r["host"], *cell(r)[2:]), []).append(r)
    # The measured phase's verdicts: (host, temperature, top_p, top_k, concurrency) -> decision.
    decided = {(host, d.temperature, d.top_p, d.top_k, d.concurrency): d
               for host, ds in predicted.decisions.items() for d in ds}
    out = []
    for key in sorted(groups, key=lambda k: [(v is None, v if v is not None else 0) for v in k]):
        ranked = sorted(groups[key], key=lambda r: (-r["output_tok_s"], r["budget"], r["topk"]))
        decision = decided.get(key)
        noise = {c.tree: c.noise for c in decision.candidates} if decision is not None else {}
        for rank, r in enumerate(ranked, 1):
            got = measured.get((r["host"], *cell(r)))
            tree = (r["budget"], r["topk"])
            out.append({"host": r["host"], "temperature": r["temperature"], "top_p": r["top_p"], "top_k": r["top_k"],
                        "concurrency": r["concurrency"], "rank": rank, "budget": r["budget"], "topk": r["topk"],
                        "predicted_tok_s": r["output_tok_s"], "predicted_accept": r["accept_length"],
                        "measured_tok_s": statistics.median(got) if got else None, "repeats": len(got or ()),
                        "noise_tok_s": noise.get(tree),
                        "chosen": decision is not None and decision.verdict.winner == tree})
    return out


def _group_verdicts(predicted: _Predicted) -> list[dict[str, Any]]:
    """Per (host, sampling, concurrency): the measured phase's verdict on its candidates
    (``ddtree_ops.predict.decide``): the tree chosen, whether it was decided (ahead of the
    runner-up by more than their noise, or tied within 1 % with the rest) or left undecided
    at the cap of repeats, and by how much it led."""
    out = []
    for host, decisions in predicted.decisions.items():
        for d in decisions:
            v = d.verdict
            out.append({"host": host, "temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k,
                        "concurrency": d.concurrency, "chosen": list(v.winner) if v.winner else None,
                        "decided": v.decided, "why": v.why, "repeats": v.repeats,
                        "runner_up": list(v.runner_up) if v.runner_up else None, "lead": v.gap, "noise": v.noise,
                        "tie": [list(t) for t in v.tie]})
    return out


def _render_chosen(obj: AppContext, outcome: SweepOutcome, predicted: _Predicted, unpredicted: list[str], *,
                   wide: bool) -> None:
    """What the prediction chose, per (host, temperature, concurrency): the top N trees by
    predicted tok/s beside what measuring them gave. A predicted number is never ranked
    against a measured one (report and tune keep them apart); this says what was chosen."""
    chosen = _chosen_rows(outcome, predicted)
    columns = (
        TableColumn("host", wrap=True), TableColumn("T", "right"), TableColumn("c", "right"),
        TableColumn("#", "right"), TableColumn("tree"), TableColumn("tok/s predicted", "right"),
        TableColumn("tok/s measured", "right"), TableColumn("n", "right", drop=2),
        TableColumn("error", "right", drop=1),
    )
    rows: list[list[str | Text]] = []
    for c in chosen:
        meas = c["measured_tok_s"]
        sampling = f"{c['temperature']:g}" + (f" p{c['top_p']:g}" if c["top_p"] not in (None, 1.0) else "") + (
            f" k{c['top_k']}" if c["top_k"] not in (None, -1) else "")
        noise = f" ±{c['noise_tok_s']:.1f}" if c.get("noise_tok_s") else ""
        rows.append([
            printable(str(c["host"])), sampling, str(c["concurrency"]), str(c["rank"]),
            f"b={c['budget']} k={c['topk']}" + (" (chosen)" if c.get("chosen") else ""), f"{c['predicted_tok_s']:.1f}",
            f"{meas:.1f}{noise}" if meas is not None else Text("not measured", style="red"), str(c.get("repeats", "")),
            f"{(c['predicted_tok_s'] - meas) / meas:+.1%}" if meas else "",
        ])
    if rows:
        title = f"Chosen by prediction: the top {predicted.top} per (host, temperature, concurrency)"
        caption = ("tok/s predicted: the estimator's, from the trace runs and round-time probes; measured: the "
                   "median of the cell's n ok repeats ± 1.4826 x their MAD; (chosen): the group's pick (within 1 % "
                   "of the best median the smaller tree). `report` shows every predicted cell beside what was "
                   "measured.")
        print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide, title=title,
                                              caption=caption))
    for g in _group_verdicts(predicted):
        if g["decided"] or g["chosen"] is None:
            continue
        lead = (f"; b={g['runner_up'][0]} k={g['runner_up'][1]} was within the noise: {g['lead']:.1%} behind, noise "
                f"{g['noise']:.1%}" if g["runner_up"] is not None and g["lead"] is not None else "")
        obj.console.print(Text(
            f"{printable(str(g['host']))} T {g['temperature']:g} c {g['concurrency']}: undecided after "
            f"{g['repeats']} repeats (the cap): chose b={g['chosen'][0]} k={g['chosen'][1]}, the best median{lead}",
            style="yellow"))
    for host in unpredicted:
        obj.console.print(f"{host}: not predicted (its predict phase failed): every cell measured",
                          markup=False, highlight=False)


def progress_bar(console: Console, *, disable: bool) -> Progress:
    """One line per host: host, bar, rows done, time left, what it is doing. At 80 columns
    the description (phase, cell, slot) keeps most of the line: a short bar, and the time
    left says what it is."""
    # rich squeezes every column of a line too long for the terminal: host, bar and count
    # shrank to "si…" and the bar vanished. They keep their width; the description alone
    # gives way (its end cut with "…"), taking what is left of the line.
    return Progress(
        TextColumn("{task.fields[host]}", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=8, table_column=Column(no_wrap=True, min_width=8)),
        TextColumn("{task.completed}/{task.total}", table_column=Column(no_wrap=True)),
        _TimeLeftColumn(),
        # Cell keys, slots, errors: plain text.
        TextColumn("{task.description}", markup=False,
                   table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1, min_width=8)),
        console=console,
        disable=disable,
        transient=False,
        expand=True,
    )


class _TimeLeftColumn(ProgressColumn):
    """rich's time-remaining estimate, labelled ("0:01:23 left"): a bare clock read as elapsed."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self._remaining = TimeRemainingColumn()

    def render(self, task: Task) -> Text:
        shown = self._remaining.render(task)
        return Text(f"{shown.plain} left", style=shown.style)

@app.command("bench")
def bench(
    ctx: typer.Context,
    target_arg: str | None = typer.Argument(
        None, metavar="TARGET",
        help="Host, group, comma list, or 'all' to run on instead of the sweep's targets (default: its targets).",
    ),
    sweep: Path = typer.Option(..., "--sweep", "-s", help="Sweep file (YAML), e.g. bench_configs/demo.yaml."),
    target_opt: str | None = typer.Option(
        None, "--target", "-t", hidden=True, help="The TARGET argument as an option (kept for old scripts)."
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Ledger file. Default: results/<sweep name>.jsonl."),
    resume: bool = typer.Option(False, "--resume", help="Skip runs that already have an ok row in the ledger."),
    fail_fast: bool = typer.Option(False, "--fail-fast", help="Stop every host at the first failed row."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan (cells, launches, estimated time) and exit."),
    keep_server: bool = typer.Option(
        False, "--keep-server",
        help="Leave the sweep's last server running when done, instead of putting back what served before.",
    ),
    leave_stopped: bool = typer.Option(
        False, "--leave-stopped",
        help="Stop the sweep's servers when done and put nothing back (by default each host's previous server is "
        "relaunched and proven ready).",
    ),
    restart_timeout: float | None = typer.Option(
        None, "--restart-timeout", min=1, help="Seconds to wait for each server launch (default: learned load time)."
    ),
    no_smoke: bool = typer.Option(
        False, "--no-smoke", help="Measure as soon as a server answers: skip the restart's speculative smoke."
    ),
    wide: bool = typer.Option(
        False, "--wide", help=WIDE_HELP
    ),
    predict: bool = typer.Option(
        False, "--predict", help="Predict the DDTree grid from one trace run per temperature and round-time probes, "
        "then measure only the top N predicted cells (--predict-top N, or the sweep key predict: {top: N}; default "
        "3) and the baselines.",
    ),
    # Its own option, not an optional value of --predict: click's parser has none, and one
    # would take the next word (`--predict local`) for its N.
    predict_top: int | None = typer.Option(
        None, "--predict-top", min=1, max=MAX_CELLS, metavar="N",
        help="--predict, measuring the top N predicted cells per (temperature, concurrency) (default: the sweep's "
        "predict.top, else 3).",
    ),
) -> None:
    """Sweep DDTree budget x top-k x temperature x concurrency on every target host."""
    obj: AppContext = ctx.obj
    if target_arg is not None and target_opt is not None and target_arg != target_opt:
        raise ConfigError(f"two targets: {target_arg!r} and --target {target_opt!r}; give one")
    target = target_arg if target_arg is not None else target_opt
    if keep_server and leave_stopped:
        raise ConfigError("--keep-server and --leave-stopped: give one (keep the sweep's last server running, or "
                          "stop it; either way nothing is put back)")
    spec = load_sweep(sweep)
    if predict or predict_top is not None:
        from ddtree_ops.bench.sweep import PredictSpec

        given = spec.predict or PredictSpec()
        spec = dataclasses.replace(spec, predict=given if predict_top is None else dataclasses.replace(
            given, top=predict_top))
    prepared = prepare_sweep(spec, _hosts(obj, spec, target))
    # Read before any host is touched, and in a dry run too: a bad data file is one line
    # naming the file and line, whether or not the sweep runs.
    workload = build_workload(spec.workload, search=(spec.source.parent,))
    ledger_path = out or Path("results") / f"{spec.name}.jsonl"
    options = SweepOptions(resume=resume, fail_fast=fail_fast, keep_server=keep_server,
                           restart_timeout=restart_timeout, smoke=not no_smoke, leave_stopped=leave_stopped)
    services = default_services(host_key_policy=obj.host_key_policy, on_notice=say_notice)
    if dry_run:
        # --resume --dry-run: what the ledger already has and what is left, per host (the
        # ledger checked as the run would check it).
        checked = SweepRunner(prepared, workload, ledger_path=ledger_path, options=SweepOptions(resume=resume))
        left = checked.left() if resume else None
        if not resume:  # the ledger refused as the run would refuse it (no link, ours, room), changing nothing
            checked.prepare(dry_run=True)
        if spec.predict is not None:
            from ddtree_ops.bench.predictrun import check_traces_dir

            check_traces_dir(ledger_path)
        # What each place serves now, read (nothing changed): what the end will put back.
        put_back = plan_put_back(services, [hp.host for hp in prepared.hosts], options)
        _render_plan(obj, prepared, workload, wide=wide, left=left, ledger_path=ledger_path, put_back=put_back)
        return
    cancel = threading.Event()
    holder: dict[str, Any] = {}
    # The progress display exists only once the ledger has been checked; until then the
    # runner's events go nowhere (prepare() emits none).
    sink: list[Callable[[RunProgress], None]] = []

    def forward(p: RunProgress) -> None:
        for f in sink:
            f(p)

    runner = SweepRunner(
        prepared,
        workload,
        ledger_path=ledger_path,
        options=options,
        services=services,
        on_progress=forward,
        cancel=cancel,
    )
    # Writable ledger (no link; empty, or a ledger of this sweep; room for its rows), same
    # sweep on --resume, truncated last line cut off: before any host. The traces' folder too.
    runner.prepare()
    if spec.predict is not None:
        from ddtree_ops.bench.predictrun import check_traces_dir

        check_traces_dir(ledger_path)
    if runner.healed:
        err_console.print(runner.healed, style="yellow", markup=False, highlight=False, soft_wrap=True)

    with progress_bar(obj.console, disable=obj.json) as bar:
        tasks: dict[str, TaskID] = {
            hp.host.name: bar.add_task("waiting", total=prepared.plan.runs, host=hp.host.name) for hp in prepared.hosts
        }

        def on_progress(p: RunProgress) -> None:
            desc = p.phase if not p.cell else f"{p.phase} {p.cell}"
            if p.slot:
                desc = f"[{p.slot}] {desc}"
            if p.message:
                desc += f" — {p.message[:80]}"
            total = max(p.total, 1)
            done = total if p.phase == "finished" and not p.total else p.done
            bar.update(tasks[p.host], completed=done, total=total, description=desc)

        sink.append(on_progress)

        finished = threading.Event()

        def work() -> None:
            try:
                if spec.predict is not None:
                    from ddtree_ops.bench.predictrun import PredictPhase, chosen_cells, kept_servers

                    phase = PredictPhase(prepared, workload, ledger_path=ledger_path, run_id=runner.run_id,
                                         options=runner.options, services=runner.services, on_progress=forward,
                                         cancel=cancel, borrowed=runner.borrowed, leases=runner.leases)
                    predicted = phase.run()
                    if phase.ledger_error is not None:
                        # No row can be kept: the measuring only puts each host back.
                        runner.ledger_failed(phase.ledger_error)
                    for p in predicted.values():
                        if p.error and phase.ledger_error is None:
                            err_console.print(f"{p.host}: {p.error}", style="yellow", markup=False, highlight=False)
                    # The chosen cells, measured on the predict phase's server where it worked.
                    runner.only, runner.kept = chosen_cells(predicted), kept_servers(predicted)
                    holder["predicted"] = predicted
                holder["outcome"] = runner.run()
            except BaseException as exc:  # re-raised in the main thread
                holder["error"] = exc
            finally:
                finished.set()

        # The sweep runs in a worker thread so that Ctrl-C reaches this loop, which asks the
        # runner to wind down. An Event, not Thread.join: a join interrupted by
        # KeyboardInterrupt can report the thread finished while it still runs.
        interrupts = 0
        landed = start_watched(threading.Thread(target=work, name="bench-runner", daemon=True))
        while not finished.is_set():
            try:
                if landed:  # the Ctrl-C came while the thread started: handled as one here
                    landed = False
                    raise KeyboardInterrupt
                finished.wait(0.2)
            except KeyboardInterrupt:
                interrupts += 1
                cancel.set()
                if interrupts > 1:
                    raise Interrupted(
                        f"aborted: the row in progress is lost, a server this sweep started may still run and a "
                        f"host's previous server may not be back (`ddtree-ops restart HOST` without --algorithm "
                        f"relaunches the host's own launch; `bench --resume` takes this sweep's lease over and puts "
                        f"back what served before it); rows so far are in {ledger_path} — rerun with --resume to "
                        f"finish"
                    ) from None
                # Under --json, stdout holds only the envelope.
                what = ("stopping the sweep's servers" if leave_stopped
                        else "putting each host's previous server back")
                (err_console if obj.json else obj.console).print(
                    f"[yellow]interrupt: finishing the current rows and {what} (Ctrl-C again to abort)[/]"
                )
    if "error" in holder:
        raise holder["error"]
    outcome: SweepOutcome = holder["outcome"]
    _render_outcome(obj, outcome, wide=wide, predicted=_predicted(prepared, holder.get("predicted")), resume=resume)
    if outcome.ledger_error is not None:
        raise BenchError(f"{outcome.ledger_error}; the sweep stopped on every host: free some space, then "
                         f"`bench --resume` with the same --out runs what is left")
    if outcome.interrupted or cancel.is_set():
        raise Interrupted(f"interrupted; rows so far are in {ledger_path} — rerun with --resume to finish")
    # Failed rows of the chosen cells, measured by the predict phase: failed measurements too.
    phase_failed = {h: p.measured_failed for h, p in (holder.get("predicted") or {}).items() if p.measured_failed}
    if outcome.failed or phase_failed:
        # A host that could not be reached (or was refused by a lease) fails with that
        # error's code, as every other command reports it (a host not put back: the
        # restore's); failed measurements are 6.
        failures = {
            h.host: recorded_error(h.error_type, h.error, host=h.host) if h.error and h.error_type
            else BenchError(h.error or f"{h.failed_rows + phase_failed.get(h.host, 0)} failed row(s)", host=h.host)
            for h in outcome.hosts
            if h.failed_rows or h.error or h.host in phase_failed
        }
        raise FleetError(f"failed rows on {', '.join(failures)} (see the ledger's error column)", failures=failures)
