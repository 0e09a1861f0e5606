"""The unit agent reads the argv of a unit's own ExecStart from the process, and systemd sets
MainPID at its fork, before the exec: read at once, /proc showed systemd's child, comm
``(python3)``, cmdline that name and NULs (3 reads in 20 on a booted systemd 252 here), and
readiness then waited for a launch_command no server reports. Real processes stand in for
systemd's child here: one that names itself ``(python3)`` as systemd does, then execs, exits
or stays."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from ddtree_ops.service import _unit_agent

# The child's life before its exec, as systemd's fork has it: renamed "(python3)" at once,
# then held there until the test says go (no sleep a busy machine could outrun).
PRE_EXEC = """
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(15, b"(python3)", 0, 0, 0)  # PR_SET_NAME
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
if sys.argv[3] == "exec":
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "--port", "30000"])
"""


class Child:
    """A process held in systemd's pre-exec state until :meth:`go`; killed on exit."""

    def __init__(self, tmp_path: Path, then: str) -> None:
        renamed, self.go_file = tmp_path / "renamed", tmp_path / "go"
        self.proc = subprocess.Popen([sys.executable, "-c", PRE_EXEC, str(renamed), str(self.go_file), then])
        deadline = time.time() + 60
        while not renamed.exists():
            assert self.proc.poll() is None and time.time() < deadline, "the child did not start"
            time.sleep(0.01)
        self.pid = self.proc.pid

    def go(self) -> None:
        self.go_file.touch()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def test_the_argv_is_the_exec_d_commands_not_the_forked_managers(tmp_path: Path) -> None:
    with Child(tmp_path, "exec") as child:
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "(python3)"
        assert _unit_agent._pre_exec(child.pid)
        threading.Timer(0.3, child.go).start()  # the exec comes while the agent waits for it
        argv = _unit_agent._exec_argv(child.pid, timeout_s=120.0)
        assert argv == [sys.executable, "-c", "import time; time.sleep(60)", "--port", "30000"], argv


def test_a_child_that_dies_before_its_exec_gives_no_argv(tmp_path: Path) -> None:
    with Child(tmp_path, "exit") as child:
        child.go()
        assert _unit_agent._exec_argv(child.pid, timeout_s=120.0) == []


def test_a_child_that_never_execs_gives_no_argv_at_the_timeout(tmp_path: Path) -> None:
    with Child(tmp_path, "stay") as child:
        assert _unit_agent._exec_argv(child.pid, timeout_s=1.0) == []
        assert _unit_agent._pre_exec(child.pid)  # still held: the [] is the timeout's
