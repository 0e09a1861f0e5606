"""restart/stop over real SSH (the sshd test fleet), simulator on the far side.

The fleet hosts' Python prefixes hold the real SGLang 0.5.23 files, so the version the
eager flags depend on is found on the host, as in production. The other scenarios where
SSH changes what happens (normal restart, drain race, port held by a foreign process,
crash during load, hostile extra args) are shared with the local ones through the
``sim_target`` fixture and run as ``test_restart_local.py::...[ssh]``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from simhosts import sim_host

from ddtree_ops.service import RunConfig, lifecycle, manager
from ddtree_ops.service.lifecycle import LaunchFacts, RestartRequest
from ddtree_ops.service.logphases import PhaseEvent
from ddtree_ops.state import StateStore
from ddtree_ops.transport import open_transport

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(180)]


def test_b300_fallback_over_ssh_then_eager_directly(ssh_fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # fleet-1's own run_dir and port stay untouched: the fleet is shared by the suite.
    host = sim_host(tmp_path / "run", base=ssh_fleet.load().hosts["fleet-1"], name="fleet-1", gpu="b300")
    state = StateStore()
    run = RunConfig("DDTREE", budget=16, topk=4)
    with open_transport(host) as t:
        try:
            version = manager.sglang_version(t, host)
            assert version == "0.5.23"
            events: list[PhaseEvent] = []
            request = RestartRequest(host, run, LaunchFacts(version), poll_interval_s=0.2)
            first = lifecycle.restart(t, request, state=state, on_phase=events.append)
            assert (first.cuda_graph, first.attempts) == (False, 2)
            assert [e.phase for e in events].count("starting") == 2
            assert first.argv[-4:] == (
                "--cuda-graph-backend-decode",
                "disabled",
                "--cuda-graph-backend-prefill",
                "disabled",
            )

            events.clear()
            second = lifecycle.restart(t, request, state=state, on_phase=events.append)
            assert (second.cuda_graph, second.attempts) == (False, 1)
            assert "capturing_cuda_graphs" not in [e.phase for e in events]
            assert second.deadline_source == "learned"

            status = lifecycle.service_status(t, host)
            assert status.running and status.pid == second.pid and status.health == 200 and status.serving_ours
        finally:
            stopped = lifecycle.stop(t, host, grace_s=5.0)
    assert stopped.exited
