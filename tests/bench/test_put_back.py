"""A sweep borrows its hosts and gives them back as it found them (issue 53, item 4).

``bench``, ``restart``, ``stop`` and ``service-status`` through the real CLI (in this
process, but the ``bench`` that is killed) on one simulated host: what served before the
sweep is relaunched at its end (a new process of the same launch, ready); after a ``kill -9``
of ``bench`` mid-sweep the next sweep takes its lease over with what served before it, and
``--leave-stopped`` leaves that stopped; the host's launch record keeps the operator's launch
throughout, so a bare ``restart`` repeats that, not the sweep's last launch. (A host that ran
nothing before is left with nothing running: tests/bench/test_slots_sweep.py; after Ctrl-C:
test_cli_bench.py; under systemd: tests/systemd/test_systemd_host.py.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_json import json_data

from ddtree_ops.bench.lifetime import before_of, note_of
from ddtree_ops.service.lifecycle import PreviousServer

from .test_cli_bench import free_port, write_inventory, write_sweep

pytestmark = pytest.mark.timeout(300)

# The operator's launch, and what a bare `restart` repeats. A fast simulator: its CUDA-graph
# captures take 0.2 s instead of 1 s each.
DDTREE16 = ("--algorithm", "DDTREE", "--budget", "16", "--topk", "4")
FAST = {"SIM_TIME_SCALE": "0.1"}


@dataclass(frozen=True)
class Host:
    """The simulated host ``sim-x`` of ``inv`` (run dir ``tmp_path/run``), driven through ``cli``."""

    cli: Callable[..., Any]
    inv: Path
    tmp_path: Path

    def run(self, *args: str) -> Any:
        done = self.cli("--json", "-i", str(self.inv), *args)
        assert done.exit_code == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return json_data(done.stdout)

    def restart(self, *args: str) -> dict[str, Any]:
        result: dict[str, Any] = self.run("restart", "sim-x", *args)["hosts"][0]["result"]
        return result

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.run("service-status", "sim-x")["hosts"][0]["result"]
        return result

    def bench(self, sweep: Path, *args: str, out: str = "l.jsonl") -> dict[str, Any]:
        [host] = self.run("bench", "--sweep", str(sweep), "--out", str(self.tmp_path / out), *args)["hosts"]
        return dict(host)

    def record(self, name: str = "launch.json") -> dict[str, Any]:
        record: dict[str, Any] = json.loads((self.tmp_path / "run" / name).read_text())
        return record


def test_a_sweep_puts_back_what_served_and_the_record_stays_the_operators_even_after_a_kill_9(
    tmp_path: Path, cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    host = Host(cli, write_inventory(tmp_path, free_port(), **FAST), tmp_path)
    try:
        _put_back_and_kill_9(host)
    finally:
        cli("-i", str(host.inv), "stop", "all")


def _put_back_and_kill_9(host: Host) -> None:
    tmp_path = host.tmp_path
    sweep = write_sweep(tmp_path, grid={"algorithm": ["autoregressive"], "concurrency": [1]})
    before = host.restart(*DDTREE16)
    assert before["run"] == "DDTREE budget=16 topk=4"

    # The dry run says what the end will put back, from what serves now (nothing changes).
    [planned] = host.run("bench", "--sweep", str(sweep), "--dry-run")["put_back"]["sim-x"]
    assert (planned["action"], planned["before"]) == ("relaunch", f"DDTREE budget=16 topk=4, running (pid "
                                                                   f"{before['pid']})")
    conflict = host.cli("-i", str(host.inv), "bench", "--sweep", str(sweep), "--keep-server", "--leave-stopped")
    assert conflict.exit_code == 2 and "give one" in conflict.stderr and "Traceback" not in conflict.stderr

    # 1. Put back: a new process of the same launch, ready (observed after the put-back, and
    # by service-status), recorded as the host's launch again; the sweep's left no record.
    [put] = host.bench(sweep)["put_back"]
    assert put["action"] == "relaunched" and put["running"] and put["ready"] and put["pid"] != before["pid"], put
    now = host.status()
    assert (now["running"], now["pid"], now["run"], now["health"]) == (True, put["pid"], "DDTREE budget=16 topk=4",
                                                                        200)
    record = host.record()
    assert record["argv"] == before["argv"] and record["pid"] == put["pid"]
    assert not (tmp_path / "run" / "sweep-launch.json").exists()

    # 2. A kill -9 mid-sweep: the sweep's server still runs, and service-status says so (its
    # pid); the record stays the operator's launch.
    out = tmp_path / "killed.jsonl"
    six = write_sweep(tmp_path)  # six rows: the first written, the others still to measure
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops", "-i", str(host.inv), "bench", "--sweep", str(six), "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and not (out.exists() and out.read_bytes()):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    swept = host.record("sweep-launch.json")["pid"]
    now = host.status()
    assert (now["running"], now["pid"], now["health"]) == (True, swept, 200) and host.record() == record

    # 3. The resumed sweep takes the dead one's lease over, and with it what served before that
    # sweep (the put-back server's pid, not the killed sweep's one that runs now). With
    # --leave-stopped it stops the sweep's server and puts nothing back: nothing runs, and the
    # record is the operator's launch as it was.
    resumed = host.bench(six, "--resume", "--leave-stopped", out=out.name)
    [put] = resumed["put_back"]
    assert (put["action"], put["before"], put["running"]) == (
        "left-stopped", f"DDTREE budget=16 topk=4, running (pid {record['pid']})", False), put
    assert resumed["ok_rows"] >= 1 and resumed["skipped"] >= 1 and host.record() == record
    assert not (tmp_path / "run" / "sweep-launch.json").exists() and not host.status()["running"]
    # A bare restart repeats the operator's launch, not the sweeps' AR.
    assert host.restart()["argv"] == before["argv"]


def test_a_lease_note_round_trips_and_garbage_is_no_server_to_put_back() -> None:
    before = PreviousServer(host="h/1", running=True, pid=812, argv=("python", "-m", "sglang.launch_server"),
                            launch_command="--port 1", cuda_graph=False, run="DDTREE budget=16 topk=4")
    assert before_of(json.loads(json.dumps(note_of(before)))) == before
    for note in (None, "x", {"before": []}, {"before": {"host": "h", "argv": "rm -rf /"}},
                 {"before": {"host": "h", "pid": True}}, {"before": {"host": "h", "run": 3}}):
        assert before_of(note) is None, note
