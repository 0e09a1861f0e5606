"""On-host load generation end to end: a sweep whose client runs on the host, over the
local transport and over real SSH, against the simulator bound to loopback."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ddtree_ops.bench.lifetime import SweepOptions
from ddtree_ops.bench.onhost import client_mode
from ddtree_ops.bench.prepare import prepare_sweep
from ddtree_ops.bench.prompts import build_workload
from ddtree_ops.bench.runner import Progress, SweepRunner
from ddtree_ops.bench.services import default_services
from ddtree_ops.inventory_types import Host

from .test_runner import local_host, rows_of, sim_server, stop_all, sweep

GRID = {"algorithm": ["ddtree"], "budget": [4], "topk": [2], "temperature": [0.0], "concurrency": [2]}


def with_bind(host: Host, bind_host: str) -> Host:
    server = dataclasses.replace(host.ddtree.server, bind_host=bind_host)
    return dataclasses.replace(host, ddtree=dataclasses.replace(host.ddtree, server=server))


def test_default_is_host_for_a_loopback_server_and_the_sweep_can_override() -> None:
    h = Host(name="h")
    assert client_mode(h, None) == "host"  # the default bind is 127.0.0.1
    assert client_mode(with_bind(h, "::1"), None) == "host"
    assert client_mode(with_bind(h, "localhost"), None) == "host"
    assert client_mode(with_bind(h, "0.0.0.0"), None) == "local"
    assert client_mode(with_bind(h, "10.0.0.5"), None) == "local"
    assert client_mode(h, "local") == "local" and client_mode(with_bind(h, "0.0.0.0"), "host") == "host"


def test_sweep_with_client_host_writes_ok_rows_measured_on_the_host(tmp_path: Path) -> None:
    host = local_host(tmp_path, "sim-h")
    spec = sweep(tmp_path, baselines=[], grid=GRID, client="host")
    out = tmp_path / "ledger.jsonl"
    events: list[Progress] = []
    try:
        outcome = SweepRunner(prepare_sweep(spec, [host]), build_workload(spec.workload), ledger_path=out,
                              options=SweepOptions(smoke=False), on_progress=events.append).run()
    finally:
        stop_all([host])
    rows = rows_of(out)
    assert not outcome.failed, rows
    assert [(r["status"], r["client"]) for r in rows] == [("ok", "host")]
    # Each request's record reached the controller as it finished, before the row was written.
    phases = [(e.phase, e.message) for e in events if e.phase in ("running", "row")]
    assert phases[-5:] == [("running", f"{k}/4 requests") for k in range(1, 5)] + [("row", "")]
    row = rows[0]
    assert row["completed"] == 4 and row["total_output_tokens"] == 4 * 16
    assert row["itl_ms_mean"] > 0 and row["ttft_ms_mean"] > 0
    # /server_info was read through the host client too: the simulator's version is on the row.
    assert row["sglang_version"] == "0.5.23-sim"


@pytest.mark.fleet
def test_sweep_over_ssh_measures_a_loopback_server_from_the_host(ssh_fleet, tmp_path: Path) -> None:
    fleet_host = ssh_fleet.hosts[0]
    h = ssh_fleet.load().hosts[fleet_host.name]
    server = sim_server(fleet_host.gpu, port=fleet_host.server_port)
    host = dataclasses.replace(h, ddtree=dataclasses.replace(h.ddtree, server=server))
    assert host.ddtree.server.bind_host == "127.0.0.1"
    spec = sweep(tmp_path, baselines=[], grid=GRID)  # no client key: loopback -> host
    out = tmp_path / "ledger.jsonl"
    try:
        outcome = SweepRunner(prepare_sweep(spec, [host]), build_workload(spec.workload), ledger_path=out,
                              options=SweepOptions(smoke=False),
                              services=default_services(host_key_policy="strict")).run()
    finally:
        stop_all([host])
    rows = rows_of(out)
    assert not outcome.failed, rows
    assert [(r["status"], r["client"]) for r in rows] == [("ok", "host")]
    assert rows[0]["completed"] == 4 and rows[0]["sglang_version"] == "0.5.23-sim"
