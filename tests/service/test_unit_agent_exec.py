"""The unit agent reads the argv of a unit's own ExecStart from the process, and systemd sets
MainPID at its fork, before the exec: read at once, /proc showed systemd's child, comm
``(python3)``, cmdline that name and NULs (3 reads in 20 on a booted systemd 252 here), and
readiness then waited for a launch_command no server reports. Real processes stand in for
systemd's child here: one that names itself ``(python3)`` as systemd does, then execs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtree_ops.service import _unit_agent

# The child's life before its exec, as systemd's fork has it: renamed "(python3)" at once.
PRE_EXEC = """
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(15, b"(python3)", 0, 0, 0)  # PR_SET_NAME
open(sys.argv[1], "w").close()
time.sleep(float(sys.argv[2]))
if sys.argv[3] == "exec":
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "--port", "30000"])
"""


def _child(tmp_path: Path, delay_s: float, then: str) -> subprocess.Popen[bytes]:
    flag = tmp_path / "renamed"
    child = subprocess.Popen([sys.executable, "-c", PRE_EXEC, str(flag), str(delay_s), then])
    deadline = time.time() + 30
    while not flag.exists():
        assert child.poll() is None and time.time() < deadline, "the child did not start"
        time.sleep(0.01)
    return child


def test_the_argv_is_the_exec_d_commands_not_the_forked_managers(tmp_path: Path) -> None:
    child = _child(tmp_path, 0.5, "exec")
    try:
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "(python3)"
        argv = _unit_agent._exec_argv(child.pid)
        assert argv == [sys.executable, "-c", "import time; time.sleep(60)", "--port", "30000"], argv
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("then", ["exit", "stay"])
def test_a_child_that_dies_or_never_execs_gives_no_argv(tmp_path: Path, then: str) -> None:
    child = _child(tmp_path, 0.3 if then == "exit" else 60, then)
    try:
        assert _unit_agent._exec_argv(child.pid, timeout_s=1.0) == []
    finally:
        child.kill()
        child.wait()
