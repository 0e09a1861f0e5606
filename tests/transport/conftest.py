"""The `any_transport` fixture: the same test functions run against LocalTransport and SSHTransport."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddtree_ops.transport import RoundTripCounter, Transport, open_transport


@dataclass
class TransportCase:
    transport: Transport
    scratch: str  # an absolute directory on the host, empty, for this test
    home: Path  # what `~` means on the host (the fleet host's HOME, or a tmp HOME locally)
    python: str
    counter: RoundTripCounter


@pytest.fixture(params=["local", "ssh"])
def any_transport(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[TransportCase]:
    counter = RoundTripCounter()
    if request.param == "local":
        home = tmp_path / "home"
        home.mkdir()
        monkeypatch.setenv("HOME", str(home))
        import sys

        from ddtree_ops.inventory_types import Host

        transport = open_transport(Host("local-test", connection="local"), counter=counter)
        scratch = tmp_path / "scratch"
        python = sys.executable
    else:
        fleet = request.getfixturevalue("ssh_fleet")
        fhost = fleet.hosts[0]
        host = fleet.load().hosts[fhost.name]
        transport = open_transport(host, counter=counter)
        scratch = fhost.run_dir / "scratch" / request.node.name.replace("/", "_")
        home = fhost.server.home
        python = str(fhost.python)
    scratch.mkdir(parents=True, exist_ok=True)
    with transport:
        yield TransportCase(transport, str(scratch), home, python, counter)
