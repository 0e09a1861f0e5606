"""Rolling changes on three hosts run by a real systemd (tests/systemdhost.py).

* ``deploy --restart --canary sd-0 --serial 1`` with a good canary: the rollout finishes,
  a probe on every host twice a second sees at least two of the three serving at every
  sample, and the batches ran in the order asked; ``rollback --restart --serial 2`` puts
  every unit back on its own ExecStart, two hosts a batch;
* the same with a canary whose patched server misbehaves (the simulator's DDTree fault
  switches, in sd-0's env only): the rollout stops at the canary, which is back on its
  previous patch and launch configuration, serving the same greedy tokens as before; the
  other hosts untouched. One test per fault;
* ``--rollback-on-failure``: a host that does not become ready is put back and the rollout
  goes on within ``--max-fail``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import json_data, read_envelope
from systemdhost import SERVER_PORT, UNIT, SystemdFleet, SystemdHost, cmdline, main_pid, reset, systemd_inventory

from ddtree_ops.inventory import load_inventory
from ddtree_ops.rollout.executor import ask
from ddtree_ops.rollout.gate import GateSpec
from ddtree_ops.transport import open_transport

pytestmark = [pytest.mark.fleet, pytest.mark.slow, pytest.mark.timeout(900)]

DROPIN = f"/etc/systemd/system/{UNIT}.d/50-ddtree-ops.conf"
TREE = ("--budget", "4", "--topk", "4")


@pytest.fixture
def trio(systemd_trio: SystemdFleet, sd_env: Path, cli: Callable[..., Any]) -> Iterator[SystemdFleet]:
    """Every host as its operator left it: the unit on its own ExecStart (AR), no patch."""
    done = cli("-i", str(systemd_trio.inventory), "rollback", "all")
    assert done.exit_code == 0, done.stdout + done.stderr
    # The three at once: each waits for its own unit's load, not for the others'.
    with ThreadPoolExecutor(max_workers=len(systemd_trio.hosts)) as pool:
        list(pool.map(reset, systemd_trio.hosts))
    yield systemd_trio


def _deploy(fleet: SystemdFleet, cli: Callable[..., Any]) -> None:
    """The DDTree bundle on every host (no restart): a DDTREE launch needs it."""
    done = cli("-i", str(fleet.inventory), "deploy", "all")
    assert done.exit_code == 0, done.stdout + done.stderr


def _inventory(fleet: SystemdFleet, path: Path, env: dict[str, dict[str, str]]) -> Path:
    """The fleet's inventory with ``env`` per host (the canary's fault switch)."""
    doc = systemd_inventory(fleet)
    hosts = doc["all"]["children"]["systemd_hosts"]["hosts"]  # type: ignore[index]
    for name, values in env.items():
        hosts[name]["ddtree"]["server"] = {"env": values}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


_PROBE = r"""
import http.client, sys, time
port, until = int(sys.argv[1]), float(sys.argv[2])
while time.time() < until:
    started = time.time()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
        conn.request("GET", "/health_generate")
        ok = conn.getresponse().status == 200
        conn.close()
    except Exception:
        ok = False
    print("%.3f %d" % (time.time(), ok), flush=True)
    time.sleep(max(0.0, 0.5 - (time.time() - started)))
"""


class ServingProbe:
    """Queries every host's server twice a second from inside its network namespace (the
    servers bind the hosts' loopback), and answers how many served at each sample. A host
    whose server is down refuses at once (or answers 503): the long timeout is only for a
    serving host that a busy machine makes slow to answer, which serves all the same."""

    def __init__(self, hosts: list[SystemdHost], seconds: float) -> None:
        until = time.time() + seconds
        self.procs = {h.name: subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{h.netns}", "--", sys.executable, "-c", _PROBE, str(SERVER_PORT),
             f"{until:.3f}"], stdout=subprocess.PIPE, text=True) for h in hosts}
        self.answers: dict[str, list[tuple[float, bool]]] = {name: [] for name in self.procs}
        self.threads = [threading.Thread(target=self._read, args=(name,), daemon=True) for name in self.procs]
        for t in self.threads:
            t.start()

    def _read(self, name: str) -> None:
        stdout = self.procs[name].stdout
        assert stdout is not None
        for line in stdout:
            at, ok = line.split()
            self.answers[name].append((float(at), ok == "1"))

    def wait_all_serving(self, timeout_s: float = 30.0) -> None:
        """Until every host's probe has seen its server answer (the probes start cold)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if all(answers and answers[-1][1] for answers in self.answers.values()):
                return
            time.sleep(0.1)
        raise AssertionError(f"not every host serves before the rollout: {self.answers}")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
            proc.wait(timeout=10)
        for t in self.threads:
            t.join(timeout=10)

    def serving_at(self, name: str, at: float) -> bool:
        """The host's state at ``at``: its last answer by then."""
        before = [ok for t, ok in self.answers[name] if t <= at]
        return bool(before) and before[-1]

    def samples(self, start: float, end: float) -> list[tuple[float, int]]:
        """(time, hosts serving) every half second over [start, end]."""
        out = []
        at = start
        while at <= end:
            out.append((at, sum(self.serving_at(name, at) for name in self.answers)))
            at += 0.5
        return out


