"""GPU slots end to end: a real inventory with two slots on one local host, the real CLI
process, one simulator per slot (it honours CUDA_VISIBLE_DEVICES and reports it in
/server_info), so each slot's own port, GPUs, run dir and state are checked for real."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import json_data, read_envelope
from fleetlib import write_nvidia_smi
from minisglang import deployed_python
from simhosts import free_port, run_cli

from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory import load_inventory
from ddtree_ops.service import lifecycle
from ddtree_ops.service.launch import LaunchSpec, RunConfig
from ddtree_ops.service.manager import ProcessManager
from ddtree_ops.transport.local import LocalTransport

pytestmark = pytest.mark.timeout(120)


def cli(inventory: Path, *args: str, state: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(inventory, *args, state=state, timeout=100)


def rows(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """host -> result of a fleet command's --json document, every row ok."""
    found = {}
    for row in json_data(out.stdout)["hosts"]:
        assert row["ok"], row
        found[row["host"]] = row["result"]
    return found


def server_info(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as resp:
        return dict(json.loads(resp.read()))


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    """sim-a: two slots of two GPUs each (the simulated machine has eight), TP 2."""
    ports = [free_port(), free_port()]
    server = {
        "command": "{python} -m ddtree_ops.sim",
        "model_path": "sim/qwen3-8b",
        "draft_model_path": "sim/qwen3-8b-dflash",
        "expected_load_s": 5,
        "env": {"SIM_GPU": "b300", "SIM_LOAD_S": "1", "SIM_TIME_SCALE": "0.1"},
        "extra_args": ["--tp-size", "2"],
        "slots": [{"gpus": "0,1", "port": ports[0]}, {"gpus": "2,3", "port": ports[1]}],
    }
    python = deployed_python()  # SGLang 0.5.23 files (a version) with the DDTree bundle deployed
    host = {"ansible_connection": "local", "ddtree": {"python": python, "run_dir": str(tmp_path / "run"),
                                                      "gpu": "b300", "server": server}}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({"all": {"children": {"gpus": {"hosts": {"sim-a": host}}}}}))
    return path


def slot_ports(inventory: Path) -> list[int]:
    slots = yaml.safe_load(inventory.read_text())["all"]["children"]["gpus"]["hosts"]["sim-a"]["ddtree"]["server"]
    return [slot["port"] for slot in slots["slots"]]


