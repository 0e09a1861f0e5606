"""The restart lock: a provably dead holder is taken over at once, any other holder blocks.

Holders are real processes that take the lock through the real code path (the CLI's
``restart``, or ``manager.restart_lock`` in a child) and are really SIGKILLed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from simhosts import sim_host

from ddtree_ops import lockholder
from ddtree_ops.errors import ServiceError
from ddtree_ops.inventory_types import Host
from ddtree_ops.service import lifecycle, manager
from ddtree_ops.service.agent import base_payload, call_agent
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.lifecycle import LaunchFacts, RestartRequest
from ddtree_ops.state import StateStore
from ddtree_ops.transport.local import LocalTransport

pytestmark = pytest.mark.timeout(180)


def ar(host: Host) -> RestartRequest:
    """An AR restart of ``host`` on SGLang 0.5.23 with fast polls and stops."""
    return RestartRequest(host, RunConfig("AR"), LaunchFacts("0.5.23"), poll_interval_s=0.2, stop_grace_s=5.0)


HOLD_LOCK = """
import sys, time
from pathlib import Path
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service import manager
from ddtree_ops.transport.local import LocalTransport
host = load_inventory([Path(sys.argv[1])]).hosts["sim"]
with LocalTransport(host.name) as t, manager.restart_lock(t, host, ttl_s=600):
    print("locked", flush=True)
    time.sleep(600)
