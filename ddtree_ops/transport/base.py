"""The Transport protocol: the one way ddtree-ops touches a host.

Two implementations share it: :mod:`.ssh` (paramiko) and :mod:`.local` (subprocess/os).
Everything above this layer sees only :class:`CommandResult` and the exception tree in
:mod:`ddtree_ops.errors`; foreign exceptions are translated inside the implementations.

Commands are argv lists (quoted with :func:`shlex.join` where a shell is unavoidable) or
a :class:`Script`: a Python/shell program sent on stdin to an interpreter named by argv,
so that no user value is ever pasted into shell syntax.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# Ctrl-C reaches only the main thread. A fan-out's workers, each waiting on a command, never
# see it, and the pool's shutdown then waits for every remote program to end by itself
# (minutes for a selftest --e2e). While this is set, every transport's run() ends the
# command it waits on (its process group, as on a Ctrl-C in its own thread) and raises
# Interrupted.
_INTERRUPT = threading.Event()


@contextmanager
def interrupting() -> Iterator[None]:
    """Inside the block, commands being waited on in any thread are ended (see above)."""
    _INTERRUPT.set()
    try:
        yield
    finally:
        _INTERRUPT.clear()


def interrupted() -> bool:
    """Whether commands are being ended (:func:`interrupting`)."""
    return _INTERRUPT.is_set()


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str
    duration: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class Script:
    """A program fed on stdin to ``argv`` (e.g. ``["python3", "-"]`` or ``["sh", "-s", "--", arg1]``).

    Values reach the program as argv entries or through ``extra_stdin`` (sent right after
    ``source``); the program text itself is a constant of ours. With ``extra_stdin`` the
    interpreter must not read ahead past its program: ``bash -s`` is fine, but ``sh -s``
    (dash) and ``python -`` read ahead and would treat the data as code — for those, use
    a small ``-c`` bootstrap that reads all of stdin and splits it at a separator
    (:mod:`.hostprogram`, the framing of every Python program ddtree-ops runs on a host).
    """

    argv: tuple[str, ...]
    source: str
    extra_stdin: str = ""


Command = Sequence[str] | Script
# Called with each complete stdout line (without its newline) as it arrives, in the
# calling thread, while the command still runs.
LineCallback = Callable[[str], None]


@runtime_checkable
class Transport(Protocol):
    """What a host connection offers. Implementations must be usable as context managers."""

    host: str

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
        """Run a command; raise CommandFailed if ``check`` and it exits non-zero,
        CommandTimeout past ``timeout`` seconds — after ending the command and everything
        it spawned (SIGTERM to its process group, SIGKILL after a short grace); processes
        that detached into a session of their own are left running.

        ``on_line`` streams: it receives each stdout line as soon as it is complete (a
        last line without a newline when the command ends), so that a long command can
        report progress (the on-host benchmark client sends one line per request). The
        result's ``stdout`` still holds everything. An exception raised by ``on_line``
        ends the command as Ctrl-C would and propagates."""
        ...

    def read_bytes(self, path: str) -> bytes: ...

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write to a temp file in the same directory, fsync, then posix-rename over ``path``."""
        ...

    def exists(self, path: str) -> bool: ...

    def close(self) -> None: ...

    def __enter__(self) -> Transport: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass
class RoundTripCounter:
    """Counts remote round trips; tests and benchmarks read it to prove 'one command per host'."""

    commands: int = 0
    file_ops: int = 0
    log: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.commands + self.file_ops

    def record(self, host: str, kind: str, what: str) -> None:
        """``kind`` is "command" for a remote command, anything else is a file operation."""
        if kind == "command":
            self.commands += 1
        else:
            self.file_ops += 1
        self.log.append(f"{host} {kind}: {what}")


def command_text(command: Command) -> str:
    """The command as one shell-quoted line, for logs, error messages and the SSH exec request."""
    import shlex

    if isinstance(command, Script):
        return shlex.join(command.argv)
    return shlex.join(list(command))


def os_error_reason(exc: BaseException) -> str:
    """The same short reason for a failed file operation, whichever transport hit it."""
    import errno

    if isinstance(exc, OSError):
        if exc.errno == errno.ENOENT:
            return "no such file or directory"
        if exc.errno == errno.EACCES:
            return "permission denied"
        if exc.errno == errno.ENOTDIR:
            return "a parent is not a directory"
        return exc.strerror or str(exc) or type(exc).__name__
    return str(exc)


class LineFeed:
    """Cuts a command's stdout bytes into lines for an ``on_line`` callback; both
    transports use it, so a line means the same thing on each (a partial last line is
    delivered by :meth:`close`)."""

    def __init__(self, on_line: LineCallback) -> None:
        self.on_line = on_line
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf.extend(data)
        while (end := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            self.on_line(line.decode(errors="replace"))

    def close(self) -> None:
        if self._buf:
            line, self._buf = bytes(self._buf), bytearray()
            self.on_line(line.decode(errors="replace"))
