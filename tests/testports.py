"""Ports for the servers the tests start: below the kernel's ephemeral range, one slice per
pytest-xdist worker.

``bind(("127.0.0.1", 0))`` hands out a port from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the range every outgoing connection on the
machine also takes its local port from. A test server that is stopped and launched again
on its port (a restart, a sweep's relaunch) leaves that port free for a moment, and a
client connection of the other worker can take it then: the relaunch fails with the
address in use, a failure of the machine's load rather than of the code. Ports below the
range are never given to connections; a slice per worker keeps two workers from picking
the same one; a process never hands out a port twice.
"""

from __future__ import annotations

import functools
import os
import random
import socket
import threading
from pathlib import Path

# `make demo`'s servers (inventories/local.yaml): a demo running beside the suite keeps them.
RESERVED = frozenset({30100, 30101, 30200})
LOW = 20000  # below: registered services (and other tools' test servers) are likelier


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


@functools.cache  # the range and the worker do not change within a process
def _worker_slice() -> range:
    high = max(LOW + 1000, _ephemeral_start())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker) % count if worker.isdigit() else 0
    width = (high - LOW) // count
    return range(LOW + index * width, LOW + (index + 1) * width)


_lock = threading.Lock()
_given: set[int] = set()
# Each process starts at a random place in its slice: two pytest runs side by side (a
# lane beside a main suite) rarely walk the same ports.
_cursor = -1


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port that is free now, with the ``count - 1`` ports after it free too; never one
    this process gave before."""
    global _cursor
    ports = _worker_slice()
    with _lock:
        if _cursor < 0:
            _cursor = random.randrange(len(ports))
        for _ in range(len(ports)):
            base = ports.start + _cursor % len(ports)
            _cursor += 1
            span = range(base, base + count)
            if span.stop > ports.stop or any(p in _given or p in RESERVED for p in span):
                continue
            if all(_bindable(p) for p in span):
                _given.update(span)
                return base
    raise RuntimeError(f"no {count} free port(s) left in {ports}")


__all__ = ["free_port"]
