"""Wall time of `doctor` on the 3-host SSH test fleet: --max-parallel 1 vs 3.

Starts the same real-sshd fleet the tests use (tests/fleetlib.py), then times
(a) the probe fan-out in-process (median of N rounds, fresh connections each round) and
(b) the whole CLI, `python -m ddtree_ops -i <fleet> --max-parallel P doctor all`, as a user
runs it (interpreter start-up included). Prints the figures; asserts nothing.

    .venv/bin/python benchmarks/doctor_parallel.py [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from fleetlib import build_fleet, fast_root  # noqa: E402

from ddtree_ops.probe import probe_hosts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one round (--rounds 1)")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1

    root, owned = fast_root(Path(tempfile.mkdtemp(prefix="ddtree-bench-")))
    t0 = time.monotonic()
    fleet = build_fleet(root / "fleet")
    print(f"fleet of {len(fleet.hosts)} sshd hosts ready in {time.monotonic() - t0:.1f}s (cpus={os.cpu_count()}, "
          f"load={os.getloadavg()[0]:.1f})")
    try:
        hosts = list(fleet.load().hosts.values())
        probe_hosts(hosts, max_parallel=3)  # warm the page cache for both variants alike
        for parallel in (1, 3):
            times = []
            for _ in range(args.rounds):
                start = time.monotonic()
                results = probe_hosts(hosts, max_parallel=parallel)
                times.append(time.monotonic() - start)
                bad = [n for n, f in results.items() if isinstance(f, BaseException) or not f.ok]
                if bad:
                    raise SystemExit(f"probe failed on {bad}")
            print(f"probe fan-out  --max-parallel {parallel}: median {statistics.median(times):.3f}s "
                  f"(min {min(times):.3f}s, max {max(times):.3f}s, {args.rounds} rounds)")
        for parallel in (1, 3):
            cmd = [sys.executable, "-m", "ddtree_ops", "-i", str(fleet.inventory), "--max-parallel", str(parallel),
                   "doctor", "all"]
            start = time.monotonic()
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            wall = time.monotonic() - start
            print(f"CLI doctor all --max-parallel {parallel}: {wall:.3f}s wall (exit {res.returncode})")
    finally:
        fleet.close()
        if owned:
            import shutil

            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
