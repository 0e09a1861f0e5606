"""The Transport protocol over a connection Ansible already holds to a host.

An Ansible action plugin can run a shell command line on its host with bytes on stdin
(``ActionBase._low_level_execute_command``: the play's connection, ``become``, its ssh
arguments and multiplexing, the vault-decrypted variables). That is all the toolkit needs:
every program it runs on a host is a constant ``python -c BOOTSTRAP`` with the program and
its payload on stdin (:mod:`ddtree_ops.transport.hostprogram`), so this transport sends
exactly what the SSH transport sends, and the host cannot tell which tool ran it.

The connection is reached through one callable (:data:`Execute`), so this module never
imports Ansible. What the SSH transport does with a process group this one does with the
host's coreutils: a ``timeout`` ends a command (and what it spawned: ``timeout`` runs it in a
group of its own) that outlives its deadline; a launched server, in a session of its own, is
left running. Without ``timeout`` on the host a command runs unbounded, as Ansible's own
tasks do (their ``timeout`` keyword bounds the whole task). Files are read and written with
``cat``/``mv`` in the same way (regular files only, atomic replace).

Every command is given some stdin: Ansible's ssh connection asks for a terminal (``-tt``)
when there is none to send, and a terminal would merge stderr into stdout and turn line
ends into CRLF.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Mapping

from ddtree_ops.errors import CommandFailed, CommandTimeout, RemoteFileError
from ddtree_ops.transport.base import (
    Command,
    CommandResult,
    LineCallback,
    LineFeed,
    RoundTripCounter,
    Script,
    command_text,
)

#: Runs one shell command line on the host with ``stdin`` (never empty) and answers
#: (exit code, stdout, stderr); raises :class:`~ddtree_ops.errors.TransportError` (the
#: caller translates its connection's own failures, e.g. ConnectError for unreachable).
Execute = Callable[[str, bytes], tuple[int, bytes, bytes]]

# Run as ``sh -c _PROLOGUE sh TIMEOUT CWD NOSTDIN ARGV...``: every value a positional
# parameter, never shell text (as the SSH transport's prologue). NOSTDIN 1: the command
# reads /dev/null, not the byte sent only to keep the connection off a terminal.
_PROLOGUE = (
    't=$1; d=$2; n=$3; shift 3; '
    'case $d in "~") d=$HOME ;; "~/"*) d=$HOME/${d#??} ;; esac; '
    'if [ -n "$d" ]; then cd -- "$d" || exit 1; fi; '
    'if [ "$n" = 1 ]; then exec </dev/null; fi; '
    'if [ "$t" != 0 ] && command -v timeout >/dev/null 2>&1; then exec timeout -k 2 "$t" "$@"; fi; '
    'exec "$@"'
)
# The exit codes of coreutils' ``timeout`` when it ended the command (TERM; KILL after -k).
_TIMED_OUT = (124, 137)
_EXPAND = 'case $p in "~") p=$HOME ;; "~/"*) p=$HOME/${p#??} ;; esac; '
# ``sh -c _READ sh PATH``: a regular file's bytes on stdout; exit 3 with the reason on stderr.
_READ = (
    "p=$1; " + _EXPAND
    + 'if [ ! -e "$p" ] && [ ! -L "$p" ]; then echo "no such file or directory" >&2; exit 3; fi; '
    'if [ ! -f "$p" ]; then echo "not a regular file" >&2; exit 3; fi; '
    'exec cat -- "$p"'
)
# ``sh -c _WRITE sh PATH MODE EMPTY``: stdin into a temp file beside PATH, fsynced, renamed over it.
_WRITE = (
    "p=$1; m=$2; e=$3; " + _EXPAND
    + 'dir=$(dirname -- "$p"); base=$(basename -- "$p"); '
    'mkdir -p -- "$dir" || exit 3; '
    't="$dir/.$base.$$.tmp"; '
    'if [ "$e" = 1 ]; then : > "$t"; else cat > "$t"; fi || { rm -f -- "$t"; exit 3; }; '
    'chmod "$m" "$t" || { rm -f -- "$t"; exit 3; }; '
    '{ sync -- "$t" 2>/dev/null || true; }; '
    'mv -f -- "$t" "$p" || { rm -f -- "$t"; exit 3; }'
)
_EXISTS = "p=$1; " + _EXPAND + '[ -e "$p" ] || [ -L "$p" ]'


def command_line(command: Command, *, timeout: float | None = None, env: Mapping[str, str] | None = None,
                 cwd: str | None = None) -> tuple[str, bytes]:
    """The shell line and stdin that run ``command`` (pure)."""
    if isinstance(command, Script):
        argv = list(command.argv)
        stdin = (command.source + command.extra_stdin).encode()
    else:
        argv = list(command)
        stdin = b""
    if not argv:
        raise ValueError("empty command")
    if env:
        argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    limit = "0" if timeout is None else f"{max(timeout, 0.001):.3f}"
    line = "exec " + shlex.join(["sh", "-c", _PROLOGUE, "sh", limit, cwd or "", "0" if stdin else "1", *argv])
    return line, stdin or b"\n"


def _reason(stderr: bytes) -> str:
    text = stderr.decode(errors="replace").strip()
    if "Permission denied" in text:
        return "permission denied"
    if "Not a directory" in text:
        return "a parent is not a directory"
    return text.splitlines()[-1] if text else "failed"


class ConnectionTransport:
    """A :class:`~ddtree_ops.transport.base.Transport` over ``execute`` (module docstring)."""

    def __init__(self, name: str, execute: Execute, *, counter: RoundTripCounter | None = None) -> None:
        self.host = name
        self._execute = execute
        self.counter = counter

    def __enter__(self) -> ConnectionTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """The connection is Ansible's: nothing of ours to close."""

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
        line, stdin = command_line(command, timeout=timeout, env=env, cwd=cwd)
        start = time.monotonic()
        code, out, err = self._execute(line, stdin)
        elapsed = time.monotonic() - start
        if timeout is not None and code in _TIMED_OUT and elapsed >= timeout:
            raise CommandTimeout(f"command did not finish within {timeout:g}s (ended by the host's timeout): "
                                 f"{text[:200]}", host=self.host, timeout=timeout)
        if on_line is not None:
            # Ansible answers once the command ended: its lines are handed on then, in order.
            feed = LineFeed(on_line)
            feed.feed(out)
            feed.close()
        result = CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"), elapsed)
        if check and result.returncode != 0:
            raise CommandFailed(result.returncode, text, result.stderr, host=self.host)
        return result

    def _sh(self, program: str, *args: str, stdin: bytes = b"\n") -> tuple[int, bytes, bytes]:
        return self._execute("exec " + shlex.join(["sh", "-c", program, "sh", *args]), stdin)

    def read_bytes(self, path: str) -> bytes:
        self._count("read", path)
        code, out, err = self._sh(_READ, path)
        if code != 0:
            raise RemoteFileError(f"cannot read {path}: {_reason(err)}", host=self.host)
        return out

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._count("write", path)
        code, _out, err = self._sh(_WRITE, path, f"{mode:o}", "0" if data else "1", stdin=data or b"\n")
        if code != 0:
            raise RemoteFileError(f"cannot write {path}: {_reason(err)}", host=self.host)

    def exists(self, path: str) -> bool:
        self._count("stat", path)
        code, _out, _err = self._sh(_EXISTS, path)
        return code == 0


__all__ = ["ConnectionTransport", "Execute", "command_line"]
