"""The Transport protocol: the one way ddtree-ops touches a host.

Two implementations share it: :mod:`.ssh` (paramiko) and :mod:`.local` (subprocess/os).
Everything above this layer sees only :class:`CommandResult` and the exception tree in
:mod:`ddtree_ops.errors`; foreign exceptions are translated inside the implementations.

Commands are argv lists (quoted with :func:`shlex.join` where a shell is unavoidable) or
a :class:`Script`: a Python/shell program sent on stdin to an interpreter named by argv,
so that no user value is ever pasted into shell syntax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


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
    a small ``-c`` bootstrap that reads all of stdin and splits it at a separator.
    """

    argv: tuple[str, ...]
    source: str
    extra_stdin: str = ""


Command = Sequence[str] | Script


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
    ) -> CommandResult:
        """Run a command; raise CommandFailed if ``check`` and it exits non-zero,
        CommandTimeout past ``timeout`` seconds — after ending the command and everything
        it spawned (SIGTERM to its process group, SIGKILL after a short grace); processes
        that detached into a session of their own are left running."""
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
