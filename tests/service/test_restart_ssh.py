"""restart/stop over real SSH (the sshd test fleet), simulator on the far side.

The fleet hosts' Python prefixes hold the real SGLang 0.5.23 files, so the version the
eager flags depend on is found on the host, as in production.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ddtree_ops.inventory_types import Host
from ddtree_ops.service import RunConfig, lifecycle, manager
from ddtree_ops.service.logphases import PhaseEvent
from ddtree_ops.state import StateStore
from ddtree_ops.transport import open_transport

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(180)]


def sim_server(host: Host, gpu: str) -> Host:
    server = replace(
        host.ddtree.server,
        command="{python} -m ddtree_ops.sim",
        model_path="sim/qwen3-8b",
        draft_model_path="sim/qwen3-8b-dflash",
        expected_load_s=2.0,
        env={"SIM_GPU": gpu, "SIM_LOAD_S": "2", "SIM_TIME_SCALE": "0.1"},
    )
    return replace(host, ddtree=replace(host.ddtree, server=server))


def test_b300_fallback_over_ssh_then_eager_directly(ssh_fleet) -> None:  # type: ignore[no-untyped-def]
    host = sim_server(ssh_fleet.load().hosts["fleet-1"], "b300")
    state = StateStore()
    run = RunConfig("DDTREE", budget=16, topk=4)
    with open_transport(host) as t:
        try:
            version = manager.sglang_version(t, host)
            assert version == "0.5.23"
            events: list[PhaseEvent] = []
            first = lifecycle.restart(t, host, version, run, state=state, on_phase=events.append, poll_interval_s=0.2)
            assert (first.cuda_graph, first.attempts) == (False, 2)
            assert [e.phase for e in events].count("starting") == 2
            assert first.argv[-4:] == ("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")

            events.clear()
            second = lifecycle.restart(t, host, version, run, state=state, on_phase=events.append, poll_interval_s=0.2)
            assert (second.cuda_graph, second.attempts) == (False, 1)
            assert "capturing_cuda_graphs" not in [e.phase for e in events]
            assert second.deadline_source == "learned"

            status = lifecycle.service_status(t, host)
            assert status.running and status.pid == second.pid and status.health == 200 and status.serving_ours
        finally:
            stopped = lifecycle.stop(t, host, grace_s=5.0)
    assert stopped.exited
