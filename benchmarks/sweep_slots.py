"""Wall time of one sweep on one simulated host with 1, 2 and 4 GPU slots, against the
expected time that ``bench --dry-run`` prints.

One local host (the simulator as its SGLang, real-time: ``SIM_TIME_SCALE=1``, a model
load of ``--load-s`` simulated seconds, one verify-graph capture per runtime state for
batch sizes up to 16, and its warmup), 8 trees (DDTREE budgets 4/8/16/32 x top-k 2/4), one
measurement each of ``--num-prompts`` prompts x ``--max-new-tokens`` tokens at
concurrency 2: measuring, not loading, is most of a sweep, as on a real fleet. The trees
run on one live launch (runtime states for the 4 budgets, trees switched live). The same
sweep runs through ``SweepRunner`` (the code ``bench`` runs) with the host's
``ddtree.server.slots`` set to 1, 2 and 4 slots of one GPU each; each run starts from no
server. With several slots the launch's cells are split over them: every slot launches
the same runtime-states server once and measures its share.

Before the runs, a previous sweep is played on the host's 4 slots: the same grid and
prompts, a quarter of the tokens. It records, per slot, what a launch of this live server
costs (restart -> ready: stop, load, captures, smoke) and what a decode step of a row
takes (the runner learns both into a private state file). The estimate of each run is
then the prepared sweep's: one server's sum with 1 slot, the slot schedule with more —
the dry run's; each run updates the state file as any sweep does.

Then the same sweep as a predicted plan (``bench --predict``: round-time probes and a
trace run, the top 3 trees measured) on 1 slot and on the most slots: every slot launches
the predict launch once and runs its share of the probes and trace runs (the one trace run
cut into parts of its prompts over the slots), then measures its share of the chosen trees
on that server. Its estimate is the dry run's
(``predict_estimate``, as ``bench --predict --dry-run`` prints it).

Printed per slot count: measured wall time, its ratio to the 1-slot time (of the same
plan), the estimate and the estimate's error. The simulator's own CPU work (several
servers on few cores) slows loads and steps beyond the model; the CPU count is printed
with the results. ``--json``: a list of ``{plan, slots, wall_s, estimated_s}``, ``plan``
``full`` (the grid) or ``predicted``.

    .venv/bin/python benchmarks/sweep_slots.py [--slots 1,2,4] [--load-s 3] [--num-prompts 8]
        [--max-new-tokens 640] [--no-predicted] [--json]
    .venv/bin/python benchmarks/sweep_slots.py --quick    # 2 slots, 2 prompts x 32 tokens, 10x time

About 15 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from ddtree_ops.bench.predictplan import plan_predict, predict_estimate, predict_phase_estimate
from ddtree_ops.bench.predictrun import PredictPhase, chosen_cells, kept_servers
from ddtree_ops.bench.prepare import prepare_sweep
from ddtree_ops.bench.runner import Progress, SweepRunner
from ddtree_ops.bench.sweep import parse_sweep
from ddtree_ops.inventory import load_inventory
from ddtree_ops.state import STATE_ENV, StateStore
from ddtree_ops.workload.draw import build_workload

# The simulator serves DDTREE only from the bundle deployed into its host's SGLang: the
# hosts run an interpreter the toolkit deployed it into, as the tests' simulator hosts do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from minisglang import deployed_python  # noqa: E402
from testports import free_port  # noqa: E402

MODEL = "sim/qwen3-8b"


def free_ports(n: int) -> list[int]:
    """``n`` ports below the ephemeral range (``tests/testports.py``): a server relaunched on
    its port finds it free, where an outgoing connection could have taken an ephemeral one."""
    return [free_port() for _ in range(n)]


def write_inventory(tmp: Path, slots: int, load_s: float, tag: str = "", time_scale: float = 1.0) -> Path:
    server = {
        "command": "{python} -m ddtree_ops.sim", "model_path": MODEL, "draft_model_path": "sim/qwen3-8b-dflash",
        "expected_load_s": 600,  # never used: the calibrated load time is in the state file
        # Graphs up to batch 16 (the sweep runs 2 at once): a capture takes 2.16 s, not 4.56.
        "extra_args": ["--cuda-graph-max-bs-decode", "16"],
        "env": {"SIM_GPU": "rtx-pro-6000", "SIM_LOAD_S": str(load_s), "SIM_TIME_SCALE": str(time_scale)},
        "slots": [{"gpus": str(i), "port": port} for i, port in enumerate(free_ports(slots))],
    }
    inv = tmp / f"inv-{tag}{slots}.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"local": {"hosts": {"sim": {
        "ansible_connection": "local",
        "ddtree": {"python": deployed_python(), "run_dir": str(tmp / f"run-{tag}{slots}"), "gpu": "rtx-pro-6000",
                   "server": server}}}}}}}))
    return inv


def sweep_doc(num_prompts: int = 2, max_new_tokens: int = 16) -> dict[str, object]:
    return {
        "name": "slots", "targets": ["local"], "repeats": 1, "warmup": 0,
        "grid": {"algorithm": ["ddtree"], "budget": [4, 8, 16, 32], "topk": [2, 4], "temperature": [0.0],
                 "concurrency": [2]},
        "workload": {"prompt_set": "mixed", "num_prompts": num_prompts,
                     "max_new_tokens": max_new_tokens},
    }


def calibrate(tmp: Path, load_s: float, slots: int, num_prompts: int, max_new_tokens: int,
              time_scale: float = 1.0) -> tuple[float, float]:
    """Play a previous sweep of the same grid and prompts on ``slots`` slots, a quarter of
    the tokens. Returns (launch s, step s) as it left them for slot 0."""
    host = load_inventory([write_inventory(tmp / "calibration", slots, load_s, time_scale=time_scale)]).hosts["sim"]
    spec = parse_sweep(sweep_doc(num_prompts, max(1, max_new_tokens // 4)), tmp / "calibration.yaml")
    outcome = SweepRunner(prepare_sweep(spec, [host]), build_workload(spec.workload),
                          ledger_path=tmp / "calibration.jsonl").run()
    if outcome.failed:
        raise SystemExit(f"the calibrating sweep failed: {outcome.hosts}")
    place, state = host.slot_hosts()[0], StateStore()
    restart, step = state.learned_restart_s(place.name, MODEL), state.learned_step_s(place.name, MODEL)
    assert restart is not None and step is not None
    return restart, step


def run_predicted(tmp: Path, doc: dict[str, object], slots: int, load_s: float,
                  time_scale: float = 1.0, predict: dict[str, int] | None = None) -> dict[str, Any]:
    """The sweep as ``bench --predict`` runs it on ``slots`` slots: its wall time, the dry
    run's estimate, and the measured rows (a failed predict phase counts as a failed row)."""
    host = load_inventory([write_inventory(tmp, slots, load_s, tag="predicted-",
                                           time_scale=time_scale)]).hosts["sim"]
    spec = parse_sweep({**doc, "predict": predict or {}}, tmp / "predicted.yaml")
    workload = build_workload(spec.workload)
    prepared = prepare_sweep(spec, [host])
    (hp,) = prepared.hosts
    pplan = plan_predict(spec, prepared.plan)
    assert pplan is not None
    wl = spec.workload
    estimated = predict_estimate(pplan, prepared.plan, load_s=hp.launch_s, num_prompts=wl.num_prompts,
                                 max_new_tokens=wl.max_new_tokens, s_per_step=hp.step_s,
                                 trace_s_per_step=hp.trace_step_s)
    phase_estimated = predict_phase_estimate(pplan, load_s=hp.launch_s, num_prompts=wl.num_prompts,
                                             max_new_tokens=wl.max_new_tokens, s_per_step=hp.step_s,
                                             trace_s_per_step=hp.trace_step_s)
    out = tmp / f"ledger-predicted-{slots}.jsonl"
    started = time.monotonic()
    predicted_at: list[float] = []

    def on_progress(p: Progress) -> None:
        # The phase's probes and trace runs end with its predictions; its measured phase
        # (the chosen trees, until each group is decided) follows inside PredictPhase.run.
        if "cells predicted" in p.message:
            predicted_at.append(time.monotonic())

    runner = SweepRunner(prepared, workload, ledger_path=out)
    predicted = PredictPhase(prepared, workload, ledger_path=out, run_id=runner.run_id, on_progress=on_progress).run()
    phase = (predicted_at[0] if predicted_at else time.monotonic()) - started
    runner.only, runner.kept = chosen_cells(predicted), kept_servers(predicted)
    outcome = runner.run()
    wall = time.monotonic() - started
    (summary,) = outcome.hosts
    failed = summary.failed_rows + sum(1 for p in predicted.values() if p.error)
    return {"plan": "predicted", "slots": slots, "wall_s": round(wall, 2), "estimated_s": round(estimated, 2),
            "predict_phase_s": round(phase, 2), "predict_phase_estimated_s": round(phase_estimated, 2),
            "ok_rows": summary.ok_rows, "failed_rows": failed}


