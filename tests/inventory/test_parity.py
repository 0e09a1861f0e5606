"""Parity with ``ansible-inventory --list`` (ansible-core, run as a subprocess, never imported).

For each corpus case our loader's hosts, each host's groups, the connection values
(address, port, user, key file, connection) and ``ddtree`` must be what Ansible
resolves. One ``ansible-inventory`` call per case, in a throwaway HOME and config so
nothing of the machine's Ansible setup leaks in. The oracle runs with
``ANSIBLE_HASH_BEHAVIOUR=merge``: that changes only how dicts combine — our ``ddtree:``
merges key by key by design (documented), and every other value we compare is a scalar,
the same under both behaviours. ``ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED`` makes the
oracle fail on a file it could not parse, instead of skipping it with a warning.

``ansible-inventory --list`` shows a Jinja template as written. For the cases with
templates the oracle is ``ansible all -m debug -a var=hostvars[inventory_hostname]``,
which evaluates every variable of every host as a play would (the debug action never
connects), one JSON file per host (``--tree``) — one call per case as well.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddtree_ops.inventory import Inventory, load_inventory
from ddtree_ops.inventory.build import build_settings
from ddtree_ops.inventory_types import Host

CORPUS = Path(__file__).resolve().parent / "corpus"
CASES: dict[str, list[str]] = {
    "ini_basic": ["hosts.ini"],
    "ini_vars_children": ["hosts.ini"],
    "ranges": ["hosts.ini", "more.yml"],
    "vars_dirs": ["hosts.yml"],
    "nested_two_parents": ["hosts.yml"],
    "group_priority": ["hosts.yml"],
    "multi_source": ["a.yml", "b.ini"],
    "dir_source": ["inv"],
    "legacy_aliases": ["hosts.yml", "more.ini"],
    "edge_cases": ["hosts.yml", "more.ini"],
    "slots": ["hosts.yml"],
    "dns_names": ["hosts.yml", "more.ini"],
}
# Cases with templates, compared with what Ansible evaluates (ansible_evaluated), and the
# environment both sides see (for lookup('env')).
TEMPLATE_CASES: dict[str, list[str]] = {
    "templates": ["hosts.yml", "more.ini"],
}
TEMPLATE_ENV = {"FLEET_USER": "fleet-ops"}
# The ssh connection plugin's documented vars per option; the last one set wins.
OPTION_VARS = {
    "address": ["ansible_host", "ansible_ssh_host"],
    "port": ["ansible_port", "ansible_ssh_port"],
    "user": ["ansible_user", "ansible_ssh_user"],
    "key_file": ["ansible_private_key_file", "ansible_ssh_private_key_file"],
}
PARAMIKO_VARS = {
    "address": "ansible_paramiko_host",
    "port": "ansible_paramiko_port",
    "user": "ansible_paramiko_user",
    "key_file": "ansible_paramiko_private_key_file",
}


def ansible_tool(name: str = "ansible-inventory") -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        reason = f"{name} not installed (it is in the test extra: pip install -e '.[test]')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Ansible parity tests, but {reason}")
        pytest.skip(reason)
    return found


def isolated_env(tmp: Path) -> dict[str, str]:
    """An environment in which nothing of this machine's Ansible setup takes part."""
    (tmp / "ansible.cfg").write_text("")
    (tmp / "tmp").mkdir(exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp),
        "LANG": "C.UTF-8",
        "ANSIBLE_CONFIG": str(tmp / "ansible.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(tmp / "tmp"),
        "ANSIBLE_HASH_BEHAVIOUR": "merge",
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "false",
    }


