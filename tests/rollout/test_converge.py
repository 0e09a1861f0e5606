"""Re-runs converge, and nothing changes before every target is checked (process-managed
simulator hosts on this machine, the real CLI).

* A rollout run again after a host was stopped, or was restarted on another tree, restarts
  exactly those hosts and leaves the ones already serving the asked-for launch running (the
  same pid): ``unchanged`` is a conclusion from an observation, never a shortcut.
* ``kill -9`` of ddtree-ops in the middle of a ``--serial 1`` rollout, then the same
  command: every host serves the new tree, exit 0.
* A target the rollout would refuse later (a launch that cannot be built) refuses the whole
  rollout before any host changes: no bundle file anywhere, no server launched.
* ``tune --deploy`` with a host the ledger cannot serve is refused before the canary changes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import json_data, read_envelope
from minisglang import expose_toolkit, make_prefix
from report.report_rows import make_row
from testports import free_port

from ddtree_ops.bench.ledger import append_row
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service.manager import ProcessManager
from ddtree_ops.transport.local import LocalTransport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

B300 = "NVIDIA B300 SXM6 AC (simulated)"
NEW = ("--restart", "--budget", "8", "--topk", "2", "--serial", "1")


def _inventory(root: Path, *, drop_draft: str | None = None) -> Path:
    """Two local hosts ``ra``, ``rb`` (group ``rh``), each with its own SGLang prefix and the
    simulator as its server."""
    hosts: dict[str, Any] = {}
    for name in ("ra", "rb"):
        prefix = root / name / "prefix"
        if not prefix.exists():
            make_prefix(prefix)
            expose_toolkit(prefix)
        server: dict[str, Any] = {
            "command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
            "draft_model_path": "sim/qwen3-8b-dflash", "port": free_port(), "expected_load_s": 5,
            "env": {"SIM_LOAD_S": "0.2", "SIM_GPU": "b300", "SIM_TIME_SCALE": "0.1"},
        }
        if name == drop_draft:
            del server["draft_model_path"]
        hosts[name] = {"ddtree": {"python": str(prefix / "bin" / "python"), "run_dir": str(root / name / "run"),
                                  "gpu": "b300", "server": server}}
    inv = root / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"rh": {"vars": {"ansible_connection": "local"},
                                                                 "hosts": hosts}}}}))
    return inv


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    inv = _inventory(tmp_path)
    yield inv
    for host in load_inventory([inv]).hosts.values():
        ProcessManager(LocalTransport(host.name), host).stop(grace_s=5)


def _svc(inv: Path, name: str) -> ProcessManager:
    host = load_inventory([inv]).hosts[name]
    return ProcessManager(LocalTransport(name), host)


def _rows(out: str) -> dict[str, dict[str, Any]]:
    return {r["host"]: r for r in json_data(out)}


def _serving(row: dict[str, Any], tree: str) -> bool:
    servers = row["observed"]["servers"]
    return all(s["ready"] and s["serves"] == tree for s in servers)


def test_a_rerun_restarts_only_what_does_not_serve_the_launch(fleet: Path, cli: Callable[..., Any]) -> None:
    first = cli("-i", str(fleet), "--json", "deploy", "rh", *NEW)
    assert first.exit_code == 0, first.stdout + first.stderr
    pids = {n: _svc(fleet, n).status(lines=0)["record"]["pid"] for n in ("ra", "rb")}
    # ra stopped by hand, rb moved to another tree: the same command must bring both back.
    assert cli("-i", str(fleet), "stop", "ra").exit_code == 0
    moved = cli("-i", str(fleet), "restart", "rb", "--algorithm", "DDTREE", "--budget", "4", "--topk", "2")
    assert moved.exit_code == 0, moved.stdout + moved.stderr
    again = cli("-i", str(fleet), "--json", "deploy", "rh", *NEW, "--canary", "ra")
    assert again.exit_code == 0, again.stdout + again.stderr
    rows = _rows(again.stdout)
    assert [rows[n]["outcome"] for n in ("ra", "rb")] == ["noop", "noop"]  # the files were in place
    assert [rows[n]["result"] for n in ("ra", "rb")] == ["restarted", "restarted"]
    assert all(_serving(rows[n], "DDTREE budget=8 topk=2") for n in ("ra", "rb")), rows
    assert rows["ra"]["rollout"]["gates"]["ra"]["passed"]
    now = {n: _svc(fleet, n).status(lines=0)["record"]["pid"] for n in ("ra", "rb")}
    assert all(now[n] != pids[n] for n in now)
    # Run once more: every host observed serving exactly that launch is left running.
    third = cli("-i", str(fleet), "--json", "deploy", "rh", *NEW)
    assert third.exit_code == 0, third.stdout + third.stderr
    rows = _rows(third.stdout)
    assert [rows[n]["result"] for n in ("ra", "rb")] == ["unchanged", "unchanged"]
    assert {n: _svc(fleet, n).status(lines=0)["record"]["pid"] for n in ("ra", "rb")} == now
    assert all(_serving(rows[n], "DDTREE budget=8 topk=2") for n in ("ra", "rb"))


def _cli_process(inv: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ddtree_ops", "-i", str(inv), *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, COLUMNS="200"))


def test_kill_9_in_the_middle_of_a_serial_rollout_then_the_same_command_converges(
    fleet: Path, cli: Callable[..., Any]
) -> None:
    first = cli("-i", str(fleet), "deploy", "rh", "--restart", "--budget", "4", "--topk", "4")
    assert first.exit_code == 0, first.stdout + first.stderr
    record = Path(load_inventory([fleet]).hosts["ra"].ddtree.run_dir) / "launch.json"
    before = json.loads(record.read_text())["pid"]
    proc = _cli_process(fleet, "deploy", "rh", *NEW)
    try:
        # Killed once ra's new server is launched: its restart lock held, its wait under way,
        # rb not reached. Polls for the event itself (a new launch record), not a time.
        while json.loads(record.read_text())["pid"] == before:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    again = cli("-i", str(fleet), "--json", "deploy", "rh", *NEW)
    assert again.exit_code == 0, again.stdout + again.stderr
    rows = _rows(again.stdout)
    assert all(_serving(rows[n], "DDTREE budget=8 topk=2") for n in ("ra", "rb")), rows
    assert rows["rb"]["result"] == "restarted"


def test_a_target_that_would_be_refused_refuses_the_rollout_before_any_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Callable[..., Any]
) -> None:
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    inv = _inventory(tmp_path, drop_draft="rb")  # rb cannot build a DDTREE launch
    done = cli("-i", str(inv), "--json", "deploy", "rh", "--restart", "--serial", "1")
    assert done.exit_code == 2, done.stdout + done.stderr
    env = read_envelope(done.stdout)
    error = next(e for e in env["errors"] if e["host"] == "rb")
    assert "draft_model_path" in error["message"]
    rows = _rows(done.stdout)
    assert rows["ra"]["outcome"] == "not-reached"
    # ... and true on disk: no bundle file on either host, no server launched.
    for name in ("ra", "rb"):
        observed = rows[name]["observed"]
        assert observed["bundle"]["name"] is None and set(observed["bundle"]["files"]) == {"original"}
        assert not any(s["running"] for s in observed["servers"])
        assert not (tmp_path / name / "run" / "launch.json").exists()


def test_tune_deploy_refuses_a_host_the_ledger_cannot_serve_before_the_canary_changes(
    fleet: Path, cli: Callable[..., Any], tmp_path: Path
) -> None:
    assert cli("-i", str(fleet), "deploy", "rh").exit_code == 0
    ledger = tmp_path / "l.jsonl"
    for (budget, topk), tok_s in {(8, 4): 400.0, (4, 2): 300.0}.items():
        append_row(ledger, make_row(host="ra", gpu_name=B300, budget=budget, topk=topk, output_tok_s=tok_s,
                                    accept_length=2.0))
    done = cli("-i", str(fleet), "--json", "tune", str(ledger), "--deploy", "rh", "--canary", "ra", "--serial", "1")
    assert done.exit_code == 2, done.stdout + done.stderr
    env = read_envelope(done.stdout)
    error = next(e for e in env["errors"] if e["host"] == "rb")
    assert error["code"] == "config" and "not in the ledger" in error["message"]
    rollout = env["data"]["deploy"]["rollout"]
    assert rollout["refused"] == ["rb"] and rollout["not_reached"] == ["ra"] and rollout["gates"] == {}
    # The canary was not touched: no baseline launch, no policy file.
    assert not _svc(fleet, "ra").status(lines=0)["alive"]
    assert not list((tmp_path / "ra" / "prefix").glob("**/placed/*"))
