"""Readiness overhead: time from the server's "ready to roll" line to our "ready".

Restarts the simulator N times on a local host through ``lifecycle.restart`` and, for
each launch, watches the server log from this process every 5 ms to note when the
ready line appears (SGLang's own log stamp has 1 s resolution, too coarse for this).
The overhead is then ``RestartResult.ready_at - <ready line seen>``: what our
polling (interval, the agent round trip, /health_generate + /server_info + the socket
ownership check) adds on top of the server being ready.

    .venv/bin/python benchmarks/readiness_overhead.py --restarts 10 --poll-interval 0.5
    .venv/bin/python benchmarks/readiness_overhead.py --quick     # one restart
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.service import LaunchFacts, RestartRequest, RunConfig, lifecycle
from ddtree_ops.service.logphases import Phase, PhaseEvent
from ddtree_ops.service.manager import Launched, ProcessManager
from ddtree_ops.state import StateStore
from ddtree_ops.transport.local import LocalTransport

READY_TEXT = "The server is fired up and ready to roll!"


def watch_for_ready(log: Path, seen: list[float], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            if READY_TEXT in log.read_text(errors="replace"):
                seen.append(time.time())
                return
        except OSError:
            pass
        time.sleep(0.005)


def start_watcher_on_launch(
    log: Path, seen: list[float], halt: threading.Event, watcher: list[threading.Thread]
) -> Callable[[PhaseEvent], None]:
    """An ``on_phase`` callback that starts ``watch_for_ready`` once the server is launched."""

    def on_phase(event: PhaseEvent) -> None:
        if event.phase is Phase.STARTING:
            th = threading.Thread(target=watch_for_ready, args=(log, seen, halt), daemon=True)
            th.start()
            watcher.append(th)

    return on_phase


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--poll-interval", type=float, default=0.5)
    parser.add_argument("--load-s", type=float, default=1.0, help="SIM_LOAD_S (simulated seconds)")
    parser.add_argument("--port", type=int, default=30950, help="the server's port (--quick: a free one)")
    parser.add_argument("--quick", action="store_true", help="one restart, --load-s 0.2, a free port")
    args = parser.parse_args()
    if args.quick:
        # Below the ephemeral range (tests/testports.py): free beside other runs, and the
        # server relaunched on it finds it free.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from testports import free_port

        args.port = free_port()
        args.restarts, args.load_s = 1, 0.2

    work = Path(tempfile.mkdtemp(prefix="readiness-bench-"))
    server = ServerSettings(
        model_path="sim/qwen3-8b", port=args.port, expected_load_s=5.0, command="{python} -m ddtree_ops.sim",
        env={"SIM_GPU": "h200", "SIM_LOAD_S": str(args.load_s), "SIM_TIME_SCALE": "0.2"},
    )
    host = Host(
        name="bench",
        connection="local",
        ddtree=DdtreeSettings(python=sys.executable, run_dir=str(work / "run"), server=server),
    )
    log = work / "run" / "server.log"
    state = StateStore(work / "state.json")
    overheads: list[float] = []
    with LocalTransport(host.name) as t:
        for i in range(args.restarts):
            seen: list[float] = []
            halt = threading.Event()
            watcher: list[threading.Thread] = []
            on_phase = start_watcher_on_launch(log, seen, halt, watcher)
            request = RestartRequest(host, RunConfig("AR"), LaunchFacts("0.5.23"),
                                     poll_interval_s=args.poll_interval, stop_grace_s=5.0,
                                     smoke=None)  # the poll's own overhead; smoke_overhead.py times the smoke
            result = lifecycle.restart(t, request, state=state, on_phase=on_phase)
            halt.set()
            for th in watcher:
                th.join(1)
            if not seen:
                print(f"restart {i + 1}: ready line not observed", file=sys.stderr)
                continue
            overhead = result.ready_at - seen[0]
            overheads.append(overhead)
            print(f"restart {i + 1:2d}: launch->ready {result.ready_s:6.2f}s"
                  f"  ready line->our ready {overhead * 1000:7.1f} ms")
        # What one readiness poll costs on its own (agent round trip + HTTP + /proc scan).
        launched = Launched(pid=result.pid, pstart=None, started_at=result.ready_at, log_path=str(log))
        poll_s = []
        for _ in range(20):
            t0 = time.perf_counter()
            ProcessManager(t, host).poll(launched, 0)
            poll_s.append(time.perf_counter() - t0)
        lifecycle.stop(t, host, grace_s=5.0)
    if overheads:
        ms = sorted(o * 1000 for o in overheads)
        print(
            f"\nreadiness overhead over {len(ms)} restarts (poll interval {args.poll_interval}s, local transport): "
            f"median {statistics.median(ms):.0f} ms, mean {statistics.mean(ms):.0f} ms, "
            f"min {ms[0]:.0f} ms, max {ms[-1]:.0f} ms"
        )
        print(f"one poll round trip (20 polls of the ready server): median {statistics.median(poll_s) * 1000:.0f} ms, "
              f"max {max(poll_s) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
