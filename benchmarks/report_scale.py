"""Report over a synthetic ledger of many rows: wall time and peak memory.

    .venv/bin/python benchmarks/report_scale.py [--rows 1000000] [--keep PATH]

Writes the ledger once (not timed; realistic rows of ~1.3 KB, 40 hosts), then runs the
whole report pipeline (load, per-host and per-GPU aggregation, best configs) in a fresh
child process and prints its wall time and peak RSS. Target: < 10 s, < 2 GiB on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddtree_ops.bench.ledger import encode_row

_CHILD = """
import resource, sys, time
t0 = time.perf_counter()
from ddtree_ops import report as rep
t1 = time.perf_counter()
r = rep.build_report([sys.argv[1]], group_by="gpu")
t2 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{len(r.loaded.frame)} {len(r.tidy)} {len(r.best.best)} {t1 - t0:.2f} {t2 - t1:.2f} {peak:.0f}")
"""


def make_ledger(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    base = json.loads(
        encode_row(
            {
                "run_id": "r1", "sweep": "scale", "started_at": "2026-05-01T12:00:00Z", "finished_at": "2026-05-01T12:00:10Z",
                "host": "h0", "gpu_name": "NVIDIA B300 SXM6", "gpu_arch": "sm_103", "gpu_count": 8, "driver": "580.1",
                "sglang_version": "0.5.23", "bundle_name": "ddtree_temperature", "bundle_hash": "ab" * 32,
                "server_argv": ["python", "-m", "sglang.launch_server", "--model-path", "/models/m", "--port", "30000",
                                "--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "16",
                                "--speculative-ddtree-topk", "4"],
                "algorithm": "DDTREE", "budget": 16, "topk": 4, "cuda_graph": True, "fallback_reason": None,
                "readiness_s": {"stop": 1.0, "load": 300.0, "warmup": 5.0}, "workload_hash": "cd" * 32,
                "workload_name": "mixed", "workload_num_prompts": 64, "workload_max_new_tokens": 256,
                "workload_ignore_eos": True, "workload_seed": 0, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                "concurrency": 1, "request_rate": None, "repeat": 0, "status": "ok", "error": None,
                "completed": 64, "failed": 0, "duration_s": 30.0, "output_tok_s": 500.0, "request_s": 2.0,
                "total_input_tokens": 9000, "total_output_tokens": 16384,
                **{f"{m}_{s}": 12.5 for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms") for s in ("mean", "median", "p90", "p99")},
                "accept_length": 4.2, "verify_ct": 3900,
            }
        )
    )
    budgets, topks, temps, concs = (4, 8, 16, 32, 64), (2, 4, 8), (0.0, 0.6, 1.0), (1, 8, 32)
    per_repeat = 40 * len(budgets) * len(topks) * len(temps) * len(concs)
    with open(path, "w") as fh:
        for i in range(rows):
            host = i % 40
            row = dict(base)
            row.update(
                host=f"host-{host:02d}",
                gpu_name="NVIDIA B300 SXM6" if host % 2 else "NVIDIA RTX PRO 6000 Blackwell",
                budget=budgets[(i // 40) % 5], topk=topks[(i // 200) % 3], temperature=temps[(i // 600) % 3],
                concurrency=concs[(i // 1800) % 3], repeat=i // per_repeat,
                output_tok_s=rng.gauss(500, 20), accept_length=rng.gauss(4, 0.2), ttft_ms_median=rng.gauss(40, 3),
            )
            fh.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="write the ledger here and keep it (default: a temp file)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "scale.jsonl"
        if not path.exists():
            t = time.perf_counter()
            make_ledger(path, args.rows)
            print(f"wrote {args.rows:,} rows ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t
        rows, cells, best, imp, work, peak = out.stdout.split()
        print(f"report: {int(rows):,} rows -> {int(cells):,} cells, {int(best)} best rows")
        print(f"wall {wall:.2f} s (import {float(imp):.2f} s, load+aggregate+best {float(work):.2f} s), "
              f"peak RSS {float(peak):.0f} MiB  [target < 10 s, < 2048 MiB]")


if __name__ == "__main__":
    main()
