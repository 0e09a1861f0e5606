"""Running ``ansible-playbook`` (a subprocess) with the ddtree.ops collection, for the tests.

The collection is built and installed with ``ansible-galaxy`` into a throwaway HOME, as a
user installs it; each run sees none of this machine's Ansible setup.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_json import json_data

REPO = Path(__file__).resolve().parents[2]
COLLECTION = REPO / "ansible_collections" / "ddtree" / "ops"
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)"
                   r"\s+rescued=(\d+)\s+ignored=(\d+)", re.M)
# A recap row's columns: ok, changed, unreachable, failed, skipped, rescued, ignored.
OK, CHANGED, UNREACHABLE, FAILED, SKIPPED, RESCUED = range(6)

# One host's deploy and serve, as a playbook of the user's own would write it.
CONVERGE = """
- hosts: "{{ target }}"
  gather_facts: false
  tasks:
    - ddtree.ops.bundle:
      register: deployed
    - ddtree.ops.server:
        budget: "{{ budget }}"
        topk: "{{ topk }}"
    - ddtree.ops.facts:
    - ansible.builtin.assert:
        that:
          - ansible_facts.ddtree_ops.bundle.identity == deployed.bundle.identity
          - ansible_facts.ddtree_ops.servers | map(attribute='ready') | list == [true]
          - ansible_facts.ddtree_ops.servers[0].serves == 'DDTREE budget=' ~ budget ~ ' topk=' ~ topk
      when: not ansible_check_mode
"""
ABSENT = """
- hosts: "{{ target }}"
  gather_facts: false
  tasks:
    - ddtree.ops.bundle:
        state: absent
"""


def ansible_tool(name: str) -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        reason = f"{name} not installed (it is in the test extra: pip install -e '.[test]')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Ansible collection tests, but {reason}")
        pytest.skip(reason)
    return found


def isolated(home: Path) -> dict[str, str]:
    """This process's environment (the test's state file) without the machine's Ansible setup."""
    (home / "ansible.cfg").touch()
    (home / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    return env | {
        "HOME": str(home), "LANG": "C.UTF-8", "ANSIBLE_CONFIG": str(home / "ansible.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"), "ANSIBLE_COLLECTIONS_PATH": str(home / "collections"),
        "ANSIBLE_NOCOLOR": "1", "ANSIBLE_DEPRECATION_WARNINGS": "false",
        # Short-lived masters: nothing of Ansible's stays connected to a test host after a test.
        "ANSIBLE_SSH_ARGS": "-o ControlMaster=auto -o ControlPersist=5s",
    }


def install_collection(home: Path) -> Path:
    """``ansible-galaxy collection build`` and ``install`` into ``home``."""
    env = isolated(home)
    build = subprocess.run([ansible_tool("ansible-galaxy"), "collection", "build", str(COLLECTION), "--output-path",
                            str(home / "dist")], env=env, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stdout + build.stderr
    (tarball,) = (home / "dist").glob("ddtree-ops-*.tar.gz")
    install = subprocess.run([ansible_tool("ansible-galaxy"), "collection", "install", "--offline", str(tarball),
                              "-p", str(home / "collections")], env=env, capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stdout + install.stderr
    return home


def playbook(home: Path, inventory: Path, book: str | Path, *args: str,
             **extra: str) -> tuple[int, str, dict[str, list[int]]]:
    """``ansible-playbook`` (a subprocess): its exit code, output and recap per host."""
    path = book if isinstance(book, Path) else home / f"book-{abs(hash(book))}.yml"
    if not isinstance(book, Path):
        path.write_text(book)
    argv = [ansible_tool("ansible-playbook"), "-i", str(inventory), str(path), *args]
    for key, value in extra.items():
        argv += ["-e", f"{key}={value}"]
    proc = subprocess.run(argv, env=isolated(home), capture_output=True, text=True, timeout=500, cwd=home)
    recap = {m.group(1): [int(g) for g in m.groups()[1:]] for m in RECAP.finditer(proc.stdout)}
    return proc.returncode, proc.stdout + proc.stderr, recap


def rows(cli: Callable[..., Any], inv: Path, command: str, target: str) -> dict[str, Any]:
    """``ddtree-ops --json COMMAND TARGET``'s row per host (a fan-out's result per host)."""
    done = cli("-i", str(inv), "--json", command, target)
    assert done.exit_code == 0, done.stdout + done.stderr
    data = json_data(done.stdout)
    if isinstance(data, dict):  # {title, ok, hosts: [{host, ok, error, result}]}
        return {row["host"]: row["result"] for row in data["hosts"]}
    return {row["host"]: row for row in data}
