"""The ddtree.ops collection on a host run by a real systemd (tests/systemdhost.py), reached by
``ansible-playbook`` over SSH at its own address: the server task drives the operator's unit
through ddtree-ops' drop-in, as ``deploy --restart`` does.

One host, one test: the playbook deploys the bundle and serves DDTree (the drop-in written,
the unit restarted on it, changed), its second run reports ``changed=0`` (the unit observed
serving the launch); ``ddtree-ops rollback --restart`` then undoes it (the drop-in removed,
the unit back on its own ExecStart), so the CLI sees and undoes what the playbook did.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_runs import CHANGED, CONVERGE, playbook, rows
from fleetlib import fast_root
from systemdhost import UNIT, SystemdFleet, build_systemd_fleet, reset, systemd_inventory, systemd_unavailable

pytestmark = [pytest.mark.fleet, pytest.mark.slow, pytest.mark.timeout(600)]

DROPIN = f"etc/systemd/system/{UNIT}.d/50-ddtree-ops.conf"


@pytest.fixture(scope="module")
def sd_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdFleet]:
    reason = systemd_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must boot systemd test hosts, but {reason}")
        pytest.skip(reason)
    root, owned = fast_root(tmp_path_factory.mktemp("systemd"))
    try:
        fleet = build_systemd_fleet(root / "fleet", 1)
        try:
            yield fleet
        finally:
            fleet.close()
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)


def test_a_playbook_drives_a_systemd_unit_through_the_drop_in_and_the_cli_undoes_it(
    sd_host: SystemdFleet, ansible_home: Path, tmp_path: Path, cli: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    host = sd_host.hosts[0]
    reset(host)
    # Every ddtree key at host level: Ansible replaces a dict variable whole.
    doc: Any = systemd_inventory(sd_host)
    group = doc["all"]["children"]["systemd_hosts"]
    entry = group["hosts"][host.name]
    entry["ddtree"] = {**group["vars"].pop("ddtree"), **entry["ddtree"]}
    group["vars"]["ansible_ssh_common_args"] = (f"-o UserKnownHostsFile={sd_host.known_hosts} "
                                                f"-o StrictHostKeyChecking=yes")
    inv = tmp_path / "inventory.yml"
    inv.write_text(yaml.safe_dump(doc))
    try:
        code, out, recap = playbook(ansible_home, inv, CONVERGE, target=host.name, budget="4", topk="4")
        assert code == 0 and recap[host.name][CHANGED] >= 2, out
        assert (host.upper / DROPIN).exists(), out
        code, out, recap = playbook(ansible_home, inv, CONVERGE, target=host.name, budget="4", topk="4")
        assert code == 0 and recap[host.name][CHANGED] == 0, out
        unit = rows(cli, inv, "service-status", host.name)[host.name]["unit"]
        assert unit["dropin_in_effect"] and unit["active"] == "active", unit
        done = cli("-i", str(inv), "rollback", host.name, "--restart")
        assert done.exit_code == 0, done.stdout + done.stderr
        assert not (host.upper / DROPIN).exists()
        unit = rows(cli, inv, "service-status", host.name)[host.name]["unit"]
        assert not unit["dropin_in_effect"] and unit["active"] == "active", unit
    finally:
        cli("-i", str(inv), "rollback", host.name)
        reset(host)