def _greedy(inventory: Path, name: str) -> list[tuple[int, ...] | None]:
    """The canary's greedy answers to the gate's prompts, asked as the gate asks them."""
    host = load_inventory([inventory]).hosts[name]
    with open_transport(host) as t:
        return [a.tokens for a in ask(t, host, GateSpec(), 0.0)]


def _state(cli: Callable[..., Any], inventory: Path, host: SystemdHost) -> tuple[int, list[str], str | None, bool]:
    """What runs on a host: main pid, its argv, the applied bundle, our drop-in there."""
    status = json_data(cli("-i", str(inventory), "--json", "status", host.name).stdout)[0]
    pid = main_pid(host)
    return pid, cmdline(host, pid), status["bundle"], host.run("test", "-e", DROPIN, check=False).returncode == 0


# Two of the simulator's faults, a wrong token and a crash, as the rollout meets them on a
# unit; accept_collapse is judged by the same gate on a process host
# (tests/patching/test_tune_canary.py), and every fault's verdict by benchmarks/gate_faults.py.
@pytest.mark.parametrize(("fault", "reason"), [
    ("wrong_greedy", "greedy agreement 0.0"),
    ("crash_sampled", "request(s) failed"),
])
def test_a_misbehaving_canary_stops_the_rollout_and_is_put_back(
    trio: SystemdFleet, cli: Callable[..., Any], sd_env: Path, fault: str, reason: str
) -> None:
    inv = _inventory(trio, sd_env / "inv.yaml", {"sd-0": {"SIM_DDTREE_FAULT": fault}})
    canary, *others = trio.hosts
    before = {h.name: _state(cli, inv, h) for h in trio.hosts}
    tokens = _greedy(inv, "sd-0")
    assert all(t for t in tokens), tokens
    done = cli("-i", str(inv), "--json", "deploy", "all", "--restart", *TREE, "--canary", "sd-0")
    assert done.exit_code == 4, done.stdout + done.stderr
    env = read_envelope(done.stdout)
    error = next(e for e in env["errors"] if e["host"] == "sd-0")
    assert error["code"] == "canary_rejected" and reason in error["message"], error
    assert "patch rolled back to the originals" in error["message"]
    assert "sd-0 relaunched the previous server (the unit's own ExecStart" in error["message"]
    rows = {r["host"]: r for r in env["data"]}
    gate = rows["sd-0"]["rollout"]["gates"]["sd-0"]
    assert not gate["passed"] and gate["requests"] == 12
    assert [rows[h.name]["outcome"] for h in others] == ["not-reached", "not-reached"]
    assert "deploy failed on 1 of 3 host(s): sd-0; not reached: sd-1, sd-2" == env["errors"][0]["message"]
    # The canary: its previous patch (none), launch (the unit's own) and the same greedy tokens.
    pid, argv, bundle, dropin = _state(cli, inv, canary)
    assert (argv, bundle, dropin) == before["sd-0"][1:] and bundle is None and not dropin
    assert _greedy(inv, "sd-0") == tokens
    # The rest: untouched, the same processes.
    assert [_state(cli, inv, h) for h in others] == [before[h.name] for h in others]


