"""A canary that fails before its gate is a rejected canary: ``deploy --restart --canary``
whose patched server crashes while loading (the simulator's ``SIM_DDTREE_FAULT=crash_load``,
a DDTree plugin whose worker cannot build) exits 4 (``canary_rejected``), as the README
promises for a canary that fails its gate, with the crash named, and the canary put back:
the patch rolled back, no server (none ran before the gate's own baseline launch)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import read_envelope

from ddtree_ops.inventory import load_inventory
from ddtree_ops.service.manager import ProcessManager
from ddtree_ops.transport.local import LocalTransport
from patching.conftest import MiniHost, sim_inventory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_canary_crashing_while_loading_is_rejected_exit_4_and_put_back(
    tmp_path: Path, mini: MiniHost, cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDTREE_OPS_STATE", str(tmp_path / "state.json"))
    inv = sim_inventory(tmp_path, mini)
    doc = yaml.safe_load(inv.read_text())
    doc["all"]["children"]["b"]["hosts"]["b1"]["ddtree"]["server"]["env"]["SIM_DDTREE_FAULT"] = "crash_load"
    inv.write_text(yaml.safe_dump(doc))
    svc = ProcessManager(LocalTransport("b1"), load_inventory([inv]).hosts["b1"])
    try:
        done = cli("-i", str(inv), "--json", "deploy", "b1", "--restart", "--budget", "4", "--topk", "4",
                   "--canary", "b1")
        assert done.exit_code == 4, done.stdout + done.stderr
        env = read_envelope(done.stdout)
        error = next(e for e in env["errors"] if e["host"] == "b1")
        assert error["code"] == "canary_rejected", error
        message = error["message"]
        assert "canary b1 rejected before its gate, the change failed: " in message
        # The original cause is kept: the restart failed, the server died loading, its log's line.
        assert "the restart failed" in message and "verify buffers do not fit the draft block" in message, message
        assert "patch rolled back to the originals" in message
        assert not mini.file("srt/speculative/ddtree_worker_v2.py").exists()  # the bundle's file, gone again
        assert not svc.status(lines=0)["alive"]  # nothing ran before the gate's baseline launch
    finally:
        svc.stop(grace_s=5)
