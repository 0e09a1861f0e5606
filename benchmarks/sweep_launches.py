"""Server launches and wall time of ``bench_configs/budgets.yaml`` on the simulated fleet:
live tree switching (``relaunch: never``) against one launch per tree (``relaunch: always``),
both measured in one run, and whether a switched cell measures what a fresh launch does.

The fleet: two local hosts served by the simulator in real time (``SIM_TIME_SCALE=1``), their
SGLang a small real 0.5.23 prefix with the DDTree bundle deployed into it, made at the start
(``tests/minisglang.py``; nothing to build first but the venv and its cached wheel), one
per machine type of the sweep's targets (``rtx-pro-6000`` for CT200, ``b300``), run in
parallel as ``bench`` runs them. A launch costs what the simulator models: the weight load
(``--load-s`` simulated seconds, default 8: Kimi K2.6's ~6 minutes scaled 45x down; the
simulator's own start, importing torch, counts towards it), one verify-graph capture per
runtime state (``2 + 0.01 x --max-bs`` s each; ``--max-bs`` 16 by default, for every
launch of both modes), the warmup (``--warmup-s``), the restart's smoke and stopping the
previous server. On the
b300 host a budget > 8 does not capture: relaunching, the lifecycle falls back to eager
(and remembers it); live, that runtime state is served eager. Either way its rows say eager.

The grid is the file's: its budgets x top-k x baselines, so the launches per host are the
real ones (32 relaunching). The workload is scaled down for time (flags below: by default
T = 0 only, concurrency 1, 2 prompts x 16 tokens after 1 warmup request, one repeat); a
cell's load lasts well under a second against launches of over ten. The load is generated
on each host beside its server (``client: host``, what ``bench`` picks for a server bound
to loopback), so each host's client runs on that host's CPU; ``--client local`` generates
both hosts' load in this one process instead, where one host's runner thread (a readiness
poll, a launch) holds the interpreter while the other's client timestamps its stream: in
two such runs 59 and 58 of 60 cells agreed within 2 % and one cell was off by 4 % and
12.5 %. Both modes
run the same cells through ``SweepRunner`` (the code ``bench`` runs), one after the other,
each from no server, each with its own ledger.

Printed: per mode, the server launches per host and the sweep's wall time; the wall-time
ratio; and per cell the output tok/s on the switched server against the freshly launched
one (max and median relative difference, the worst cell named). Goals (issue 25): launches
per host at most 3, wall time at most 0.2x, per-cell tok/s within 2%.

    .venv/bin/python benchmarks/sweep_launches.py [--load-s 6] [--max-new-tokens 48] [--json]
    .venv/bin/python benchmarks/sweep_launches.py --quick    # 2 trees, no baselines: every step, ~1 min

About 10 minutes on a 2-core machine with the defaults. On a real fleet the hosts are
separate machines; here they share this one, so by default each host's processes run on a
CPU of their own (``taskset``, when there are as many CPUs as hosts; ``--no-pin`` turns it
off): otherwise one host's launch (importing torch) slows the steps of the other's server
while it measures. The machine's other load still moves the figures, so a single cell's
tok/s can differ between the two runs by more than the model does (the model: the same
tokens in the same verify rounds, which is checked and printed). The CPU count, the
pinning and the client mode are printed with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

# The benchmark scripts' directory is on sys.path when one runs: share its port helper, and
# the interpreter with the DDTree bundle deployed (sweep_slots puts tests/ on sys.path).
from sweep_slots import deployed_python, free_ports

from ddtree_ops.bench import ledger
from ddtree_ops.bench.plan import plan_sweep
from ddtree_ops.bench.prepare import prepare_sweep
from ddtree_ops.bench.runner import SweepRunner
from ddtree_ops.bench.sweep import SweepSpec, load_sweep
from ddtree_ops.inventory import load_inventory
from ddtree_ops.inventory_types import Host
from ddtree_ops.state import STATE_ENV
from ddtree_ops.workload.draw import Workload, build_workload

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "bench_configs" / "budgets.yaml"
FLEET = {"sim-ct200": "rtx-pro-6000", "sim-b300": "b300"}
MODES = ("never", "always")
# What identifies one cell's run on one host, in both ledgers.
CELL_KEYS = ("host", "algorithm", "budget", "topk", "temperature", "top_p", "top_k", "concurrency", "repeat")


def pinned_cpus(args: argparse.Namespace) -> dict[str, int]:
    """One CPU of this machine per simulated host, when there are enough and --pin allows.

    On a real fleet each host is its own machine: one host's launch (an interpreter
    importing torch) never slows the other's measurement. Sharing two cores, it did: in
    relaunch mode one host's launches overlap the other's cells. Each host's processes
    (agent, server, probes, the on-host client) run on a CPU of their own.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if not args.pin or len(cpus) < len(FLEET):
        return {}
    return dict(zip(FLEET, cpus, strict=False))


