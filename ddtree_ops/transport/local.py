"""LocalTransport: the Transport protocol on this machine, with subprocess and os.

Used for ``ansible_connection: local`` hosts (the simulated demo fleet) and as the
reference implementation that the SSH transport is tested against (same test
functions, both transports). It behaves like the SSH transport wherever a caller could
tell: a missing executable is exit code 127 rather than an exception (that is what a
remote shell answers), ``~`` in paths means the home directory, and file operations
raise :class:`RemoteFileError` naming the host and path.

Each command runs in a session (and so process group) of its own, as sshd starts a
remote command, and a command that outlives its ``timeout`` is ended as a whole: SIGTERM
to its group, SIGKILL after :data:`KILL_GRACE_S` — children and grandchildren included,
not only the direct child. A process that left the group on purpose (``setsid``,
``start_new_session``: a launched server) is never touched.
"""

from __future__ import annotations

import errno
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path

from ddtree_ops.errors import CommandFailed, CommandTimeout, Interrupted, RemoteFileError
from ddtree_ops.fsutil import open_regular, write_atomic_local
from ddtree_ops.transport.base import (
    Command,
    CommandResult,
    LineCallback,
    LineFeed,
    RoundTripCounter,
    Script,
    command_text,
    interrupted,
    os_error_reason,
)
from ddtree_ops.transport.translate import translate_errors

# How long a timed-out command's process group gets between SIGTERM and SIGKILL (the SSH
# transport uses the same grace).
KILL_GRACE_S = 2.0


class LocalTransport:
    """Runs commands as child processes of this one; files through os."""

    def __init__(self, name: str = "localhost", *, counter: RoundTripCounter | None = None) -> None:
        self.host = name
        self.counter = counter

    def __enter__(self) -> LocalTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing is held open between calls."""

    def _count(self, kind: str, what: str) -> None:
        if self.counter is not None:
            self.counter.record(self.host, kind, what)

    def run(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = False,
        cwd: str | None = None,
        on_line: LineCallback | None = None,
    ) -> CommandResult:
        text = command_text(command)
        self._count("command", text)
        if isinstance(command, Script):
            argv = list(command.argv)
            stdin = command.source + command.extra_stdin
        else:
            argv = list(command)
            stdin = ""
        if not argv:
            raise ValueError("empty command")
        full_env = None
        if env:
            full_env = dict(os.environ)
            full_env.update(env)
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=full_env,
                cwd=expand_path(cwd) if cwd else None,
                start_new_session=True,
            )
        except (FileNotFoundError, NotADirectoryError) as exc:
            # A cwd that is missing or a file fails like the command would in a shell (the
            # SSH transport's `cd || exit 1`, then `exec`): exit 1, else 127, never a raw OSError.
            reason = "Not a directory" if isinstance(exc, NotADirectoryError) else "No such file or directory"
            if cwd and not Path(expand_path(cwd)).is_dir():
                result = CommandResult(1, "", f"cd: {cwd}: {reason}\n", time.monotonic() - start)
            elif isinstance(exc, NotADirectoryError):
                result = CommandResult(127, "", f"{argv[0]}: {reason}\n", time.monotonic() - start)
            else:
                result = CommandResult(127, "", f"{argv[0]}: command not found\n", time.monotonic() - start)
        except PermissionError:
            result = CommandResult(126, "", f"{argv[0]}: Permission denied\n", time.monotonic() - start)
        except OSError as exc:
            # Whatever else the chdir or the exec refused: what the SSH transport's shell
            # says, exit 1 for the directory; for the command 127 where its name leads to no
            # program (longer than the system allows, a loop of links; as sh's exec), 126
            # where the program cannot run (an argument list too long, a binary for another
            # machine).
            reason = exc.strerror or type(exc).__name__
            if cwd and exc.filename == expand_path(cwd):
                result = CommandResult(1, "", f"cd: {cwd}: {reason}\n", time.monotonic() - start)
            else:
                code = 127 if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP) else 126
                result = CommandResult(code, "", f"{argv[0]}: {reason}\n", time.monotonic() - start)
        else:
            try:
                feed = LineFeed(on_line) if on_line is not None else None
                out, err = _communicate_lines(proc, stdin.encode(), timeout, feed)
            except subprocess.TimeoutExpired as exc:
                _end_group(proc)
                raise CommandTimeout(
                    f"command did not finish within {timeout:g}s (ended: process group {proc.pid} terminated): "
                    f"{text[:200]}",
                    host=self.host,
                    timeout=timeout,
                ) from exc
            except BaseException:
                # Interrupted (Ctrl-C): the command runs in its own session, so the terminal's
                # SIGINT did not reach it; end it here rather than leave it behind.
                _end_group(proc)
                raise
            result = CommandResult(
                proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - start
            )
        if check and result.returncode != 0:
            raise CommandFailed(result.returncode, text, result.stderr, host=self.host)
        return result

    def _file_op(self, doing: str) -> AbstractContextManager[None]:
        """The same translation, table and messages as the SSH transport's file operations."""
        return translate_errors(self.host, doing, error=RemoteFileError, reason=os_error_reason)

    def read_bytes(self, path: str) -> bytes:
        self._count("read", path)
        with self._file_op(f"cannot read {path}"):
            # Only a regular file: a FIFO where a file is expected (a placed policy, a
            # launch record) would block the command forever.
            with os.fdopen(open_regular(expand_path(path)), "rb") as fh:
                return fh.read()

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._count("write", path)
        with self._file_op(f"cannot write {path}"):
            write_atomic_local(Path(expand_path(path)), data, mode=mode)

    def exists(self, path: str) -> bool:
        self._count("stat", path)
        return os.path.lexists(expand_path(path))


# How often a waiting command looks whether it is being ended (transport.base.interrupting).
_INTERRUPT_POLL_S = 0.25


def _communicate_lines(
    proc: subprocess.Popen[bytes], data: bytes, timeout: float | None, feed: LineFeed | None
) -> tuple[bytes, bytes]:
    """``communicate`` that hands stdout to ``feed`` (if any) as it arrives. Raises
    subprocess.TimeoutExpired past ``timeout``, like ``communicate``, so that the caller
    ends the group the same way, and Interrupted while commands are being ended
    (:func:`~ddtree_ops.transport.base.interrupting`)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    deadline = None if timeout is None else time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    pos = 0
    with selectors.DefaultSelector() as sel:
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        while sel.get_map():
            if interrupted():
                raise Interrupted("interrupted: the command was ended")
            wait = _INTERRUPT_POLL_S if deadline is None else min(_INTERRUPT_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout or 0.0)
            for key, _ in sel.select(wait):
                if key.fileobj is proc.stdin:
                    try:
                        pos += os.write(key.fd, data[pos : pos + 65536])
                    except BrokenPipeError:
                        pos = len(data)  # the program stopped reading: what it has is what it gets
                    if pos >= len(data):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is proc.stdout:
                    out.extend(chunk)
                    if feed is not None:
                        feed.feed(chunk)
                else:
                    err.extend(chunk)
    if feed is not None:
        feed.close()
    proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return bytes(out), bytes(err)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's process group, SIGKILL after the grace, then reap it.

    The group id is the child's pid (it is a session leader); it cannot be reused while
    any member is left, so signalling it never reaches an unrelated process."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        proc.poll()  # reap the direct child, or it stays in the group as a zombie
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def expand_path(path: str) -> str:
    """``~`` and ``~/x`` mean the home directory, as they do for a remote login shell."""
    return os.path.expanduser(path)