def oracle(sources: list[Path], tmp: Path) -> dict[str, Any]:
    """``ansible-inventory -i S1 -i S2 --list`` in an isolated environment."""
    args = [ansible_tool()]
    for source in sources:
        args += ["-i", str(source)]
    proc = subprocess.run([*args, "--list"], cwd=tmp, env=isolated_env(tmp), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def ansible_evaluated(sources: list[Path], tmp: Path) -> dict[str, dict[str, Any]]:
    """host -> its variables with every template evaluated, as a play sees them."""
    tree = tmp / "tree"
    args = [ansible_tool("ansible"), "all", "-m", "debug", "-a", "var=hostvars[inventory_hostname]"]
    args += ["--tree", str(tree)]
    for source in sources:
        args += ["-i", str(source)]
    env = {**isolated_env(tmp), **TEMPLATE_ENV}
    proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {file.name: json.loads(file.read_text())["hostvars[inventory_hostname]"] for file in tree.iterdir()}


def ansible_groups(listing: dict[str, Any]) -> dict[str, set[str]]:
    """host -> every group holding it (directly or through children), without ``all``."""
    direct = {g: body for g, body in listing.items() if g != "_meta"}

    def members(group: str) -> set[str]:
        body = direct.get(group, {})
        out = set(body.get("hosts", []))
        for child in body.get("children", []):
            out |= members(child)
        return out

    result: dict[str, set[str]] = {h: set() for h in members("all")}
    for group in direct:
        if group != "all":
            for host in members(group):
                result[host].add(group)
    return result


def expected_connection(hostvars: dict[str, Any]) -> dict[str, Any]:
    connection = hostvars.get("ansible_connection", "ssh")
    out: dict[str, Any] = {"connection": "local" if connection == "local" else "ssh"}
    for option, names in OPTION_VARS.items():
        if connection in ("paramiko", "paramiko_ssh"):
            names = [*names, PARAMIKO_VARS[option]]
        value = None
        for name in names:
            if hostvars.get(name) is not None:
                value = hostvars[name]
        out[option] = int(value) if option == "port" and value is not None else value
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_ansible_inventory(case: str, tmp_path: Path) -> None:
    assert_parity([CORPUS / case / s for s in CASES[case]], tmp_path)


def test_shipped_inventories_match_ansible_inventory(tmp_path: Path) -> None:
    assert_parity([CORPUS.parents[2] / "inventories", CORPUS.parents[2] / "examples" / "inventories"], tmp_path)


@pytest.mark.parametrize("case", sorted(TEMPLATE_CASES))
def test_templates_evaluate_as_in_ansible(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TEMPLATE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("UNSET_FLEET_VARIABLE", raising=False)
    sources = [CORPUS / case / s for s in TEMPLATE_CASES[case]]
    hostvars = ansible_evaluated(sources, tmp_path)
    ours = load_inventory(sources)

    assert set(ours.hosts) == set(hostvars)
    for name, host in ours.hosts.items():
        theirs = hostvars[name]
        # group_names: every group holding the host (ancestors too), without `all`.
        assert set(host.groups) == set(theirs["group_names"]), name
        assert_host_matches(ours, host, theirs, set(theirs["group_names"]))


def assert_parity(sources: list[Path], tmp_path: Path) -> None:
    listing = oracle(sources, tmp_path)
    # _meta.hostvars leaves out hosts without variables: the groups name every host.
    groups = ansible_groups(listing)
    hostvars: dict[str, dict[str, Any]] = listing["_meta"]["hostvars"]
    ours = load_inventory(sources)

    assert set(ours.hosts) == set(groups)
    for name, host in ours.hosts.items():
        assert set(host.groups) == groups[name], name
        assert_host_matches(ours, host, hostvars.get(name, {}), groups[name])


def assert_host_matches(ours: Inventory, host: Host, theirs: dict[str, Any], groups: set[str]) -> None:
    """The host's connection values and ddtree settings are Ansible's ``theirs``."""
    got = {
        "connection": host.connection,
        "address": host.address,
        "port": host.port,
        "user": host.user,
        "key_file": host.key_file,
    }
    assert got == expected_connection(theirs), host.name
    # Relative paths of local hosts are anchored at the defining file, as ours are.
    base = Path(host.source).resolve().parent
    expected_ddtree = build_settings(theirs.get("ddtree") or {}, base, local=host.connection == "local")
    assert host.ddtree == expected_ddtree, host.name
    # Every group the host is in resolves it, as `ansible -i ... GROUP --list-hosts` would.
    for group in groups:
        assert host in ours.resolve(group)


def test_corpus_has_every_case_on_disk() -> None:
    assert sorted(p.name for p in CORPUS.iterdir() if p.is_dir()) == sorted({**CASES, **TEMPLATE_CASES})
