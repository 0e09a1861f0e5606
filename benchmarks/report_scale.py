"""Report over a synthetic ledger of many rows: wall time, CPU time and peak memory.

    .venv/bin/python benchmarks/report_scale.py [--rows 1000000] [--keep PATH] [--quick]

Writes the ledger once (not timed; reused when ``--keep PATH`` exists), then runs the
whole report pipeline (load, per-host and per-GPU aggregation, best configs) in a fresh
child process — so nothing is cached from the write — and prints its wall time, CPU
time, peak RSS and a per-phase split. Target: < 10 s, < 2 GiB on 2 cores.

Rows are what the sweep runner writes (built with ``ledger.encode_row``, the runner's
own encoder): full provenance, the launch argv, readiness phases, every latency metric
with full float precision, AR and DFlash baselines next to the DDTree grid, eager
fallbacks on one GPU type and a few failed rows — about 2.2 KB a row (a row the runner
writes against the simulator, with no GPU provenance and a short argv, is 1.8 KB).
40 hosts (two GPU types) x 153 cells, so a million rows is ~160 pooled repeats per
cell: a ledger that has accumulated many sweeps of the same grid.

The machine's load average is printed with the figures: on shared CPUs the wall time
follows the load, the CPU time much less so.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ddtree_ops.bench.ledger import LATENCY_METRICS, LATENCY_STATS, encode_row
from ddtree_ops.service.launch import ddtree_flags

_CHILD = """
import resource, sys, time
t0 = time.perf_counter()
from ddtree_ops import report as rep
t1 = time.perf_counter()
loaded = rep.load_ledgers([sys.argv[1]])
t2 = time.perf_counter()
levels = rep.aggregate_levels(loaded.frame, ("host", "gpu"))
t3 = time.perf_counter()
best = rep.best_configs(levels["gpu"])
t4 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(len(loaded.frame), len(levels["host"]), len(best.best), len(loaded.bad_lines),
      f"{t1 - t0:.2f} {t2 - t1:.2f} {t3 - t2:.2f} {t4 - t3:.2f} {peak:.0f}")
