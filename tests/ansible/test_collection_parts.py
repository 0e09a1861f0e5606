"""The ddtree.ops collection's parts that need no fleet (each check well under a second).

* The collection says what it is: each module's DOCUMENTATION holds the same options (type,
  default, choices, aliases, elements, required) as the argument spec its action plugin
  validates with, and its version is the toolkit's (galaxy.yml, the plugins' version check,
  pyproject.toml), so that the collection never documents another release's behaviour.
* The server task's default tree is ``deploy --restart``'s.
* A bad ``ddtree`` variable is one line naming the host and key, as the CLI's inventory error.
* The transport over Ansible's connection (here a local ``sh``, the same command lines and
  stdin) runs a host program through its framing (a chatty interpreter's noise ignored),
  reads and writes files atomically (regular files only) and ends a command that outlives
  its deadline.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddtree_ops.ansible import tasks
from ddtree_ops.ansible.hostvars import host_from_vars
from ddtree_ops.ansible.run import run_task
from ddtree_ops.ansible.specs import SPECS
from ddtree_ops.ansible.transport import ConnectionTransport
from ddtree_ops.errors import CommandTimeout, InventoryError, RemoteFileError
from ddtree_ops.transport.hostprogram import run_program

REPO = Path(__file__).resolve().parents[2]
COLLECTION = REPO / "ansible_collections" / "ddtree" / "ops"


def _module_constant(name: str, constant: str) -> Any:
    tree = ast.parse((COLLECTION / "plugins" / "modules" / f"{name}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == constant for t in node.targets):
            return yaml.safe_load(ast.literal_eval(node.value))
    raise AssertionError(f"{name}.py has no {constant}")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_modules_documentation_says_its_argument_spec(name: str) -> None:
    documented = _module_constant(name, "DOCUMENTATION")["options"]
    assert set(documented) == set(SPECS[name]), name
    for option, spec in SPECS[name].items():
        doc = documented[option]
        for key in ("type", "default", "choices", "aliases", "elements"):
            assert doc.get(key) == spec.get(key), (name, option, key)
        assert bool(doc.get("required")) == bool(spec.get("required")), (name, option)
        assert doc.get("description"), (name, option)
    assert _module_constant(name, "RETURN") and _module_constant(name, "EXAMPLES")
    assert (COLLECTION / "plugins" / "action" / f"{name}.py").is_file()


def test_the_collection_is_this_toolkit_release() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    galaxy = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())
    assert (galaxy["namespace"], galaxy["name"], galaxy["version"]) == ("ddtree", "ops", version)
    glue = (COLLECTION / "plugins" / "plugin_utils" / "ddtree.py").read_text()
    assert re.search(r'^TOOLKIT_VERSION = "([^"]+)"$', glue, re.M).group(1) == version  # type: ignore[union-attr]


def test_the_server_task_launches_deploy_restarts_default_tree() -> None:
    from ddtree_ops.cli.deploy import RESTART_BUDGET, RESTART_TOPK

    assert (tasks.RESTART_BUDGET, tasks.RESTART_TOPK) == (RESTART_BUDGET, RESTART_TOPK)
    run, named = tasks.run_config(algorithm="ddtree", budget=None, topk=None, eager=False, extra_args=())
    assert run.describe() == f"DDTREE budget={RESTART_BUDGET} topk={RESTART_TOPK}"
    assert named is not None and named.budget is None  # a tuned policy's launch state decides then


def test_a_bad_ddtree_variable_is_one_line_naming_host_and_key() -> None:
    with pytest.raises(InventoryError) as bad:
        host_from_vars("gpu-7", {"server": {"prot": 30000}})
    assert str(bad.value).startswith("host gpu-7: variable ddtree.server.prot: unknown key")
    assert "\n" not in str(bad.value) and "port" in str(bad.value)  # did you mean
    # Through the task entry point: the host's failure as a result, with the CLI's exit code.
    result = run_task("facts", {"bundle": None, "smoke": False}, host_name="gpu-7",
                      ddtree={"server": {"port": "x"}}, execute=_local)
    assert result["failed"] and result["exit_code"] == 2 and result["error"] == "inventory"
    assert result["msg"].startswith("host gpu-7: variable ddtree.server.port:"), result
    # An option outside the CLI's range for its flag is refused before the host is touched.
    refused = run_task("gate", {**{k: v.get("default") for k, v in SPECS["gate"].items()}, "phase": "judge",
                                "agreement": 1.5}, host_name="gpu-7", ddtree=None, execute=_no_host)
    assert refused["msg"] == "ddtree.ops.gate: agreement 1.5: must be >= 0 and <= 1", refused


def _local(line: str, stdin: bytes) -> tuple[int, bytes, bytes]:
    """What Ansible's connection does with a command line, on this machine."""
    proc = subprocess.run(["/bin/sh", "-c", line + " && sleep 0"], input=stdin, capture_output=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def _no_host(line: str, stdin: bytes) -> tuple[int, bytes, bytes]:
    raise AssertionError(f"the host was touched: {line[:80]}")


def test_the_connection_transport_runs_host_programs_and_files(tmp_path: Path) -> None:
    t = ConnectionTransport("h", _local)
    chatty = tmp_path / "python"
    chatty.write_text(f"#!/bin/sh\necho 'conda says hello'\nexec {sys.executable} \"$@\"\n")
    chatty.chmod(0o755)
    answer = run_program(t, str(chatty), "print('noise'); reply({'got': PAYLOAD['x']})", {"x": "a\nb"}, timeout=60)
    assert answer.reply == {"got": "a\nb"}
    assert t.run(["sh", "-c", 'printf "%s" "$PWD"'], cwd=str(tmp_path)).stdout == str(tmp_path)
    target = tmp_path / "d" / "f.bin"
    t.write_atomic(str(target), b"\x00\xff\n", mode=0o600)
    assert target.read_bytes() == b"\x00\xff\n" and target.stat().st_mode & 0o777 == 0o600
    assert t.read_bytes(str(target)) == b"\x00\xff\n" and t.exists(str(target))
    t.write_atomic(str(target), b"")
    assert t.read_bytes(str(target)) == b"" and [p.name for p in target.parent.iterdir()] == ["f.bin"]
    with pytest.raises(RemoteFileError, match="not a regular file"):
        t.read_bytes(str(tmp_path))
    with pytest.raises(RemoteFileError, match="no such file or directory"):
        t.read_bytes(str(tmp_path / "none"))
    assert not t.exists(str(tmp_path / "none"))
    with pytest.raises(CommandTimeout):
        t.run(["sleep", "600"], timeout=0.5)  # never ends by itself
