"""Hosts that run the simulator, fast: small SIM_LOAD_S, fast SIM_TIME_SCALE.

``make_sim_host`` builds local hosts. ``sim_target`` is parametrised over
``transport_kind``: the same scenario runs once on this machine over the local transport
and once on a host of the SSH test fleet over real SSH. Everything a scenario does to the
host besides the lifecycle calls (signalling a pid, holding a port, reading a file,
asking the server over HTTP) goes through the transport too, so the SSH run exercises
the remote path end to end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from simhosts import sim_host

from ddtree_ops.inventory_types import Host
from ddtree_ops.service import lifecycle
from ddtree_ops.transport import Script, Transport, open_transport
from ddtree_ops.transport.local import LocalTransport

SimHostFactory = Callable[..., Host]


@pytest.fixture
def make_sim_host(tmp_path: Path) -> Iterator[SimHostFactory]:
    """Builds simulator hosts and stops whatever they launched when the test ends."""
    made: list[Host] = []

    def factory(**kwargs: object) -> Host:
        host = sim_host(tmp_path / f"run{len(made)}", **kwargs)  # type: ignore[arg-type]
        made.append(host)
        return host

    yield factory
    for host in made:
        if host.connection == "local":
            lifecycle.stop(LocalTransport(host.name), host, grace_s=2.0)


# Holds a port on the host like a foreign process would: binds, then detaches (new
# session, stdio closed so the SSH channel can end) and sleeps until signalled, with a
# cap so that a holder whose test died does not outlive the suite by much.
_PORT_HOLDER = """
import os, socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
pid = os.fork()
if pid:
    sys.stdout.write(str(pid))
    sys.exit(0)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
time.sleep(float(sys.argv[3]))
"""

# GET a URL from the host itself (the server binds the host's loopback); prints
# {"status": ..., "body": ...}. Stdlib only, like the service agent.
_HTTP_GET = """
import json, sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=10) as resp:
        out = {"status": resp.status, "body": resp.read().decode("utf-8", "replace")}
except urllib.error.HTTPError as exc:
    out = {"status": exc.code, "body": exc.read().decode("utf-8", "replace")}
sys.stdout.write(json.dumps(out))
"""


@dataclass
class SimTarget:
    """Where a transport-parametrised scenario runs: ``kind`` is "local" or "ssh"."""

    kind: str
    transport: Transport
    _run_root: Path
    _base: Host | None
    hosts: list[Host] = field(default_factory=list)
    holders: list[int] = field(default_factory=list)  # port holders not yet released

    def host(self, **kwargs: Any) -> Host:
        """A simulator host (``sim_host`` keywords); every server it launches is stopped at teardown."""
        made = sim_host(self._run_root / f"run{len(self.hosts)}", base=self._base, **kwargs)
        self.hosts.append(made)
        return made

    def open(self, host: Host) -> Transport:
        """A second, independent connection to the host (for another thread, or to prove
        the server outlives the connection that launched it)."""
        return open_transport(host)

    def signal_group(self, pid: int, sig: str, transport: Transport | None = None) -> None:
        """``kill -SIG -- -PID`` on the host: the process group the agent launched."""
        (transport or self.transport).run(["kill", f"-{sig}", "--", f"-{pid}"], timeout=30, check=True)

    def launch_record(self, host: Host) -> dict[str, Any]:
        return json.loads(self.transport.read_bytes(f"{host.ddtree.run_dir}/launch.json"))

    def http_get(self, host: Host, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{host.ddtree.server.port}{path}"
        result = self.transport.run(Script(argv=(host.python, "-", url), source=_HTTP_GET), timeout=30, check=True)
        data = json.loads(result.stdout)
        return int(data["status"]), str(data["body"])

    def server_info(self, host: Host) -> dict[str, Any]:
        status, body = self.http_get(host, "/server_info")
        assert status == 200, body
        return json.loads(body)

    def hold_port(self, host: Host, *, max_s: float = 120.0) -> int:
        """Start a process on the host that listens on the host's server port; returns its pid."""
        port = str(host.ddtree.server.port)
        script = Script(argv=(host.python, "-", "127.0.0.1", port, str(max_s)), source=_PORT_HOLDER)
        pid = int(self.transport.run(script, timeout=30, check=True).stdout)
        self.holders.append(pid)
        return pid

    def release_port(self, pid: int, transport: Transport | None = None) -> None:
        self.holders.remove(pid)
        self.signal_group(pid, "TERM", transport)

    def process_gone(self, pid: int) -> bool:
        """No such pid on the host any more, or only its zombie."""
        result = self.transport.run(["cat", f"/proc/{pid}/stat"], timeout=30)
        return result.returncode != 0 or result.stdout.rsplit(")", 1)[1].split()[0] in ("Z", "X")

    def cleanup(self) -> None:
        if not self.hosts:
            return
        # A fresh connection: the test may have closed or broken its own.
        with self.open(self.hosts[0]) as t:
            for pid in self.holders:
                t.run(["kill", "-KILL", "--", f"-{pid}"], timeout=30)
            for host in self.hosts:
                lifecycle.stop(t, host, grace_s=2.0)


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.fleet)])
def transport_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sim_target(transport_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SimTarget]:
    """The scenario's host side: this machine, or fleet-0 of the SSH test fleet (RTX PRO
    6000, real SGLang 0.5.23 files in its prefix). The fleet is shared by the suite, so
    fleet hosts keep their own run_dir and server port untouched: each test gets a run_dir
    in its tmp dir and a free port, and everything it launched is stopped at the end."""
    base: Host | None = None
    if transport_kind == "ssh":
        base = request.getfixturevalue("ssh_fleet").load().hosts["fleet-0"]
        transport: Transport = open_transport(base)
    else:
        transport = LocalTransport("sim")
    target = SimTarget(transport_kind, transport, tmp_path, base)
    try:
        with transport:
            yield target
    finally:
        target.cleanup()
