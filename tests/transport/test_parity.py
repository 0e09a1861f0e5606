"""Transport parity: each test runs on LocalTransport and on SSHTransport against real sshd."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

from ddtree_ops.errors import CommandFailed, CommandTimeout, RemoteFileError
from ddtree_ops.transport import Script


def hostile(marker: Path) -> list[str]:
    """Arguments a shell would act on; any of them reaching a shell creates ``marker``."""
    return [
        "two words",
        "it's",
        'say "hi"',
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"a; touch {marker}",
        "x && false || true",
        "$HOME ${PATH} \\n *",
        "-n",
        "",
        "tab\there",
        "ünïcödé ✓",
    ]


def test_argv_reaches_the_command_as_data(any_transport, tmp_path: Path) -> None:
    t = any_transport.transport
    marker = tmp_path / "pwned"
    args = hostile(marker)
    result = t.run(["printf", "%s\\n", *args])
    assert result.returncode == 0
    assert result.stdout.split("\n")[:-1] == args
    assert not marker.exists()


def test_script_on_stdin_with_hostile_argv(any_transport, tmp_path: Path) -> None:
    src = "import json, sys\nprint(json.dumps(sys.argv[1:]))\n"
    marker = tmp_path / "pwned"
    args = hostile(marker)
    result = any_transport.transport.run(Script((any_transport.python, "-", *args), src), check=True)
    import json

    assert json.loads(result.stdout) == args
    assert not marker.exists()


def test_shell_script_with_extra_stdin(any_transport) -> None:
    # `bash -s` reads its program from a pipe line by line, so the program can read the
    # rest of stdin as data. (dash and python read ahead: see Script's docstring.)
    script = Script(
        ("bash", "-s", "--", "arg one"), 'printf "%s|" "$1"; read -r line; printf "%s\\n" "$line"\n', "data $(x)\n"
    )
    result = any_transport.transport.run(script, check=True)
    assert result.stdout == "arg one|data $(x)\n"


def test_exit_codes_and_check(any_transport) -> None:
    t = any_transport.transport
    result = t.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.ok
    with pytest.raises(CommandFailed) as info:
        t.run(["sh", "-c", "echo first >&2; echo 'the reason' >&2; exit 4"], check=True)
    assert info.value.returncode == 4
    assert "the reason" in str(info.value) and "exit code 4" in str(info.value)
    assert str(info.value).startswith(f"{t.host}: ")


def test_missing_executable_is_127(any_transport) -> None:
    result = any_transport.transport.run(["ddtree-ops-no-such-binary", "x"])
    assert result.returncode == 127


def test_a_program_that_exits_before_reading_its_stdin_gives_its_exit_code(any_transport) -> None:
    # 16 MiB is far past any SSH channel window, so the send is still under way when the
    # program exits and the server closes the channel: over SSH that once read as a lost
    # connection (a missing interpreter looked like a dead host, now and then).
    script = Script(("sh", "-c", "echo gone; exit 3"), "#" * (16 << 20))
    result = any_transport.transport.run(script, timeout=60)
    assert (result.returncode, result.stdout) == (3, "gone\n")
    missing = any_transport.transport.run(Script(("/nonexistent/python", "-"), "#" * (16 << 20)), timeout=60)
    assert missing.returncode == 127
    assert any_transport.transport.run(["true"]).returncode == 0  # the connection is still good


def test_a_file_where_a_directory_should_be_is_an_exit_code_not_an_exception(any_transport) -> None:
    t = any_transport.transport
    a_file = os.path.join(any_transport.scratch, "plain-file")
    t.write_atomic(a_file, b"x")
    in_file = t.run(["pwd"], cwd=a_file)
    assert in_file.returncode == 1 and in_file.stdout.strip() == "", in_file
    through_file = t.run([a_file + "/python", "-V"])
    assert through_file.returncode == 127, through_file


def test_env_and_cwd(any_transport) -> None:
    t = any_transport.transport
    result = t.run(
        ["sh", "-c", 'printf "%s\\n" "$DDT_A" "$DDT_B"; pwd'],
        env={"DDT_A": "v $(id) ;", "DDT_B": "2"},
        cwd=any_transport.scratch,
    )
    assert result.stdout.split("\n")[:3] == ["v $(id) ;", "2", os.path.realpath(any_transport.scratch)]
    home = t.run(["pwd"], cwd="~").stdout.strip()
    assert os.path.realpath(home) == os.path.realpath(any_transport.home)


def test_timeout_then_transport_still_works(any_transport) -> None:
    t = any_transport.transport
    with pytest.raises(CommandTimeout) as info:
        t.run(["sleep", "30"], timeout=0.5)
    assert info.value.timeout == 0.5
    assert t.run(["echo", "alive"]).stdout == "alive\n"


def test_large_output_on_both_streams(any_transport) -> None:
    # Enough to fill every pipe/window buffer: a reader that waits for exit would deadlock.
    src = "import sys\nsys.stdout.write('o' * 3_000_000)\nsys.stderr.write('e' * 3_000_000)\n"
    result = any_transport.transport.run(Script((any_transport.python, "-"), src), timeout=60)
    assert len(result.stdout) == 3_000_000 and len(result.stderr) == 3_000_000


def test_write_atomic_read_back_mode_and_replace(any_transport) -> None:
    t = any_transport.transport
    path = f"{any_transport.scratch}/deep/er/file with 'quotes' $(x).bin"
    payload = bytes(range(256)) * 1000
    t.write_atomic(path, payload, mode=0o600)
    assert t.read_bytes(path) == payload
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    t.write_atomic(path, b"second", mode=0o755)
    assert t.read_bytes(path) == b"second"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    # Nothing but the file itself is left in the directory (no temp files).
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


def test_write_atomic_never_shows_a_partial_file(any_transport) -> None:
    """The old inode stays intact while the new content is written: a reader holding it
    open sees the complete old content, never a truncated mix."""
    t = any_transport.transport
    path = f"{any_transport.scratch}/f.txt"
    t.write_atomic(path, b"old" * 1000)
    with open(path, "rb") as held:
        t.write_atomic(path, b"new" * 5000)
        assert held.read() == b"old" * 1000
    assert t.read_bytes(path) == b"new" * 5000


def test_tilde_paths_mean_home(any_transport) -> None:
    t = any_transport.transport
    t.write_atomic("~/.ddtree-ops-test/x.txt", b"at home")
    assert (any_transport.home / ".ddtree-ops-test" / "x.txt").read_bytes() == b"at home"
    assert t.exists("~/.ddtree-ops-test/x.txt")
    assert t.read_bytes("~/.ddtree-ops-test/x.txt") == b"at home"


def test_missing_files(any_transport) -> None:
    t = any_transport.transport
    missing = f"{any_transport.scratch}/nope.txt"
    assert not t.exists(missing)
    with pytest.raises(RemoteFileError, match=r"cannot read .*nope\.txt: no such file"):
        t.read_bytes(missing)
    Path(any_transport.scratch, "afile").write_text("x")
    with pytest.raises(RemoteFileError, match="cannot write"):
        t.write_atomic(f"{any_transport.scratch}/afile/child.txt", b"x")  # parent is a file


def test_counter_counts_commands_and_file_ops(any_transport) -> None:
    t, counter = any_transport.transport, any_transport.counter
    t.run(["true"])
    t.run(Script(("sh", "-s"), "true\n"))
    t.write_atomic(f"{any_transport.scratch}/c", b"1")
    t.read_bytes(f"{any_transport.scratch}/c")
    t.exists(f"{any_transport.scratch}/c")
    assert (counter.commands, counter.file_ops) == (2, 3)
    assert counter.log[0] == f"{t.host} command: true"


# Forks one child that sleeps and one that ignores SIGTERM (only SIGKILL ends it), starts a
# detached process in a session of its own (as the service manager launches a server),
# writes all their pids, then waits far longer than any timeout.
_SPAWNER = """\
import os, signal, subprocess, sys, time
pids = [os.getpid()]
for ignore_term in (False, True):
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before fork: no window without it
    pid = os.fork()
    if pid == 0:
        time.sleep(300)
        os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    pids.append(pid)
