"""The ddtree.ops collection run by ``ansible-playbook`` (a subprocess) over SSH against the
real sshd test fleet, its servers the simulator under the process manager.

The collection is built and installed with ``ansible-galaxy`` first, as a user installs it.
Two tests share the session's fleet (and leave it as they found it: no bundle, no server):

* one host, both tools: a playbook deploys and serves DDTree (changed), its second run reports
  ``changed=0``, ``--check --diff`` on another host shows the diff and changes nothing there;
  ``ddtree-ops status`` and ``service-status`` of the playbook's host are those of the same
  host done by ``ddtree-ops deploy --restart`` (only times, pids and transaction ids differ);
  ``ddtree-ops rollback`` undoes the playbook's deploy and ``ddtree.ops.bundle state=absent``
  the CLI's;
* the rollout playbook with a canary whose DDTree plugin gets greedy tokens wrong: the gate
  fails, the canary is put back (no bundle, no server: none ran before) and the playbook stops
  with the rest of the fleet untouched (a host serving before serves on, the same process).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_runs import ABSENT, CHANGED, CONVERGE, FAILED, REPO, RESCUED, playbook, rows
from fleetlib import Fleet, FleetHost, cached_prefix_template, find_wheel
from testports import free_port

from ddtree_ops.patching.bundle import load_bundle
from ddtree_ops.shipped import DEFAULT_BUNDLE

pytestmark = [pytest.mark.fleet, pytest.mark.slow, pytest.mark.timeout(600)]

TREE = {"budget": "4", "topk": "4"}


def fleet_inventory(fleet: Fleet, root: Path, *, faults: dict[str, str] | None = None) -> Path:
    """One inventory both tools read: each fleet host's simulator server (its own port, the
    RTX PRO 6000 profile, compressed time), every ``ddtree`` key at host level (Ansible
    replaces a dict variable whole), the fleet's host keys checked by both."""
    hosts: dict[str, Any] = {}
    for h in fleet.hosts:
        env = {"SIM_LOAD_S": "0.2", "SIM_GPU": "rtx-pro-6000", "SIM_TIME_SCALE": "0.1"}
        if faults and h.name in faults:
            env["SIM_DDTREE_FAULT"] = faults[h.name]
        server = {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
                  "draft_model_path": "sim/qwen3-8b-dflash", "port": free_port(), "expected_load_s": 5, "env": env}
        ddtree = {"python": str(h.python), "run_dir": str(root / h.name), "known_hosts": str(fleet.known_hosts),
                  "server": server}
        hosts[h.name] = {"ansible_host": "127.0.0.1", "ansible_port": h.port, "ddtree": ddtree}
    group = {"ansible_user": "root", "ansible_ssh_private_key_file": str(fleet.client_key),
             "ansible_ssh_common_args": f"-o UserKnownHostsFile={fleet.known_hosts} -o StrictHostKeyChecking=yes"}
    path = root / "inventory.yml"
    path.write_text(yaml.safe_dump({"all": {"children": {"fleet": {"vars": group, "hosts": hosts}}}}))
    return path


def reset(fh: FleetHost) -> None:
    """The host's SGLang files as installed and no ddtree-ops record: the session's fleet is shared."""
    upstream = Path(str(fh.sglang_dir).replace(str(fh.prefix), str(cached_prefix_template(find_wheel())), 1))
    for f in load_bundle(DEFAULT_BUNDLE).files:
        if f.root == "site-packages":
            shutil.rmtree(fh.site_packages / f.rel.split("/")[0], ignore_errors=True)
        elif (upstream / f.path).exists():
            shutil.copy2(upstream / f.path, fh.sglang_dir / f.path)
        else:
            (fh.sglang_dir / f.path).unlink(missing_ok=True)
    shutil.rmtree(fh.prefix / ".ddtree-ops", ignore_errors=True)


@pytest.fixture
def fleet_root(ssh_fleet: Fleet, tmp_path: Path, cli: Callable[..., Any]) -> Iterator[Path]:
    """A clean fleet before, and after: every server this test launched stopped, files back."""
    for fh in ssh_fleet.hosts:
        reset(fh)
    yield tmp_path
    inv = tmp_path / "inventory.yml"
    if inv.exists():
        cli("-i", str(inv), "stop", "all")
    for fh in ssh_fleet.hosts:
        reset(fh)


# What differs between two launches of the same thing, or two deploys of the same bundle.
_PER_RUN = {"applied_at", "pid", "started_at", "txn", "ready_at", "startup_time", "log_tail"}


def _same_but_per_run(row: Any) -> Any:
    if isinstance(row, dict):
        return {k: _same_but_per_run(v) for k, v in row.items() if k not in _PER_RUN}
    if isinstance(row, list):
        return [_same_but_per_run(v) for v in row]
    return row