"""


def write_inventory(host: Host, path: Path) -> Path:
    srv = host.ddtree.server
    path.write_text(yaml.safe_dump({"all": {"hosts": {host.name: {"ansible_connection": "local", "ddtree": {
        "python": host.ddtree.python, "run_dir": host.ddtree.run_dir, "gpu": host.ddtree.gpu,
        "server": {"command": srv.command, "model_path": srv.model_path, "draft_model_path": srv.draft_model_path,
                   "port": srv.port, "env": dict(srv.env), "expected_load_s": srv.expected_load_s}}}}}}))
    return path


def lock_path(host: Host) -> Path:
    return Path(host.ddtree.run_dir, "restart.lock")


def wait_for(predicate, what: str, proc: subprocess.Popen | None = None, limit_s: float = 90) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"holder exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def lock_holder(tmp_path: Path) -> Iterator:
    """Starts a child that takes the host's restart lock through ``manager.restart_lock`` and keeps it."""
    procs: list[subprocess.Popen] = []

    def start(host: Host) -> subprocess.Popen:
        inv = write_inventory(host, tmp_path / f"holder{len(procs)}.yaml")
        proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(inv)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "locked", proc.stderr.read()[-2000:] if proc.stderr else line
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def dead_pid() -> int:
    """A pid that surely belonged to a process of ours that has ended and was reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------ holder identity (pure)


def test_identity_names_this_process_and_its_start_time() -> None:
    me = lockholder.holder_record("run-1", "restart")
    assert me["controller"] == socket.gethostname() and me["pid"] == os.getpid()
    assert me["pstart"] == int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    assert me["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert me["pidns"] == os.readlink("/proc/self/ns/pid")
    assert me["run"] == "run-1" and me["command"] == "restart" and me["user"]


def test_live_process_is_alive_only_under_its_own_start_time() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        holder = lockholder.controller_identity() | {
            "pid": sleeper.pid,
            "pstart": lockholder.process_start(sleeper.pid),
        }
        assert not lockholder.holder_is_dead(holder)
        # The same pid with another start time is another process: the pid was reused.
        assert lockholder.holder_is_dead(holder | {"pstart": holder["pstart"] - 1})
        # An older record without a start time: a live pid counts as alive.
        assert not lockholder.holder_is_dead(holder | {"pstart": None})
        sleeper.kill()
        wait_for(lambda: lockholder.process_start(sleeper.pid) is None
                 or Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", "zombie")
        assert lockholder.holder_is_dead(holder)  # killed, not yet reaped
        sleeper.wait()
        assert lockholder.holder_is_dead(holder)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("elsewhere", [
    {"controller": "gpu-ctl-7"},
    {"boot_id": "00000000-0000-0000-0000-000000000000"},
    {"pidns": "pid:[1]"},
    {"pid": None},
])
def test_holder_that_cannot_be_checked_here_is_never_dead(elsewhere: dict) -> None:
    holder = lockholder.controller_identity() | {"pid": dead_pid(), "pstart": None} | elsewhere
    assert not lockholder.holder_is_dead(holder)
    assert lockholder.holder_state(holder) != "still running"


def test_this_process_is_dead_only_once_its_run_ended() -> None:
    me = lockholder.controller_identity()
    with lockholder.active_run("r-live"):
        assert not lockholder.holder_is_dead(me, run_id="r-live")
    assert lockholder.holder_is_dead(me, run_id="r-live")
    assert not lockholder.holder_is_dead(me)  # no run named: cannot tell


# ------------------------------------------------------------------ the restart lock, real holders


def test_restart_sigkilled_while_holding_the_lock_is_taken_over_at_once(tmp_path: Path, make_sim_host) -> None:
    slow = make_sim_host(load_s=600.0)
    inv = write_inventory(slow, tmp_path / "inv.yaml")
    env = dict(os.environ, DDTREE_OPS_STATE=str(tmp_path / "state.json"))
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_ops", "-i", str(inv), "--json", "restart", "sim",
                             "--algorithm", "AR", "--timeout", "300", "--grace", "5"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    launch = Path(slow.ddtree.run_dir, "launch.json")
    try:
        wait_for(lambda: lock_path(slow).exists() and launch.exists(), "the restart to launch", proc)
        held = json.loads(lock_path(slow).read_text())
        assert held["holder"]["pid"] == proc.pid
        assert held["holder"]["pstart"] == lockholder.process_start(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    orphan = json.loads(launch.read_text())["pid"]
    left = json.loads(lock_path(slow).read_text())
    assert left["token"] == held["token"]  # the killed restart never unlocked
    assert left["expires_at"] - time.time() > 300  # waiting for expiry would take minutes

    # Same host and port, a fast-loading server this time.
    fast = sim_host(Path(slow.ddtree.run_dir), name="sim", port=slow.ddtree.server.port, load_s=0.5)
    events = []
    with LocalTransport(fast.name) as t:
        result = lifecycle.restart(t, ar(fast), state=StateStore(tmp_path / "s2.json"), on_phase=events.append)
    taken = [e for e in events if e.phase == "lock_taken_over"]
    assert len(taken) == 1 and f"pid {proc.pid}" in taken[0].note
    assert result.stopped is not None and result.stopped.was_running and result.stopped.pid == orphan
    assert result.pid != orphan
    assert not lock_path(slow).exists()


def test_lock_of_killed_unreaped_holder_is_taken_over(make_sim_host, lock_holder) -> None:
    host = make_sim_host()
    holder = lock_holder(host)
    old = json.loads(lock_path(host).read_text())
    holder.send_signal(signal.SIGKILL)
    wait_for(lambda: Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", "zombie")
    taken: list[manager.LockTakeover] = []
    with LocalTransport(host.name) as t, manager.restart_lock(t, host, ttl_s=60, on_takeover=taken.append):
        now = json.loads(lock_path(host).read_text())
        assert now["token"] != old["token"] and now["holder"]["pid"] == os.getpid()
    assert [tk.holder for tk in taken] == [lockholder.describe_holder(old["holder"])]
    assert taken[0].age_s is not None and taken[0].age_s >= 0
    assert not lock_path(host).exists()


def test_live_holder_blocks_and_is_named(make_sim_host, lock_holder) -> None:
    host = make_sim_host()
    holder = lock_holder(host)
    before = lock_path(host).read_text()
    with LocalTransport(host.name) as t, pytest.raises(ServiceError) as err:
        lifecycle.restart(t, ar(host), state=StateStore())
    msg = str(err.value)
    assert re.search(
        rf"another restart is in progress on this host: lock held by \S+@{re.escape(socket.gethostname())} "
        rf"pid {holder.pid} \(restart\) for \d+s, still running; it expires in \d+m\d\ds$",
        msg,
    ), msg
    assert lock_path(host).read_text() == before
    assert not Path(host.ddtree.run_dir, "launch.json").exists()  # refused before stopping or launching anything


@pytest.mark.parametrize(
    "elsewhere", [{"controller": "gpu-ctl-7"}, {"boot_id": "00000000-0000-0000-0000-000000000000"}]
)
def test_holder_recorded_elsewhere_blocks_until_expiry(make_sim_host, elsewhere: dict) -> None:
    host = make_sim_host()
    lock = lock_path(host)
    lock.parent.mkdir(parents=True, exist_ok=True)
    # Its pid is dead here; only the recorded machine keeps us from taking it over.
    holder = lockholder.holder_record("t-else", "restart") | {"pid": dead_pid(), "pstart": None} | elsewhere
    now = time.time()
    taken_at = now - 125
    lock.write_text(json.dumps({"token": "t-else", "holder": holder, "taken_at": taken_at, "expires_at": now + 600}))
    before = time.time()
    with LocalTransport(host.name) as t, pytest.raises(ServiceError) as err:
        lifecycle.restart(t, ar(host), state=StateStore())
    after = time.time()
    msg = str(err.value)
    # The age the host saw when it refused, to the second: whatever it was between the
    # call's start and end (a busy machine takes seconds to get there), as minutes and seconds.
    ages = [f"{s // 60}m{s % 60:02d}s" for s in range(int(before - taken_at), int(after - taken_at) + 1)]
    assert any(f"@{holder['controller']} pid {holder['pid']} (restart) for {age}, " in msg for age in ages), (ages, msg)
    assert "cannot be checked from here" in msg and f"or delete {lock}" in msg
    assert json.loads(lock.read_text())["token"] == "t-else"


def test_concurrent_takeovers_of_one_dead_lock_leave_one_winner(make_sim_host) -> None:
    host = make_sim_host()
    lock = lock_path(host)
    lock.parent.mkdir(parents=True, exist_ok=True)
    dead = lockholder.holder_record("t-dead", "restart") | {"pid": dead_pid(), "pstart": None}
    lock.write_text(
        json.dumps({"token": "t-dead", "holder": dead, "taken_at": time.time(), "expires_at": time.time() + 600})
    )
    answers: list[dict] = []
    go = threading.Barrier(4)

    def take(i: int) -> None:
        payload = base_payload(host) | {"token": f"t{i}", "holder": {}, "ttl_s": 60, "take_over": "t-dead"}
        go.wait()
        answers.append(call_agent(LocalTransport(host.name), host, "lock", payload))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    winners = [a for a in answers if a.get("ok")]
    assert len(answers) == 4 and len(winners) == 1
    assert json.loads(lock.read_text())["token"] in {f"t{i}" for i in range(4)}
    assert all(a["held"]["token"] == json.loads(lock.read_text())["token"] for a in answers if not a.get("ok"))