detached = subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(" ".join(map(str, pids)) + "\\n" + str(detached.pid) + "\\n")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
if sys.argv[2] == "wait":
    time.sleep(300)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has already ended; only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until_gone(pids: list[int], within_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _read_pids(path: Path) -> tuple[list[int], int]:
    group, detached = path.read_text().splitlines()
    return [int(p) for p in group.split()], int(detached)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _assert_group_ended_detached_kept(t, pidfile: Path) -> None:
    """The spawner's process group is gone, its detached process lives on, and the
    transport still runs commands."""
    group, detached = _read_pids(pidfile)
    try:
        assert len(group) == 3
        assert _wait_until_gone(group) == []
        assert _running(detached)
        assert t.run(["echo", "alive"]).stdout == "alive\n"
    finally:
        _kill(detached)


def test_timeout_ends_the_whole_process_group(any_transport) -> None:
    """What an operator expects of a timeout: the command and everything it spawned are
    gone (a child that ignores SIGTERM too, after the grace), a process that detached
    itself into its own session (a launched server) is left alone, and the transport
    keeps working."""
    t = any_transport.transport
    pidfile = Path(any_transport.scratch, "pids")
    with pytest.raises(CommandTimeout) as info:
        t.run(Script((any_transport.python, "-", str(pidfile), "wait"), _SPAWNER), timeout=4)
    assert "ended: process group" in str(info.value)
    _assert_group_ended_detached_kept(t, pidfile)


def test_ctrl_c_ends_the_whole_process_group(any_transport) -> None:
    """Ctrl-C while a command runs ends it on the host too (SSH has no pty to carry the
    signal), then the interrupt reaches the caller; the transport keeps working."""
    t = any_transport.transport
    pidfile = Path(any_transport.scratch, "pids")

    main = threading.main_thread().ident
    assert main is not None

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 30
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        # A real SIGINT aimed at the main thread, as a terminal's Ctrl-C arrives: it
        # interrupts the blocking wait there.
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        t.run(Script((any_transport.python, "-", str(pidfile), "wait"), _SPAWNER), timeout=60)
    _assert_group_ended_detached_kept(t, pidfile)


def test_detached_process_survives_a_command_that_returns(any_transport) -> None:
    """The wrapper changes nothing for a command that finishes on time: what it launched
    in a session of its own keeps running (the service manager starts servers that way)."""
    t = any_transport.transport
    pidfile = Path(any_transport.scratch, "pids")
    # The forked children are killed by the command itself here: only the detached one matters.
    src = _SPAWNER + "for p in " + "pids[1:]" + ":\n    os.kill(p, signal.SIGKILL)\n"
    result = t.run(Script((any_transport.python, "-", str(pidfile), "return"), src), timeout=60)
    assert result.returncode == 0, result.stderr
    _, detached = _read_pids(pidfile)
    try:
        assert _running(detached)
    finally:
        _kill(detached)


def test_stdout_that_looks_like_the_prologue_is_kept(any_transport) -> None:
    # The SSH transport strips its own first line (the process group id); a command's
    # output that happens to look the same must come through byte for byte.
    payload = "ddtree-ops-pgid 123\nddtree-ops-pgid 456\n"
    result = any_transport.transport.run(["printf", "%s", payload])
    assert result.stdout == payload
    assert any_transport.transport.run(["printf", "x"]).stdout == "x"
    assert any_transport.transport.run(["true"]).stdout == ""
