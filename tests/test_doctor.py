"""doctor / probe against the real SSH fleet and local hosts: facts, one round trip, rendering."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest
from cli_json import json_data, read_envelope
from fleetlib import GPU_MODELS, Fleet

from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.probe import probe_host, probe_hosts
from ddtree_ops.transport import RoundTripCounter, open_transport

pytestmark = pytest.mark.fleet


def test_probe_facts_on_every_fleet_host_in_one_round_trip(ssh_fleet: Fleet, clean_home: Path) -> None:
    hosts = list(ssh_fleet.load().hosts.values())
    counters = {h.name: RoundTripCounter() for h in hosts}
    results = probe_hosts(hosts, counters=counters, max_parallel=3)
    for fh in ssh_fleet.hosts:
        facts = results[fh.name]
        assert not isinstance(facts, BaseException)
        assert facts.ok and facts.reachable, facts.error
        assert facts.sglang_version == "0.5.23"
        assert Path(facts.sglang_dir).resolve() == fh.sglang_dir.resolve()
        assert facts.python_executable == str(fh.python)
        assert facts.port == fh.server_port and facts.port_in_use is False
        assert facts.disk_free_bytes and facts.disk_free_bytes > 0
        if fh.gpu is None:
            assert facts.gpus == ()
        else:
            name, driver, mem, cap = GPU_MODELS[fh.gpu]
            assert len(facts.gpus) == 8
            assert facts.gpus[0].name == name and facts.gpus[0].compute_cap == cap
            assert facts.gpus[0].sm == {"12.0": "sm_120", "10.3": "sm_103"}[cap]
        assert counters[fh.name].commands == 1 and counters[fh.name].file_ops == 0, counters[fh.name].log


def test_port_in_use_is_seen(local_host: Host) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        host = replace(local_host, ddtree=replace(local_host.ddtree, server=ServerSettings(port=port)))
        with open_transport(host) as t:
            facts = probe_host(t, host)
    assert facts.ok and facts.port_in_use is True


def test_missing_interpreter_is_a_fact_not_a_crash(local_host: Host, tmp_path: Path) -> None:
    host = replace(local_host, ddtree=DdtreeSettings(python=str(tmp_path / "no" / "python")))
    with open_transport(host) as t:
        facts = probe_host(t, host)
    assert not facts.ok and facts.reachable
    assert "remote interpreter" in facts.error and "not found" in facts.error


def test_host_without_sglang(local_host: Host) -> None:
    import sys

    # This project's venv has no SGLang installed: the probe says so instead of failing.
    with open_transport(local_host) as t:
        facts = probe_host(t, local_host)
    assert facts.ok
    assert facts.python_executable == sys.executable
    assert facts.sglang_version is None and facts.sglang_dir is None


def test_doctor_cli_on_the_fleet(ssh_fleet: Fleet, clean_home: Path, cli) -> None:
    res = cli("-i", str(ssh_fleet.inventory), "--json", "doctor", "all")
    assert res.exit_code == 0, res.stderr
    data = json_data(res.stdout)
    assert data["ok"] is True
    by_host = {row["host"]: row["result"] for row in data["hosts"]}
    assert set(by_host) == set(ssh_fleet.names)
    for fh in ssh_fleet.hosts:
        assert by_host[fh.name]["sglang_version"] == "0.5.23"
        assert Path(by_host[fh.name]["sglang_dir"]).resolve() == fh.sglang_dir.resolve()
    table = cli("-i", str(ssh_fleet.inventory), "doctor", "fleet")
    assert table.exit_code == 0
    assert "RTX PRO 6000 Blackwell" in table.stdout and "sm_103" in table.stdout
    assert "no GPU visible" in table.stdout
    assert table.stdout.count("0.5.23 at") == 3


def test_doctor_one_host_down_others_reported(ssh_fleet: Fleet, clean_home: Path, cli) -> None:
    down = ssh_fleet.hosts[1].name
    ssh_fleet.stop(down)
    try:
        res = cli("-i", str(ssh_fleet.inventory), "--json", "doctor", "all")
    finally:
        ssh_fleet.start(down)
    assert res.exit_code == 3  # the one failed host's own code: connection (README "Exit codes")
    rows = {row["host"]: row for row in json_data(res.stdout)["hosts"]}
    assert rows[down]["ok"] is False and "connection refused" in rows[down]["error"]
    assert rows[down]["result"]["error_type"] == "ConnectError"
    errors = read_envelope(res.stdout)["errors"]  # the failed host, with the probe's error's code
    assert [(e["code"], e["host"]) for e in errors] == [("fleet", None), ("connect", down)]
    assert all(rows[n]["ok"] for n in ssh_fleet.names if n != down)
    assert f"doctor failed on 1 of 3 host(s): {down}" in res.stderr
    assert "Traceback" not in res.stderr


def test_doctor_says_nothing_of_what_it_could_not_probe(ssh_fleet: Fleet, clean_home: Path, cli) -> None:
    down = ssh_fleet.hosts[1].name
    ssh_fleet.stop(down)
    try:
        res = cli("-i", str(ssh_fleet.inventory), "doctor", down)
    finally:
        ssh_fleet.start(down)
    assert res.exit_code == 3
    # An unreachable host has no SGLang, torch or GPU to report: only the error, no made-up facts.
    for fact in ("not installed", "no torch", "no GPU visible", "process manager"):
        assert fact not in res.stdout, res.stdout
    assert "connection refused" in " ".join(res.stdout.split())