"""

_HOSTS = 40
_BUDGETS, _TOPKS = (4, 8, 16, 32, 64), (2, 4, 8)
_TEMPS, _CONCS = (0.0, 0.6, 1.0), (1, 8, 32)
_CONFIGS: tuple[tuple[str, int | None, int | None], ...] = (
    ("AR", None, None),
    ("DFLASH", None, None),
    *(("DDTREE", b, k) for b in _BUDGETS for k in _TOPKS),
)
_PHASES = ("starting", "loading_weights", "allocating_kv_cache", "capturing_cuda_graphs", "warmup")
_CAPTURE_FAILED = "Capture cuda graph failed: CUDA error: an illegal memory access was encountered"


def _host(i: int) -> dict[str, Any]:
    b300 = i % 2 == 1
    return {
        "host": f"{'b300' if b300 else 'ct200'}-{i:02d}",
        "gpu_name": "NVIDIA B300 SXM6 AC" if b300 else "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        "gpu_arch": "sm_103" if b300 else "sm_120",
    }


def _argv(algorithm: str, budget: int | None, topk: int | None, cuda_graph: bool) -> list[str]:
    argv = ["/opt/sglang/.venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/Kimi-K2.6",
            "--host", "0.0.0.0", "--port", "30000", "--tp", "8", "--trust-remote-code", "--mem-fraction-static", "0.85"]
    if algorithm != "AR":
        argv += ["--speculative-algorithm", algorithm,
                 "--speculative-draft-model-path", "/models/Kimi-K2.6-DFlash-drafter"]
    if algorithm == "DDTREE":
        assert budget is not None and topk is not None
        argv += ddtree_flags(budget, topk)
    if not cuda_graph:
        argv += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    return argv


def make_row(i: int, rng: random.Random) -> dict[str, Any]:
    """Row ``i`` of the synthetic ledger: consecutive rows walk hosts, then cells, then repeats."""
    host = i % _HOSTS
    cell = i // _HOSTS
    algorithm, budget, topk = _CONFIGS[cell % len(_CONFIGS)]
    temperature = _TEMPS[(cell // len(_CONFIGS)) % len(_TEMPS)]
    concurrency = _CONCS[(cell // (len(_CONFIGS) * len(_TEMPS))) % len(_CONCS)]
    repeat = cell // (len(_CONFIGS) * len(_TEMPS) * len(_CONCS))
    hinfo = _host(host)
    # The sampling path with budget > 8 falls back to eager on B300 (design notes, §1).
    cuda_graph = not (hinfo["gpu_arch"] == "sm_103" and algorithm == "DDTREE" and (budget or 0) > 8 and temperature > 0)
    failed_row = rng.random() < 0.005
    t = 1_777_000_000 + i * 37
    speed = {"AR": 1.0, "DFLASH": 1.6}.get(algorithm, 1.9 + 0.1 * (topk or 0) - 0.002 * (budget or 0))
    row: dict[str, Any] = {
        "run_id": f"20260501T{repeat % 24:02d}0000-{repeat * 7919 % 0xFFFFFF:06x}",
        "sweep": "kimi-k2.6-ddtree-grid",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t + 31)),
        **hinfo,
        "gpu_count": 8,
        "driver": "580.82.07",
        "sglang_version": "0.5.23",
        "bundle_name": "ddtree_temperature",
        "bundle_hash": "3f9a0c1e5b7d2a4c6e8f0b1d3c5e7a9b1d3f5a7c9e1b3d5f7a9c1e3b5d7f9a1c",
        "server_argv": _argv(algorithm, budget, topk, cuda_graph),
        "algorithm": algorithm,
        "budget": budget,
        "topk": topk,
        "cuda_graph": cuda_graph,
        "fallback_reason": None if cuda_graph else _CAPTURE_FAILED,
        "readiness_s": {p: rng.uniform(0.5, 360.0) for p in _PHASES},
        "workload_hash": "9b2e4d6f8a0c2e4b",  # prompts.py keeps 16 hex digits
        "workload_name": "mt-bench+humaneval",
        "workload_num_prompts": 64,
        "workload_max_new_tokens": 512,
        "workload_ignore_eos": True,
        "workload_seed": 0,
        "temperature": temperature,
        "top_p": 1.0 if temperature == 0 else 0.95,
        "top_k": -1,
        "concurrency": concurrency,
        "request_rate": None,
        "repeat": repeat,
        "status": "failed" if failed_row else "ok",
        "error": "server exited with code -9 during the cell (see service log)" if failed_row else None,
    }
    if failed_row:
        return row
    tok_s = rng.gauss(180.0 * concurrency**0.7 * speed, 6.0)
    completed = 64 - (rng.random() < 0.01)
    row.update(
        completed=completed,
        failed=64 - completed,
        duration_s=rng.uniform(20.0, 90.0),
        output_tok_s=tok_s,
        request_s=rng.uniform(0.5, 8.0),
        total_input_tokens=rng.randrange(8000, 12000),
        total_output_tokens=completed * 512,
        accept_length=None if algorithm == "AR" else rng.gauss(2.0 + speed, 0.2),
        verify_ct=None if algorithm == "AR" else rng.randrange(5000, 15000),
    )
    for metric in LATENCY_METRICS:
        for stat in LATENCY_STATS:
            row[f"{metric}_{stat}"] = rng.uniform(5.0, 900.0)
    return row


def make_ledger(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "wb") as fh:
        for i in range(rows):
            fh.write(encode_row(make_row(i, rng)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="write the ledger here and keep it (reused if it exists)")
    ap.add_argument("--quick", action="store_true", help="2,000 rows (--rows 2000)")
    args = ap.parse_args()
    if args.quick:
        args.rows = 2000
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "scale.jsonl"
        if not path.exists():
            t = time.perf_counter()
            make_ledger(path, args.rows)
            print(
                f"wrote {args.rows:,} rows ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s"
            )
        size = path.stat().st_size
        load_before = os.getloadavg()
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
        load_after = os.getloadavg()
        rows, cells, best, bad, imp, load, agg, pick, peak = out.stdout.split()
        print(
            f"ledger: {int(rows):,} rows, {size / 2**30:.2f} GiB ({size / int(rows):.0f} B/row), {int(bad)} bad lines"
        )
        print(f"report: {int(cells):,} per-host cells, {int(best)} best rows")
        print(f"wall {wall:.2f} s, CPU {cpu:.2f} s, peak RSS {float(peak):.0f} MiB  [target < 10 s, < 2048 MiB]")
        print(f"  import {float(imp):.2f} s, load {float(load):.2f} s, aggregate host+gpu {float(agg):.2f} s, "
              f"best {float(pick):.2f} s")
        print(f"  load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