def test_a_good_canary_lets_a_serial_rollout_finish_with_two_of_three_always_serving(
    trio: SystemdFleet, cli: Callable[..., Any], sd_env: Path
) -> None:
    probe = ServingProbe(trio.hosts, seconds=240)
    try:
        probe.wait_all_serving()
        start = time.time()
        done = cli("-i", str(trio.inventory), "--json", "deploy", "all", "--restart", *TREE, "--canary", "sd-0",
                   "--serial", "1")
        end = time.time()
    finally:
        probe.stop()
    assert done.exit_code == 0, done.stdout + done.stderr
    rows = {r["host"]: r for r in json_data(done.stdout)}
    assert [rows[h]["outcome"] for h in ("sd-0", "sd-1", "sd-2")] == ["applied"] * 3
    gate = rows["sd-0"]["rollout"]["gates"]["sd-0"]
    assert gate["passed"] and gate["agreement"] == 1.0 and gate["failed_requests"] == 0
    assert gate["accept_length"]["0"] > 1.3 and gate["accept_length"]["0.7"] > 1.3
    assert [rows[h]["rollout"]["batch"] for h in ("sd-0", "sd-1", "sd-2")] == [1, 2, 3]
    # Capacity while the group rolls: at every sample two of the three served, and some
    # sample saw a host down (the restarts really happened, one at a time).
    samples = probe.samples(start, end)
    assert len(samples) >= 10, samples  # the rollout was watched, not a blink
    assert min(n for _, n in samples) >= 2, [s for s in samples if s[1] < 2]
    assert any(n == 2 for _, n in samples), samples
    # The batches ran in the order asked: each unit's new main process started after the
    # one before it (one kernel, one monotonic clock for all three hosts).
    starts = [int(h.systemctl_show(UNIT, "ExecMainStartTimestampMonotonic")["ExecMainStartTimestampMonotonic"])
              for h in trio.hosts]
    assert starts == sorted(starts), starts
    for host in trio.hosts:
        assert "DDTREE" in cmdline(host, main_pid(host))
        assert host.run("test", "-e", DROPIN, check=False).returncode == 0
    # ... and rolls back the same way, two hosts a batch, as the terminal says; each host on
    # its unit's own ExecStart.
    back = cli("-i", str(trio.inventory), "rollback", "all", "--restart", "--serial", "2")
    assert back.exit_code == 0, back.stdout + back.stderr
    assert "batch 1: sd-0, sd-1 — done" in back.stdout and "batch 2: sd-2 — done" in back.stdout, back.stdout
    for host in trio.hosts:
        assert "DDTREE" not in cmdline(host, main_pid(host))
        assert host.run("test", "-e", DROPIN, check=False).returncode == 1
        # What ddtree-ops made is gone with its files: the drop-in directory and /etc/ddtree-ops.
        for made in (f"/etc/systemd/system/{UNIT}.d", "/etc/ddtree-ops"):
            assert host.run("test", "-e", made, check=False).returncode == 1, (host.name, made)


def test_rollback_on_failure_puts_a_host_back_and_the_rollout_goes_on_within_max_fail(
    trio: SystemdFleet, cli: Callable[..., Any], sd_env: Path
) -> None:
    # sd-1's launch is refused by SGLang's own parser (a flag it does not know): it dies while
    # loading, on any machine at any speed, so no deadline decides which host fails (a stall
    # under --timeout N did: on a busy machine a healthy host missed it too). The default
    # load-aware deadlines leave the healthy hosts minutes.
    inv = _with_server(trio, sd_env / "inv.yaml", {"sd-1": {"extra_args": ["--no-such-flag"]}})
    _deploy(trio, cli)
    before = {h.name: _state(cli, inv, h) for h in trio.hosts}
    done = cli("-i", str(inv), "--json", "restart", "all", "--algorithm", "DDTREE", *TREE, "--serial", "1",
               "--rollback-on-failure", "--max-fail", "1")
    assert done.exit_code == 5, done.stdout + done.stderr
    env = read_envelope(done.stdout)
    error = next(e for e in env["errors"] if e["host"] == "sd-1")
    assert error["code"] == "server_crashed" and "--no-such-flag" in error["message"]
    assert "rolled back: sd-1 relaunched the previous server" in error["message"]
    assert env["data"]["rollout"]["batches"] == [["sd-0"], ["sd-1"], ["sd-2"]]
    assert env["data"]["rollout"]["rolled_back"] == ["sd-1"] and env["data"]["rollout"]["not_reached"] == []
    assert _state(cli, inv, trio["sd-1"])[1:] == before["sd-1"][1:]
    assert all("DDTREE" in cmdline(h, main_pid(h)) for h in (trio["sd-0"], trio["sd-2"]))


# -- issue 53: what a rollout reports is what the hosts do -----------------------------------


