"""The test servers' ports stay out of the range outgoing connections take theirs from."""

from __future__ import annotations

import socket
from pathlib import Path

from testports import RESERVED, free_port


def test_ports_are_below_the_ephemeral_range_free_and_never_given_twice() -> None:
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    given = [free_port() for _ in range(50)]
    assert len(set(given)) == len(given)
    assert all(p < ephemeral and p not in RESERVED for p in given), given
    base = free_port(3)
    held = []
    try:
        for port in range(base, base + 3):  # the whole span binds
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()
    assert not set(range(base, base + 3)) & set(given)