def host_python(tmp: Path, name: str, python: Path, cpu: int | None) -> Path:
    """The host's interpreter, or a wrapper that runs it on ``cpu`` alone."""
    if cpu is None:
        return python
    wrapper = tmp / f"{name}-python"
    wrapper.write_text(f"#!/bin/sh\nexec taskset -c {cpu} {shlex.quote(str(python))} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def fleet(tmp: Path, args: argparse.Namespace, cpus: dict[str, int]) -> list[Host]:
    """The simulated fleet as an inventory file (loaded like any other)."""
    hosts: dict[str, Any] = {}
    # A small real SGLang 0.5.23 prefix (its files and dist-info: the probe reads the version
    # the eager flags are chosen by) with the DDTree bundle deployed into it by the toolkit's
    # deploy, made here: the simulator loads the plugin from its host's SGLang as SGLang does,
    # so a DDTREE launch on a host without the bundle (the bare `make demo-hosts` prefixes)
    # is refused. Both hosts run it; each has its own run_dir.
    deployed = Path(deployed_python())
    for (name, gpu), port in zip(FLEET.items(), free_ports(len(FLEET)), strict=True):
        python = host_python(tmp, name, deployed, cpus.get(name))
        hosts[name] = {"ansible_connection": "local", "ddtree": {
            "python": str(python), "run_dir": str(tmp / name), "gpu": gpu,
            "server": {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/kimi-k2.6",
                       "draft_model_path": "sim/kimi-k2.6-dflash", "port": port,
                       "expected_load_s": args.load_s + 10,
                       "extra_args": ["--cuda-graph-max-bs-decode", str(args.max_bs)],
                       "env": {"SIM_GPU": gpu, "SIM_LOAD_S": str(args.load_s), "SIM_TIME_SCALE": "1",
                               "SIM_WARMUP_S": str(args.warmup_s)}}}}
    inv = tmp / "fleet.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"fleet": {"hosts": hosts}}}}))
    inventory = load_inventory([inv])
    return [inventory.hosts[name] for name in FLEET]


# --quick: a tree grid of two budgets (both capture on the b300: no eager fallback) and no
# baselines, 1 prompt: the benchmark's whole path (both modes on both hosts, the switched
# cells compared) in about a minute, its figures meaningless.
QUICK_GRID = {"budget": (4, 8), "topk": (4,)}


def scaled(spec: SweepSpec, args: argparse.Namespace) -> SweepSpec:
    """``spec`` with its workload scaled down; its budgets, top-k and baselines untouched
    (--quick: QUICK_GRID's trees, no baselines)."""
    grid = dict(spec.grid) | {"temperature": tuple(args.temperatures), "concurrency": tuple(args.concurrency)}
    if args.quick:
        spec = dataclasses.replace(spec, baselines=(), exclude=())
        grid |= QUICK_GRID
    workload = Workload(prompt_set=spec.workload.prompt_set, num_prompts=args.num_prompts,
                        max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=spec.workload.seed)
    return dataclasses.replace(spec, targets=("fleet",), grid=grid, workload=workload, repeats=args.repeats,
                               warmup=args.warmup, client=args.client, request_timeout_s=120.0)


def run_mode(spec: SweepSpec, hosts: list[Host], mode: str, out: Path) -> dict[str, Any]:
    spec = dataclasses.replace(spec, relaunch=mode)
    prepared = prepare_sweep(spec, hosts)
    started = time.monotonic()
    outcome = SweepRunner(prepared, build_workload(spec.workload, search=(SWEEP.parent,)), ledger_path=out).run()
    wall = time.monotonic() - started
    read = ledger.read_ledger(out)
    return {
        "relaunch": mode,
        "wall_s": round(wall, 1),
        "planned_launches_per_host": prepared.plan.restarts,
        "launches_per_host": {h.host: h.restarts for h in outcome.hosts},
        "ok_rows": sum(h.ok_rows for h in outcome.hosts),
        "failed_rows": sum(h.failed_rows for h in outcome.hosts),
        "errors": sorted({str(r["error"]) for r in read.rows if r["status"] != "ok"})[:5],
        "rows": read.rows,
    }


def compare(live: list[dict[str, Any]], fresh: list[dict[str, Any]]) -> dict[str, Any]:
    """Per DDTree cell: output tok/s switched live against a fresh launch of its tree."""
    by_key = {tuple(r[k] for k in CELL_KEYS): r for r in fresh if r["status"] == "ok"}
    diffs: list[tuple[float, dict[str, Any]]] = []
    mismatched_graph = same_rounds = 0
    for r in live:
        if r["status"] != "ok" or not r.get("tree_switched"):
            continue
        other = by_key.get(tuple(r[k] for k in CELL_KEYS))
        if other is None or not other["output_tok_s"]:
            continue
        mismatched_graph += r["cuda_graph"] != other["cuda_graph"]
        # The same tokens in the same verify rounds: the simulator's modelled time of the
        # cell is then the same, so any tok/s difference is the machine, not the model.
        same_rounds += all(r[k] == other[k] for k in ("total_output_tokens", "verify_ct", "accept_length"))
        diff = abs(r["output_tok_s"] - other["output_tok_s"]) / other["output_tok_s"]
        cell = {k: r[k] for k in CELL_KEYS} | {"live_tok_s": round(r["output_tok_s"], 2),
                                               "fresh_tok_s": round(other["output_tok_s"], 2),
                                               "cuda_graph": r["cuda_graph"], "rel_diff": round(diff, 4)}
        diffs.append((diff, cell))
    diffs.sort(key=lambda d: d[0])
    values = [d for d, _ in diffs]
    return {
        "cells": len(diffs),
        "max_rel_diff": round(values[-1], 4) if values else None,
        "median_rel_diff": round(statistics.median(values), 4) if values else None,
        "within_2pct": sum(v <= 0.02 for v in values),
        "worst": diffs[-1][1] if diffs else None,
        "cuda_graph_mismatches": mismatched_graph,
        "same_tokens_and_rounds": same_rounds,
        "per_cell": [c for _, c in diffs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load-s", type=float, default=8.0, help="simulated weight load per launch, s (real time)")
    ap.add_argument("--warmup-s", type=float, default=0.5, help="simulated warmup after the port opens, s")
    ap.add_argument("--max-bs", type=int, default=16, help="--cuda-graph-max-bs-decode (capture 2 + 0.01 x this s)")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    ap.add_argument("--repeats", type=int, default=1)
    # The sweep file warms up with 2 requests per cell; one is enough to take a freshly
    # launched process's first-request costs (cold code paths, allocator) out of the cell.
    ap.add_argument("--warmup", type=int, default=1, help="warmup requests per cell, not measured")
    ap.add_argument("--json", action="store_true", help="print one JSON object (per-cell figures included)")
    ap.add_argument("--keep", type=Path, default=None, help="copy both ledgers into this directory")
    ap.add_argument("--client", choices=("local", "host"), default="host",
                    help="where each host's load is generated: on the host beside its server (bench's own choice "
                         "for a loopback-bound server), or in this process")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let both hosts' processes share every CPU (default: one CPU per host when there are enough)")
    ap.add_argument("--quick", action="store_true",
                    help="budgets 4 and 8 at top-k 4, no baselines, 1 prompt x 8 tokens, no warmup request, a 1 s "
                         "load, graphs up to batch 4: runs every step in about a minute; exit 1 only for a failed row")
    args = ap.parse_args()
    if args.quick:
        args.load_s, args.warmup_s, args.max_bs, args.num_prompts, args.max_new_tokens = 1.0, 0.2, 4, 1, 8
        args.warmup, args.repeats = 0, 1
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # A private state file: no learned load time or eager fallback from earlier runs.
        os.environ[STATE_ENV] = str(tmp / "state.json")
        cpus = pinned_cpus(args)
        hosts = fleet(tmp, args, cpus)
        spec = scaled(load_sweep(SWEEP), args)
        full = load_sweep(SWEEP)
        # The launches must be the file's: scaling touched no server axis (--quick did).
        assert args.quick or plan_sweep(spec, relaunch="always").restarts == plan_sweep(full,
                                                                                         relaunch="always").restarts
        results = {mode: run_mode(spec, hosts, mode, tmp / f"{mode}.jsonl") for mode in MODES}
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for mode in MODES:
                shutil.copy(tmp / f"{mode}.jsonl", args.keep / f"sweep_launches-{mode}.jsonl")
    live, fresh = results["never"], results["always"]
    comparison = compare(live.pop("rows"), fresh.pop("rows"))
    ratio = live["wall_s"] / fresh["wall_s"]
    goals = {
        "launches_per_host_at_most_3": max(live["launches_per_host"].values()) <= 3,
        "wall_time_at_most_0.2x": ratio <= 0.2,
        "per_cell_tok_s_within_2pct": comparison["max_rel_diff"] is not None and comparison["max_rel_diff"] <= 0.02,
        "no_failed_rows": live["failed_rows"] == fresh["failed_rows"] == 0,
    }
    report = {
        "sweep": str(SWEEP.relative_to(REPO)), "cpus": os.cpu_count(), "hosts": FLEET, "pinned_cpus": cpus,
        "parameters": {k: getattr(args, k) for k in ("load_s", "warmup_s", "max_bs", "num_prompts", "max_new_tokens",
                                                      "temperatures", "concurrency", "repeats", "warmup", "client")},
        "cells_per_host": len(plan_sweep(spec).cells), "modes": {"live": live, "relaunch": fresh},
        "wall_ratio": round(ratio, 3), "tok_s": comparison, "goals": goals,
    }
    # --quick: its figures mean nothing (two trees, one prompt); only a failed row fails it.
    passed = goals["no_failed_rows"] if args.quick else all(goals.values())
    if args.json:
        print(json.dumps(report))
        return 0 if passed else 1
    p = report["parameters"]
    pins = ", ".join(f"{h} on CPU {c}" for h, c in cpus.items()) or "not pinned"
    print(f"{report['sweep']} on {len(FLEET)} simulated hosts ({', '.join(f'{h}: {g}' for h, g in FLEET.items())}), "
          f"{os.cpu_count()} CPUs ({pins}), client {args.client}, real time")
    print(f"load {p['load_s']:g} s + capture {2 + 0.01 * p['max_bs']:.2f} s per graph + warmup {p['warmup_s']:g} s per "
          f"launch; {report['cells_per_host']} cells per host: T {p['temperatures']}, concurrency {p['concurrency']}, "
          f"{p['num_prompts']} prompts x {p['max_new_tokens']} tokens after {p['warmup']} warmup request(s), "
          f"{p['repeats']} repeat(s)")
    print(f"{'mode':<22} {'launches per host':<34} {'wall s':>8} {'rows ok/failed':>15}")
    for label, r in (("live switching", live), ("relaunch: always", fresh)):
        per_host = ", ".join(f"{h} {n}" for h, n in r["launches_per_host"].items())
        print(f"{label:<22} {per_host:<34} {r['wall_s']:>8.1f} {r['ok_rows']:>9}/{r['failed_rows']}")
        for error in r["errors"]:
            print(f"  failed: {error}")
    print(f"wall time live / relaunch: {ratio:.3f}")
    c = comparison
    if c["max_rel_diff"] is not None:
        w = c["worst"]
        print(f"tok/s switched vs fresh launch over {c['cells']} DDTree cells: max {c['max_rel_diff'] * 100:.2f}%, "
              f"median {c['median_rel_diff'] * 100:.2f}%, {c['within_2pct']} within 2% "
              f"(worst: {w['host']} budget {w['budget']} top-k {w['topk']}: "
              f"{w['live_tok_s']} vs {w['fresh_tok_s']}); CUDA-graph mode differs in "
              f"{c['cuda_graph_mismatches']} cells; same tokens in the same verify rounds in "
              f"{c['same_tokens_and_rounds']}/{c['cells']}")
    print("goals: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in goals.items())
          + (" (--quick: only a failed row fails the run)" if args.quick else ""))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
