"""What the closing observation adds to a command on N hosts (issue 53: at most 0.5 s per host on 8).

Every command that changes hosts ends by observing each target (``rollout/observe.py``): one
gather of the bundle's hashes, one ``status`` round trip per server (record, process, port
owner, health, ``/server_info``) and a one-request greedy smoke. This starts N real sshd test
hosts on loopback (``tests/fleetlib.py``), optionally behind a user-space delaying TCP proxy
(``--rtt-ms``: every chunk forwarded RTT/2 later each way; ``tc netem`` is not available here),
deploys the real bundle and launches a DDTREE simulator server on each (time scale 0.1: a
16-token smoke takes tens of milliseconds of modelled time), then times, over ``--repeat``
rounds, the observation of all N hosts in parallel exactly as a rollout makes it
(``executor.observe_all``'s fan-out of ``DeployChange.observe``), and its parts alone.

It prints, per part, the fan-out's wall time (what it adds to the command) and that divided
by N; ``--json`` prints one document.

    .venv/bin/python benchmarks/observe_overhead.py --hosts 8 --rtt-ms 50 --repeat 5 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from deploy_latency import DelayProxy  # noqa: E402
from fleetlib import build_fleet  # noqa: E402
from minisglang import deployed_python  # noqa: E402
from service.simhosts import sim_host  # noqa: E402

from ddtree_ops.fleet import run_on_hosts  # noqa: E402
from ddtree_ops.inventory_types import Host  # noqa: E402
from ddtree_ops.patching.bundle import load_bundle  # noqa: E402
from ddtree_ops.patching.executor import RunOptions, deploy  # noqa: E402
from ddtree_ops.patching.status import host_status  # noqa: E402
from ddtree_ops.rollout.observe import observe_host  # noqa: E402
from ddtree_ops.service import lifecycle  # noqa: E402
from ddtree_ops.service.launch import RunConfig  # noqa: E402
from ddtree_ops.service.observed import OBSERVE_SMOKE, observe_server  # noqa: E402
from ddtree_ops.shipped import DEFAULT_BUNDLE  # noqa: E402
from ddtree_ops.state import StateStore  # noqa: E402
from ddtree_ops.transport import open_transport  # noqa: E402


def _timed(hosts: list[Host], fn: Callable[[Host], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        results = run_on_hosts(hosts, fn, max_parallel=len(hosts))
        out.append(time.perf_counter() - started)
        if results.failed:
            raise SystemExit(f"failed: {dict(results.failed)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="observe-overhead-"))
    fleet = build_fleet(root / "fleet", [None] * args.hosts)
    proxy = DelayProxy(args.rtt_ms / 2000.0) if args.rtt_ms > 0 else None
    python = deployed_python()
    bundle = load_bundle(DEFAULT_BUNDLE)
    hosts: list[Host] = []
    try:
        for i, base in enumerate(fleet.load().hosts.values()):
            port = proxy.add(base.port) if proxy is not None else base.port
            host = sim_host(fleet.hosts[i].run_dir, base=replace(base, port=port), name=base.name, python=python,
                            load_s=0.2, time_scale=0.1)
            hosts.append(host)

        def prepare(host: Host) -> None:
            with open_transport(host) as t:
                deploy(t, host, bundle, RunOptions())
                request = lifecycle.prepare_restart(t, host, RunConfig("DDTREE", budget=8, topk=2), smoke=None)
                lifecycle.restart(t, request, state=StateStore(root / "state.json"))

        prepared = run_on_hosts(hosts, prepare, max_parallel=len(hosts))
        if prepared.failed:
            raise SystemExit(f"setup failed: {dict(prepared.failed)}")

        def whole(host: Host) -> None:
            with open_transport(host) as t:
                snap = observe_host(t, host, bundle=bundle)
                assert snap.bundle is not None and snap.bundle.applied(bundle) and all(s.ready for s in snap.servers)

        def gather_only(host: Host) -> None:
            with open_transport(host) as t:
                host_status(t, host, bundle=bundle)

        def status_only(host: Host) -> None:
            with open_transport(host) as t:
                observe_server(lifecycle.manager_for(t, host), smoke=None)

        def smoke_included(host: Host) -> None:
            with open_transport(host) as t:
                observe_server(lifecycle.manager_for(t, host), smoke=OBSERVE_SMOKE)

        parts = {"observation (gather + status + smoke)": whole, "gather only": gather_only,
                 "status only": status_only, "status + smoke": smoke_included}
        measured = {name: _timed(hosts, fn, args.repeat) for name, fn in parts.items()}
    finally:
        for host in hosts:
            try:
                with open_transport(host) as t:
                    lifecycle.stop(t, host, grace_s=5)
            except Exception:  # noqa: BLE001 - cleanup
                pass
        fleet.close()
        shutil.rmtree(root, ignore_errors=True)

    doc = {
        "hosts": args.hosts, "rtt_ms": args.rtt_ms, "repeat": args.repeat,
        "parts": {name: {"wall_s_min": min(v), "wall_s_median": statistics.median(v), "wall_s_max": max(v),
                         "per_host_s_median": statistics.median(v) / args.hosts} for name, v in measured.items()},
        "target": "the observation adds at most 0.5 s per host to a command on 8 hosts",
    }
    # What a command on N hosts waits for is the fan-out's wall time; the target allows 0.5 s
    # of it per host (so 4 s on 8 hosts), and the per-host figure is that time divided by N.
    doc["meets_target"] = doc["parts"]["observation (gather + status + smoke)"]["per_host_s_median"] <= 0.5
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{args.hosts} hosts, RTT {args.rtt_ms:g} ms, {args.repeat} rounds; fan-out wall time (min / median / max)")
    for name, row in doc["parts"].items():
        print(f"  {name:40s} {row['wall_s_min']:.3f} / {row['wall_s_median']:.3f} / {row['wall_s_max']:.3f} s"
              f"   ({row['per_host_s_median']:.3f} s per host)")


if __name__ == "__main__":
    main()
