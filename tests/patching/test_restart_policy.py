"""One restart policy (``lifecycle.prepare_restart``) for ``restart``, ``deploy --restart``
and a sweep: an eager fallback that one of them learned is honoured by the others.

The host is a prefix with SGLang's files (so that ``deploy`` has a package to patch)
serving the simulator on its B300 profile, whose CUDA-graph capture crashes above budget
8, and whose ``nvidia-smi`` (a stand-in on PATH) reports a B300, ``sm_103``. The inventory
names the GPU ``b300``: a fallback must be keyed on what the probe found, as ``restart``
records it. ``deploy --restart`` used to key on the inventory's name, miss the record and
launch with graphs again, crashing one more capture (a full model load on a real host).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from fleetlib import write_nvidia_smi
from service.simhosts import run_cli

from ddtree_ops.bench import ledger
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service.manager import ProcessManager
from ddtree_ops.state import StateStore
from ddtree_ops.transport.local import LocalTransport
from patching.conftest import MiniHost, sim_inventory


def _sweep(tmp_path: Path) -> Path:
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "general kenobi"}\n')
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "policy", "targets": ["b1"],
        "grid": {"algorithm": ["ddtree"], "budget": [16], "topk": [4], "temperature": [0.0], "concurrency": [1]},
        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 2, "max_new_tokens": 16}, "warmup": 0,
    }))
    return path


def test_an_eager_fallback_restart_recorded_is_honoured_by_deploy_restart_and_by_a_sweep(
    tmp_path: Path, mini: MiniHost
) -> None:
    inv = sim_inventory(tmp_path, mini)
    state = tmp_path / "state.json"
    bin_dir = tmp_path / "bin"
    write_nvidia_smi(bin_dir, "b300")
    host = load_inventory([inv]).hosts["b1"]

    def fallbacks() -> list[tuple[str, int | None]]:
        return sorted((r.key.gpu_arch, r.key.budget) for r in StateStore(state).fallbacks())

    try:
        # The DDTree bundle first: a DDTREE launch on a host without it is refused.
        assert run_cli(inv, "deploy", "b1", state=state).returncode == 0
        first = run_cli(inv, "--json", "restart", "b1", "--algorithm", "DDTREE", "--budget", "16", "--topk", "4",
                        state=state, path_first=bin_dir)
        assert first.returncode == 0, first.stdout + first.stderr
        # restart tried graphs, the capture crashed, it fell back and remembered: on sm_103.
        assert fallbacks() == [("sm_103", 16)]

        deployed = run_cli(inv, "deploy", "b1", "--restart", "--budget", "16", "--topk", "4",
                           state=state, path_first=bin_dir)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        # Launched eager at once: no second capture crash, so nothing new to remember.
        assert fallbacks() == [("sm_103", 16)]
        record = ProcessManager(LocalTransport("b1"), host).status(lines=0)["record"]
        assert record["cuda_graph"] is False

        swept = run_cli(inv, "bench", "--sweep", str(_sweep(tmp_path)), "--out", str(tmp_path / "l.jsonl"),
                        state=state, path_first=bin_dir)
        assert swept.returncode == 0, swept.stdout + swept.stderr
        (row,) = ledger.read_ledger(tmp_path / "l.jsonl").rows
        assert row["status"] == "ok" and row["cuda_graph"] is False and row["gpu_arch"] == "sm_103", row
        assert "capturing_cuda_graphs" not in row["readiness_s"], row["readiness_s"]
        assert fallbacks() == [("sm_103", 16)]
    finally:
        ProcessManager(LocalTransport("b1"), host).stop(grace_s=5)
