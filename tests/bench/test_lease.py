"""The sweep lease: a sweep holds each of its hosts from its first restart to its end.

Real processes on one simulator host: two ``bench`` runs, a ``restart`` and a ``stop``
from the command line, and lease records whose holder really is dead or really runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_json import json_data, read_envelope

from ddtree_ops import lockholder
from ddtree_ops.bench import ledger
from ddtree_ops.errors import LeaseHeld
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service import lifecycle, manager
from ddtree_ops.transport.local import LocalTransport

from .test_cli_bench import cli, free_port, write_inventory

pytestmark = pytest.mark.timeout(300)


def write_sweep(tmp_path: Path, name: str, *, repeats: int = 1, max_new_tokens: int = 48) -> Path:
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "general kenobi"}\n')
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "targets": ["local"], "repeats": repeats,
        "grid": {"algorithm": ["autoregressive"], "temperature": [0.0, 0.6], "concurrency": [1, 2]},
        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 4, "max_new_tokens": max_new_tokens},
        "warmup": 0}))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def lease_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / manager.LEASE_FILE


def write_lease(tmp_path: Path, holder: dict) -> None:
    lease_path(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    lease_path(tmp_path).write_text(json.dumps({"token": holder["run"], "holder": holder, "taken_at": time.time() - 5}))


def stop_server(inv: Path) -> None:
    host = load_inventory([inv]).hosts["sim-x"]
    with LocalTransport(host.name) as t:
        lifecycle.stop(t, host, grace_s=2.0, lease=manager.LeasePass(force=True))


def test_second_sweep_and_a_restart_are_refused_while_the_first_completes_untouched(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    # (Long enough to outlast the refusals no more: it is held while they run, below.)
    first_sweep = write_sweep(tmp_path, "first", repeats=3)
    second_sweep = write_sweep(tmp_path, "second")
    first_out, second_out = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first = subprocess.Popen(
        [sys.executable, "-m", "ddtree_ops", "--json", "-i", str(inv), "bench", "--sweep", str(first_sweep),
         "--out", str(first_out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while first.poll() is None and time.monotonic() < deadline and not lease_path(tmp_path).exists():
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[1][-2000:]
        holder = json.loads(lease_path(tmp_path).read_text())["holder"]
        assert holder["pid"] == first.pid and holder["sweep"] == "first"
        who = f"sweep first (run {holder['run_id']}): {lockholder.describe_holder(holder)} for "

        # The first sweep is held (SIGSTOP) while the others try, so that it cannot end
        # meanwhile however slowly a busy machine runs them: an answer from each proves it did
        # not wait for the first sweep to end (one that waited would never answer).
        os.kill(first.pid, signal.SIGSTOP)
        try:
            second = cli("--json", "-i", str(inv), "bench", "--sweep", str(second_sweep), "--out",
                         str(second_out), cwd=tmp_path)
            restart = cli("--json", "-i", str(inv), "restart", "sim-x", "--algorithm", "AR", "--timeout", "60",
                          cwd=tmp_path)
            stop = cli("--json", "-i", str(inv), "stop", "sim-x", cwd=tmp_path)
            # Refused at once: the first sweep is still measuring when all three have answered.
            assert first.poll() is None, "the refusals waited for the first sweep to end"
        finally:
            os.kill(first.pid, signal.SIGCONT)

        # The lease's own code (a held host, not a failed measurement), and what a sweep can do:
        # it has no --force, its rows wait for --resume.
        assert second.returncode == 5, second.stderr
        summary = json_data(second.stdout)
        assert [(h["ok_rows"], h["restarts"]) for h in summary["hosts"]] == [(0, 0)]
        assert who in summary["hosts"][0]["error"] and "still running" in summary["hosts"][0]["error"]
        [bench_error] = read_envelope(second.stdout)["errors"][1:]
        assert bench_error["code"] == "lease_held" and who in bench_error["message"]
        assert "`bench --resume` runs them once that sweep has ended" in bench_error["message"]
        assert "--force" not in bench_error["message"]
        assert {r["status"] for r in ledger.read_ledger(second_out).rows} == {"failed"}
        for done in (restart, stop):
            assert done.returncode == 5, done.stderr
            [host_error] = read_envelope(done.stdout)["errors"][1:]
            assert host_error["code"] == "lease_held" and host_error["host"] == "sim-x"
            assert who in host_error["message"] and "--force overrides it" in host_error["message"]

        out, err = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
        stop_server(inv)
    assert first.returncode == 0, err[-2000:]
    hosts = json_data(out)["hosts"]
    assert [(h["ok_rows"], h["failed_rows"], h["restarts"]) for h in hosts] == [(12, 0, 1)]
    rows = ledger.read_ledger(first_out).rows
    assert len(rows) == 12 and {r["status"] for r in rows} == {"ok"}
    assert not lease_path(tmp_path).exists()  # released at the sweep's end


def test_lease_of_a_dead_holder_is_taken_over_and_released(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    sweep = write_sweep(tmp_path, "after")
    dead = lockholder.holder_record("t-dead", "bench") | {"pid": dead_pid(), "sweep": "killed", "run_id": "r0"}
    write_lease(tmp_path, dead)
    try:
        done = cli("--json", "-i", str(inv), "bench", "--sweep", str(sweep), "--out", str(tmp_path / "l.jsonl"),
                   cwd=tmp_path)
    finally:
        stop_server(inv)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {r["status"] for r in ledger.read_ledger(tmp_path / "l.jsonl").rows} == {"ok"}
    assert not lease_path(tmp_path).exists()


def test_stop_clears_a_dead_holders_lease_and_is_refused_by_a_live_one(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    host = load_inventory([inv]).hosts["sim-x"]
    write_lease(tmp_path, lockholder.holder_record("t-dead", "bench") | {"pid": dead_pid(), "sweep": "s"})
    with LocalTransport(host.name) as t:
        assert not lifecycle.stop(t, host, grace_s=1.0).was_running
        assert not lease_path(tmp_path).exists()
        with lockholder.active_run("t-live"):  # this very process, its run still going
            write_lease(tmp_path, lockholder.holder_record("t-live", "bench") | {"sweep": "s", "run_id": "r1"})
            with pytest.raises(LeaseHeld, match=r"held by sweep s \(run r1\): .* for \ds, still running"):
                lifecycle.stop(t, host, grace_s=1.0)
            assert lifecycle.stop(t, host, grace_s=1.0, lease=manager.LeasePass(token="t-live")).pid is None
    assert lease_path(tmp_path).exists()


def test_force_overrides_a_live_lease_with_a_warning(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, free_port())
    # The holder is this test's process: alive, so the CLI's process cannot take it over.
    with lockholder.active_run("t-live"):
        write_lease(tmp_path, lockholder.holder_record("t-live", "bench") | {"sweep": "s", "run_id": "r1"})
        done = cli("-i", str(inv), "stop", "sim-x", "--force", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--force overrides the lease of sweep s (run r1)" in done.stderr and f"pid {os.getpid()}" in done.stderr
    assert lease_path(tmp_path).exists()  # the sweep still holds the host