def print_table(rows: list[dict[str, Any]]) -> None:
    base = next((r["wall_s"] for r in rows if r["slots"] == 1), None)
    print(f"{'slots':>5} {'wall s':>8} {'x 1-slot':>8} {'estimate s':>10} {'est. error':>10} {'rows ok/failed':>15}")
    for r in rows:
        ratio = f"{r['wall_s'] / base:.2f}" if base else "-"
        err = (r["estimated_s"] - r["wall_s"]) / r["wall_s"] * 100
        print(f"{r['slots']:>5} {r['wall_s']:>8.1f} {ratio:>8} {r['estimated_s']:>10.1f} {err:>+9.1f}% "
              f"{r['ok_rows']:>7}/{r['failed_rows']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="1,2,4", help="comma-separated slot counts")
    ap.add_argument("--load-s", type=float, default=3.0, help="the simulated model load, seconds")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per row (4 waves at concurrency 2)")
    ap.add_argument("--max-new-tokens", type=int, default=640, help="tokens per prompt")
    ap.add_argument("--no-predicted", action="store_true", help="skip the predicted plan (bench --predict) runs")
    ap.add_argument("--json", action="store_true", help="print a JSON list of {plan, slots, wall_s, estimated_s}")
    ap.add_argument("--quick", action="store_true",
                    help="2 slots only (the predicted plan too), no calibrating sweep (the estimates are the "
                         "defaults'), 2 prompts x 32 tokens, the simulator 10x faster than real time (SIM_TIME_SCALE "
                         "0.1): every step, its figures meaningless")
    args = ap.parse_args()
    time_scale = 1.0
    if args.quick:
        args.slots, args.num_prompts, args.max_new_tokens, time_scale = "2", 2, 32, 0.1
    counts = [int(x) for x in args.slots.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ[STATE_ENV] = str(tmp / "state.json")
        (tmp / "calibration").mkdir()
        calibrated = None if args.quick else calibrate(tmp, args.load_s, max(counts), args.num_prompts,
                                                       args.max_new_tokens, time_scale)
        spec = parse_sweep(sweep_doc(args.num_prompts, args.max_new_tokens), tmp / "slots.yaml")
        workload = build_workload(spec.workload)
        for n in counts:
            host = load_inventory([write_inventory(tmp, n, args.load_s, time_scale=time_scale)]).hosts["sim"]
            prepared = prepare_sweep(spec, [host])
            sched = prepared.hosts[0].schedule
            estimated = sched.wall_s if sched is not None else prepared.hosts[0].estimate_s
            started = time.monotonic()
            outcome = SweepRunner(prepared, workload, ledger_path=tmp / f"ledger-{n}.jsonl").run()
            wall = time.monotonic() - started
            (summary,) = outcome.hosts
            rows.append({"plan": "full", "slots": n, "wall_s": round(wall, 2), "estimated_s": round(estimated, 2),
                         "ok_rows": summary.ok_rows, "failed_rows": summary.failed_rows})
        if not args.no_predicted:
            doc = sweep_doc(args.num_prompts, args.max_new_tokens)
            for n in [max(counts)] if args.quick else sorted({1, max(counts)}):
                # Quick: at most two passes of the measured phase (its figures mean nothing there).
                rows.append(run_predicted(tmp, doc, n, args.load_s, time_scale,
                                          predict={"max_repeats": 2} if args.quick else None))
    ok = all(r["failed_rows"] == 0 for r in rows)
    if args.json:
        keys = ("plan", "slots", "wall_s", "estimated_s", "predict_phase_s", "predict_phase_estimated_s")
        print(json.dumps([{k: r[k] for k in keys if k in r} for r in rows]))
        return 0 if ok else 1
    if calibrated is None:
        print(f"8 trees on one live launch, not calibrated (--quick), {os.cpu_count()} CPUs")
    else:
        print(f"8 trees on one live launch, calibrated launch (restart -> ready) {calibrated[0]:.2f} s, "
              f"step {calibrated[1] * 1000:.1f} ms, {os.cpu_count()} CPUs")
    print_table([r for r in rows if r["plan"] == "full"])
    predicted = [r for r in rows if r["plan"] == "predicted"]
    if predicted:
        print("predicted plan (bench --predict: 4 probes and a trace run split over the slots, the top 3 trees "
              "measured on the slots' predict launches)")
        print_table(predicted)
        for r in predicted:
            print(f"{r['slots']} slot(s): predict phase {r['predict_phase_s']:.1f} s (estimate "
                  f"{r['predict_phase_estimated_s']:.1f} s), measuring {r['wall_s'] - r['predict_phase_s']:.1f} s "
                  f"(estimate {r['estimated_s'] - r['predict_phase_estimated_s']:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
