"""Fault-injecting transports for the patch engine's tests (real work underneath, real errors on top)."""

from __future__ import annotations

import threading
from typing import Any

from ddtree_ops.errors import ConnectError
from ddtree_ops.transport.base import Command, CommandResult, Transport


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