def _with_server(fleet: SystemdFleet, path: Path, server: dict[str, dict[str, Any]]) -> Path:
    """The fleet's inventory with ``server`` settings per host (merged key by key)."""
    doc = systemd_inventory(fleet)
    hosts = doc["all"]["children"]["systemd_hosts"]["hosts"]  # type: ignore[index]
    for name, values in server.items():
        hosts[name]["ddtree"]["server"] = values
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _serves(row: dict[str, Any], tree: str) -> bool:
    return all(s["ready"] and s["serves"] == tree and s["unit"]["active"] == "active"
               for s in row["observed"]["servers"])


def test_the_same_rollout_run_again_after_a_failed_host_converges_it(
    trio: SystemdFleet, cli: Callable[..., Any], sd_env: Path
) -> None:
    # sd-1's launch is refused by SGLang's parser (a flag it does not know): it fails while
    # loading, its unit is left stopped, and the rollout stops before sd-2.
    bad = _with_server(trio, sd_env / "bad.yaml", {"sd-1": {"extra_args": ["--no-such-flag"]}})
    failed = cli("-i", str(bad), "--json", "deploy", "all", "--restart", *TREE, "--serial", "1")
    assert failed.exit_code == 5, failed.stdout + failed.stderr
    rows = {r["host"]: r for r in json_data(failed.stdout)}
    assert rows["sd-2"]["outcome"] == "not-reached"
    assert rows["sd-1"]["observed"]["servers"][0]["running"] is False
    sd0_pid = main_pid(trio["sd-0"])
    # The operator fixes the inventory and runs the same command again.
    again = cli("-i", str(trio.inventory), "--json", "deploy", "all", "--restart", *TREE, "--serial", "1")
    assert again.exit_code == 0, again.stdout + again.stderr
    rows = {r["host"]: r for r in json_data(again.stdout)}
    assert [rows[h]["result"] for h in ("sd-0", "sd-1", "sd-2")] == ["unchanged", "restarted", "applied"]
    assert all(_serves(rows[h], "DDTREE budget=4 topk=4") for h in ("sd-0", "sd-1", "sd-2")), rows
    assert main_pid(trio["sd-0"]) == sd0_pid
    for host in trio.hosts:
        assert host.systemctl_show(UNIT, "ActiveState")["ActiveState"] == "active"
        assert "DDTREE" in cmdline(host, main_pid(host))


def test_kill_9_of_a_serial_rollout_then_the_same_command_converges_every_host(
    trio: SystemdFleet, cli: Callable[..., Any], sd_env: Path
) -> None:
    _deploy(trio, cli)
    target = trio["sd-1"]
    before = main_pid(target)
    args = ("deploy", "all", "--restart", *TREE, "--serial", "1")
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_ops", "-i", str(trio.inventory), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Killed once sd-1's restart has begun (its old main process gone): sd-0 done, sd-2 not
        # reached. Polls for that event, not a time.
        while main_pid(target) == before:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.communicate()
    again = cli("-i", str(trio.inventory), "--json", *args)
    assert again.exit_code == 0, again.stdout + again.stderr
    rows = {r["host"]: r for r in json_data(again.stdout)}
    assert all(_serves(rows[h], "DDTREE budget=4 topk=4") for h in ("sd-0", "sd-1", "sd-2")), rows
    assert rows["sd-2"]["result"] == "restarted"


def test_an_unknown_unit_refuses_the_rollout_before_any_file_is_placed(
    trio: SystemdFleet, cli: Callable[..., Any], sd_env: Path
) -> None:
    inv = _with_server(trio, sd_env / "inv.yaml", {"sd-2": {"unit": "nosuch.service"}})
    done = cli("-i", str(inv), "--json", "deploy", "all", "--restart", *TREE, "--serial", "1")
    assert done.exit_code == 5, done.stdout + done.stderr
    env = read_envelope(done.stdout)
    error = next(e for e in env["errors"] if e["host"] == "sd-2")
    assert error["code"] == "unit_refused" and "nothing changed" in error["message"]
    # True on disk: no bundle file on any host, each unit on its own ExecStart, untouched.
    for host in trio.hosts:
        status = json_data(cli("-i", str(inv), "--json", "status", host.name).stdout)[0]
        assert status["bundle"] is None and {f["state"] for f in status["files"]} == {"original"}
        assert host.run("test", "-e", DROPIN, check=False).returncode == 1
