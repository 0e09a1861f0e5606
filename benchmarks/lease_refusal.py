"""How fast a second sweep (and a restart) is refused while a sweep holds a host.

One local simulated host (``SIM_TIME_SCALE=1``). A first ``ddtree-ops bench`` sweep runs
as its own process; once it holds the host's sweep lease (``run_dir/sweep.lease``), a
second ``bench`` sweep and a ``restart`` of the same host are each run ``--tries`` times
as whole command-line processes (interpreter start-up and imports included, as an
operator would see them), and their wall times are printed: the goal is under a second.
The first sweep must still be running after every refusal and must end with all its rows
ok: the refusals did not wait for it and did not touch it.

For comparison, ``ddtree-ops hosts`` on the same inventory (start-up, imports and the
inventory load, nothing else) is timed the same way.

    .venv/bin/python benchmarks/lease_refusal.py [--tries 5] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ddtree_ops.bench import ledger
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service import lifecycle, manager
from ddtree_ops.transport.local import LocalTransport

HOST = "sim-x"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_files(tmp: Path, *, quick: bool = False) -> tuple[Path, Path, Path]:
    inv = tmp / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"local": {"hosts": {HOST: {
        "ansible_connection": "local",
        "ddtree": {"python": sys.executable, "run_dir": str(tmp / "run"), "server": {
            "command": "{python} -m ddtree_ops.sim", "model_path": "sim/m", "draft_model_path": "sim/d",
            "port": free_port(), "expected_load_s": 5,
            "env": {"SIM_GPU": "rtx-pro-6000", "SIM_LOAD_S": "1", "SIM_TIME_SCALE": "1"}}}}}}}}}))
    (tmp / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "general kenobi"}\n')
    sweeps = []
    # --quick: the first sweep is one cell of 4 x 192 tokens (over 10 s of decoding, sleeping):
    # it outlasts one try of each refusal on a busy machine (7 s here), and costs little CPU.
    first = ("first", 192, 1, [0.0], [1]) if quick else ("first", 128, 2, [0.0, 0.6], [1, 2])
    for name, tokens, repeats, temperatures, concurrency in (first, ("second", 16, 1, [0.0, 0.6], [1, 2])):
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "name": name, "targets": ["local"], "repeats": repeats, "warmup": 0,
            "grid": {"algorithm": ["autoregressive"], "temperature": temperatures, "concurrency": concurrency},
            "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": tokens}}))
        sweeps.append(path)
    return inv, sweeps[0], sweeps[1]


def timed(argv: list[str], cwd: Path) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    return time.perf_counter() - start, done.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tries", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one try each, a first sweep of one cell")
    args = ap.parse_args()
    if args.quick:
        args.tries = 1
    cli = [sys.executable, "-m", "ddtree_ops"]
    with tempfile.TemporaryDirectory(prefix="ddtree-lease-") as tmp_s:
        tmp = Path(tmp_s)
        inv, first_sweep, second_sweep = write_files(tmp, quick=args.quick)
        env = dict(os.environ, DDTREE_OPS_STATE=str(tmp / "state.json"))
        first = subprocess.Popen(
            [*cli, "--json", "-i", str(inv), "bench", "--sweep", str(first_sweep), "--out", str(tmp / "first.jsonl")],
            cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        lease = tmp / "run" / manager.LEASE_FILE
        times: dict[str, list[float]] = {"bench (second sweep)": [], "restart": [], "hosts (start-up only)": []}
        codes: dict[str, set[int]] = {name: set() for name in times}
        try:
            deadline = time.monotonic() + 120
            while first.poll() is None and time.monotonic() < deadline and not lease.exists():
                time.sleep(0.05)
            if not lease.exists():
                print(f"the first sweep never took the lease: {first.communicate()[1][-2000:]}", file=sys.stderr)
                return 1
            for i in range(args.tries):
                second_out = str(tmp / f"second-{i}.jsonl")
                for name, argv in (
                    ("bench (second sweep)", ["bench", "--sweep", str(second_sweep), "--out", second_out]),
                    ("restart", ["restart", HOST, "--algorithm", "AR", "--timeout", "60"]),
                    ("hosts (start-up only)", ["hosts"]),
                ):
                    seconds, code = timed([*cli, "--json", "-i", str(inv), *argv], tmp)
                    times[name].append(seconds)
                    codes[name].add(code)
            still_running = first.poll() is None
            _, err = first.communicate(timeout=600)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait(10)
            host = load_inventory([inv]).hosts[HOST]
            with LocalTransport(host.name) as t:
                lifecycle.stop(t, host, grace_s=2.0, lease=manager.LeasePass(force=True))
        rows = ledger.read_ledger(tmp / "first.jsonl").rows
        first_ok = first.returncode == 0 and rows and all(r["status"] == "ok" for r in rows)
    result = {
        "tries": args.tries,
        "cpus": os.cpu_count(),
        "first_sweep_running_after_refusals": still_running,
        "first_sweep_rows_ok": f"{sum(r['status'] == 'ok' for r in rows)}/{len(rows)}",
        "commands": [
            {"command": name, "exit_codes": sorted(codes[name]), "median_s": round(statistics.median(values), 3),
             "max_s": round(max(values), 3)}
            for name, values in times.items()
        ],
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"first sweep still running after the refusals: {still_running}; its rows ok: "
              f"{result['first_sweep_rows_ok']}; {args.tries} tries each, {os.cpu_count()} CPUs")
        for item in result["commands"]:
            print(f"  {item['command']:<24} exit {item['exit_codes']}  median {item['median_s']:.3f} s"
                  f"  max {item['max_s']:.3f} s")
    if not first_ok:
        print(f"the first sweep did not end well: exit {first.returncode}: {err[-2000:]}", file=sys.stderr)
        return 1
    if not still_running:
        print("the first sweep ended before the refusals did: they were not all made against a held host",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
