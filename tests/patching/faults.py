"""Fault-injecting transports for the patch engine's tests (real work underneath, real errors on top)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddtree_ops.errors import ConnectError
from ddtree_ops.transport.base import Command, CommandResult, Script, Transport


class CuttingTransport:
    """Behaves like ``inner`` until the ``cut_at``-th command (0-based), where the connection 'drops'.

    ``when="before"``: the command never reaches the host. ``when="after"``: it ran to the
    end on the host, but its answer is lost. Both are what a cut network looks like.
    """

    def __init__(self, inner: Transport, cut_at: int, when: str = "before") -> None:
        self.inner = inner
        self.host = inner.host
        self.cut_at = cut_at
        self.when = when
        self.calls = 0

    def run(self, command: Command, **kw: Any) -> CommandResult:
        i = self.calls
        self.calls += 1
        if i == self.cut_at and self.when == "before":
            raise ConnectError("connection lost (injected before the command)", host=self.host)
        res = self.inner.run(command, **kw)
        if i == self.cut_at and self.when == "after":
            raise ConnectError("connection lost (injected after the command)", host=self.host)
        return res

    def read_bytes(self, path: str) -> bytes:
        return self.inner.read_bytes(path)

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self.inner.write_atomic(path, data, mode=mode)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> CuttingTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PausingTransport(CuttingTransport):
    """Stops before the ``cut_at``-th command until released: holds a deploy mid-flight, deterministically."""

    def __init__(self, inner: Transport, pause_at: int) -> None:
        super().__init__(inner, cut_at=pause_at, when="none")
        self.reached = threading.Event()
        self.release = threading.Event()

    def run(self, command: Command, **kw: Any) -> CommandResult:
        if self.calls == self.cut_at:
            self.reached.set()
            self.release.wait(60)
        return super().run(command, **kw)


# Inserted into the host program of one step, before its entry point: the step's first
# ``file_sha`` call (the first file hash a gather reads) announces itself by creating
# ``reached`` and waits for ``release`` to exist. Files, because the step is another process.
_HOLD_AT_FIRST_HASH = '''
import os as _hold_os, time as _hold_time
_held_file_sha = file_sha
_hold_first = [True]
def file_sha(pkg, rel):
    if _hold_first[0]:
        _hold_first[0] = False
        open(%(reached)r, "w").close()
        _hold_until = _hold_time.monotonic() + 120
        while not _hold_os.path.exists(%(release)r) and _hold_time.monotonic() < _hold_until:
            _hold_time.sleep(0.01)
    return _held_file_sha(pkg, rel)
'''
_ENTRY = 'if __name__ == "__main__":'


class HoldInsideGather(CuttingTransport):
    """Holds the ``hold_at``-th command (0-based; it must be a ``gather`` step) inside the
    host program, just before it reads its first file hash (after the state record), until
    released: a deploy's gather held between reading the state record and hashing the files,
    deterministically. The step runs in its own process, so the hold is signalled through
    files in ``tmp``: :meth:`wait_reached` polls for the step having got there."""

    def __init__(self, inner: Transport, hold_at: int, tmp: Path) -> None:
        super().__init__(inner, cut_at=hold_at, when="none")
        self._reached = tmp / "gather-held"
        self._release = tmp / "gather-release"

    def run(self, command: Command, **kw: Any) -> CommandResult:
        if self.calls == self.cut_at:
            assert isinstance(command, Script) and json.loads(command.extra_stdin)["step"] == "gather", command
            assert _ENTRY in command.source
            hook = _HOLD_AT_FIRST_HASH % {"reached": str(self._reached), "release": str(self._release)}
            command = replace(command, source=command.source.replace(_ENTRY, hook + _ENTRY, 1))
        return super().run(command, **kw)

    def wait_reached(self, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self._reached.exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def release(self) -> None:
        self._release.touch()