def test_a_playbook_deploys_idempotently_and_either_tool_undoes_the_other(
    ssh_fleet: Fleet, ansible_home: Path, fleet_root: Path, cli: Callable[..., Any]
) -> None:
    inv = fleet_inventory(ssh_fleet, fleet_root)
    a, b = ssh_fleet.hosts[0], ssh_fleet.hosts[1]
    code, out, recap = playbook(ansible_home, inv, CONVERGE, target=a.name, **TREE)
    assert code == 0, out
    assert recap[a.name][CHANGED] >= 2 and recap[a.name][FAILED] == 0, out  # the bundle and the server changed
    code, out, recap = playbook(ansible_home, inv, CONVERGE, target=a.name, **TREE)
    assert code == 0 and recap[a.name][CHANGED] == 0, out  # observed in place, serving: changed=0

    # Check mode on a fresh host: the diff of every file the deploy would write, nothing written.
    before = rows(cli, inv, "status", b.name)
    code, out, recap = playbook(ansible_home, inv, CONVERGE, "--check", "--diff", target=b.name, **TREE)
    assert code == 0, out
    assert "+++ after: add/sglang/srt/speculative/ddtree_plugin.py" in out, out
    assert recap[b.name][CHANGED] == 2, out  # the bundle would be applied, the server restarted
    assert rows(cli, inv, "status", b.name) == before
    assert before[b.name]["bundle"] is None and not before[b.name]["service"]["running"]

    # Parity: the playbook's host, then the same host by ddtree-ops deploy --restart.
    by_playbook = {c: rows(cli, inv, c, a.name)[a.name] for c in ("status", "service-status")}
    assert by_playbook["status"]["bundle"]["name"] == "ddtree_temperature", by_playbook
    served = by_playbook["service-status"]
    assert served["run"] == "DDTREE budget=4 topk=4" and served["argv"] and served["health"] == 200, served
    rolled = cli("-i", str(inv), "rollback", a.name, "--restart")  # the CLI undoes the playbook's deploy
    assert rolled.exit_code == 0, rolled.stdout + rolled.stderr
    assert rows(cli, inv, "status", a.name)[a.name]["bundle"] is None
    done = cli("-i", str(inv), "deploy", a.name, "--restart", "--budget", TREE["budget"], "--topk", TREE["topk"])
    assert done.exit_code == 0, done.stdout + done.stderr
    by_cli = {c: rows(cli, inv, c, a.name)[a.name] for c in ("status", "service-status")}
    assert _same_but_per_run(by_cli) == _same_but_per_run(by_playbook)

    # The module undoes the CLI's deploy: the original files, and status says so.
    code, out, recap = playbook(ansible_home, inv, ABSENT, target=a.name)
    assert code == 0 and recap[a.name][CHANGED] == 1, out
    status = rows(cli, inv, "status", a.name)[a.name]
    assert status["bundle"] is None and {f["state"] for f in status["files"]} <= {"original", "missing"}, status


def test_the_rollout_playbook_stops_at_a_failing_canary_with_the_fleet_untouched(
    ssh_fleet: Fleet, ansible_home: Path, fleet_root: Path, cli: Callable[..., Any]
) -> None:
    canary, *rest = ssh_fleet.names
    inv = fleet_inventory(ssh_fleet, fleet_root, faults={canary: "wrong_greedy"})
    # One host of the rest serves before the rollout: it must serve on, the same process.
    served = cli("-i", str(inv), "restart", rest[0], "--algorithm", "AR", "--no-smoke")
    assert served.exit_code == 0, served.stdout + served.stderr
    before = rows(cli, inv, "service-status", "all")
    code, out, recap = playbook(ansible_home, inv, REPO / "playbooks" / "rollout.yml", target="fleet",
                                canary=canary, **TREE)
    assert code != 0, out
    assert "canary " + canary + " failed and was put back" in out and "gate FAILED" in out, out
    assert recap[canary][FAILED] == 1 and recap[canary][RESCUED] == 1, out  # failed, after its rescue
    for name in rest:
        assert recap[name][CHANGED] == 0 and recap[name][FAILED] == 0, out  # checked, never changed
    status = rows(cli, inv, "status", "all")
    assert all(row["bundle"] is None for row in status.values()), status
    after = rows(cli, inv, "service-status", "all")
    assert not after[canary]["running"], after  # nothing ran there before the gate's baseline launch
    for name in rest:
        assert after[name]["running"] == before[name]["running"] and after[name]["pid"] == before[name]["pid"]
    assert after[rest[0]]["running"], after