def test_a_host_restarts_as_one_server_per_slot_and_one_slot_is_addressable(inventory: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    p0, p1 = slot_ports(inventory)
    try:
        out = cli(inventory, "--json", "restart", "sim-a", "--algorithm", "AR", "--no-smoke", state=state)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        restarted = rows(out)
        assert list(restarted) == ["sim-a/0", "sim-a/1"]
        for name, port, gpus in (("sim-a/0", p0, [0, 1]), ("sim-a/1", p1, [2, 3])):
            gpu = server_info(port)["simulated_gpu"]
            assert (gpu["indices"], gpu["cuda_visible_devices"]) == (gpus, ",".join(map(str, gpus))), name
            assert restarted[name]["log_path"] == str(tmp_path / "run" / f"slot-{name[-1]}" / "server.log")
        # Each slot learns its own load time.
        assert set(json.loads(state.read_text())["load_times"]) == {"sim-a/0|sim/qwen3-8b", "sim-a/1|sim/qwen3-8b"}

        out = cli(inventory, "--json", "stop", "sim-a/0", "--grace", "5", state=state)
        assert out.returncode == 0 and list(rows(out)) == ["sim-a/0"] and rows(out)["sim-a/0"]["exited"]

        out = cli(inventory, "--json", "service-status", "sim-a/1", state=state)
        assert rows(out)["sim-a/1"]["running"] and rows(out)["sim-a/1"]["health"] == 200
        out = cli(inventory, "--json", "service-status", "gpus", state=state)  # a group: every slot
        assert {name: r["running"] for name, r in rows(out).items()} == {"sim-a/0": False, "sim-a/1": True}

        out = cli(inventory, "logs", "sim-a", "--lines", "2", state=state)  # both slots, prefixed
        assert out.returncode == 0, out.stderr
        assert "sim-a/1 | " in out.stdout and "sim-a/0 | " in out.stdout
    finally:
        out = cli(inventory, "--json", "stop", "sim-a", "--grace", "5", state=state)
    assert rows(out)["sim-a/1"]["was_running"] and not rows(out)["sim-a/0"]["was_running"]


def test_a_capture_failure_on_one_slot_sends_the_other_eager_directly(inventory: Path, tmp_path: Path) -> None:
    # The simulated B300 fails CUDA-graph capture at a DDTree budget above 8.
    state = tmp_path / "state.json"
    ddtree = ("--algorithm", "DDTREE", "--budget", "16", "--topk", "4", "--no-smoke")
    try:
        out = cli(inventory, "--json", "restart", "sim-a/0", *ddtree, state=state)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        first = rows(out)["sim-a/0"]
        assert first["attempts"] == 2 and first["cuda_graph"] is False
        (record,) = json.loads(state.read_text())["fallbacks"].values()
        assert record["key"]["host"] == "sim-a"  # the machine: its slots share GPU arch and SGLang

        out = cli(inventory, "--json", "restart", "sim-a/1", *ddtree, state=state)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        second = rows(out)["sim-a/1"]
        assert second["attempts"] == 1 and second["cuda_graph"] is False
        assert second["fallback_reason"].startswith("recorded fallback: CUDA-graph capture failed")
    finally:
        cli(inventory, "stop", "sim-a", "--grace", "5", state=state)


def test_bad_slot_targets_and_slots_are_one_line_exit_2(inventory: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    out = cli(inventory, "--json", "stop", "sim-a/2", state=state)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (error,) = read_envelope(out.stdout)["errors"]
    assert error["message"] == "unknown slot '2' of host 'sim-a': its slots are sim-a/0, sim-a/1"

    data = yaml.safe_load(inventory.read_text())
    data["all"]["children"]["gpus"]["hosts"]["sim-a"]["ddtree"]["server"]["extra_args"] = ["--tp-size", "4"]
    inventory.write_text(yaml.safe_dump(data))
    out = cli(inventory, "restart", "sim-a", state=state)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{inventory}: all.children.gpus.hosts.sim-a.ddtree.server.extra_args: --tp-size 4 does not match " \
           "slot 0's 2 GPU(s) (0,1)" in out.stderr


def test_doctor_fails_a_host_whose_slots_name_gpus_nvidia_smi_does_not_list(inventory: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    write_nvidia_smi(bin_dir, "b300", count=2)  # the slots use GPUs 0-3
    out = run_cli(inventory, "--json", "doctor", "sim-a/1", state=tmp_path / "s.json", path_first=bin_dir)
    assert out.returncode == 2, out.stdout + out.stderr  # an inventory error, the host's own code
    (row,) = json_data(out.stdout)["hosts"]  # a slot target: its machine, once
    assert row["host"] == "sim-a" and not row["ok"]
    assert row["error"].startswith("ddtree.server.slots: slot 1 uses GPU 2 but nvidia-smi on sim-a lists GPUs 0-1")

    write_nvidia_smi(bin_dir, "b300", count=8)
    out = run_cli(inventory, "--json", "doctor", "sim-a", state=tmp_path / "s.json", path_first=bin_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    facts = rows(out)["sim-a"]  # every slot's port is checked, in the same round trip
    assert (facts["ports"], facts["ports_busy"]) == (slot_ports(inventory), [])


def test_a_server_launched_before_the_host_had_slots_blocks_them_until_stopped(
    inventory: Path, tmp_path: Path
) -> None:
    # What `restart sim-a` left running before slots were added: a process recorded in the
    # host's own run dir (a sleeper stands in for the server; only the record matters).
    machine = load_inventory([inventory]).hosts["sim-a"]
    machine = replace(machine, ddtree=replace(machine.ddtree, server=replace(machine.ddtree.server, port=free_port())))
    argv = (sys.executable, "-c", "import time; time.sleep(60)")
    spec = LaunchSpec(host="sim-a", argv=argv, server_args=argv[1:], env={}, port=machine.ddtree.server.port,
                      probe_host="127.0.0.1", cuda_graph=False, model="sim/qwen3-8b", run=RunConfig())
    old = ProcessManager(LocalTransport("sim-a"), machine).start(spec)
    state = tmp_path / "state.json"

    out = cli(inventory, "restart", "sim-a/1", "--algorithm", "AR", "--no-smoke", state=state)
    assert out.returncode == 5, out.stdout + out.stderr
    assert f"a server launched on sim-a as one server, not in a GPU slot, still runs (pid {old.pid}" in out.stdout
    assert not (tmp_path / "run" / "slot-1" / "launch.json").exists()

    out = cli(inventory, "--json", "stop", "sim-a/1", state=state)  # one slot: the old server stays
    assert list(rows(out)) == ["sim-a/1"]
    out = cli(inventory, "--json", "stop", "sim-a", "--grace", "5", state=state)  # the whole host: it goes
    stopped = rows(out)
    assert list(stopped) == ["sim-a/0", "sim-a/1", "sim-a"]
    assert stopped["sim-a"]["was_running"] and stopped["sim-a"]["pid"] == old.pid and stopped["sim-a"]["exited"]
    out = cli(inventory, "--json", "stop", "sim-a", state=state)  # nothing left: no row for it
    assert list(rows(out)) == ["sim-a/0", "sim-a/1"]


def test_the_service_api_refuses_a_host_with_slots_as_one_server(inventory: Path, tmp_path: Path) -> None:
    # deploy --restart or a sweep handing over the inventory host instead of its slots.
    machine = load_inventory([inventory]).hosts["sim-a"]
    request = lifecycle.RestartRequest(machine, RunConfig(), lifecycle.LaunchFacts())
    with pytest.raises(ConfigError, match=r"sim-a has GPU slots .*: restart each slot \(sim-a/0, sim-a/1\)"):
        lifecycle.restart(LocalTransport("sim-a"), request)
    assert not (tmp_path / "run").exists()  # refused before anything ran on the host
