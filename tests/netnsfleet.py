"""SSH test hosts with their own addresses: one Linux network namespace per host.

The loopback fleet (``fleetlib``) puts every host on 127.0.0.1, so anything that connects
to ``ansible_host:port`` from the operator's machine reaches a loopback-bound server by
accident. Here each host is a network namespace joined to this machine by a veth pair:
``10.77.N.1/24`` on the root side, ``10.77.N.2/24`` inside, loopback up, and an sshd
started inside the namespace (``ip netns exec``) listening on that address only, on port
22 like a real host. What the host runs (the server, a load client) lives in the
namespace, so its 127.0.0.1 is the host's own and is unreachable from the operator.

The Python prefix, nvidia-smi stand-in, keys and sshd are ``fleetlib``'s; only the address
and the namespace are new. Names carry a random suffix (parallel sessions share one
network stack), subnets are picked free under a lock, and :meth:`NetnsFleet.close` kills
every process in each namespace, deletes the veth and the namespace, also after a failure
halfway through :func:`build_netns_fleet`.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml
from fleetlib import (
    Fleet,
    FleetHost,
    SshdServer,
    cached_prefix_template,
    find_wheel,
    keygen,
    public_key,
    write_nvidia_smi,
)

SSH_PORT = 22
# Simulator settings that keep a launch to a few seconds (sim/README.md's safe range).
FAST_SIM_ENV = {"SIM_LOAD_S": "2", "SIM_WARMUP_S": "1", "SIM_TIME_SCALE": "0.1", "SIM_SEED": "0"}
_LOCK = Path("/run/lock/ddtree-ops-netns.lock")


def netns_unavailable() -> str | None:
    """Why namespace hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"ddtp-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass
@dataclass
class NetnsHost(FleetHost):
    netns: str = ""
    address: str = ""  # inside the namespace: the inventory's ansible_host
    veth: str = ""  # the root-side end; deleting it deletes the pair


@dataclass
class NetnsFleet(Fleet):
    @property
    def netns_hosts(self) -> list[NetnsHost]:
        return [h for h in self.hosts if isinstance(h, NetnsHost)]

    def close(self) -> None:
        """Every process in each namespace killed (sshd and its sessions, servers that
        daemonised away from it), then the veth and the namespace deleted. Errors are
        collected so that one host's failure never leaves another's namespace behind."""
        errors: list[str] = []
        for host in self.netns_hosts:
            try:
                if host.server is not None:
                    host.server.stop()
            except Exception as exc:
                errors.append(f"{host.name}: stopping sshd: {exc}")
            errors += _delete_netns(host.netns, host.veth)
        if errors:
            raise RuntimeError("; ".join(errors))


def netns_pids(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _delete_netns(netns: str, veth: str) -> list[str]:
    errors: list[str] = []
    for _ in range(50):
        pids = netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    else:
        errors.append(f"{netns}: processes survive SIGKILL: {netns_pids(netns)}")
    if veth and subprocess.run(["ip", "link", "show", veth], capture_output=True).returncode == 0:
        done = subprocess.run(["ip", "link", "del", veth], capture_output=True, text=True)
        if done.returncode != 0:
            errors.append(f"{netns}: ip link del {veth}: {done.stderr.strip()}")
    if netns in _ip("netns", "list").split():
        done = subprocess.run(["ip", "netns", "del", netns], capture_output=True, text=True)
        if done.returncode != 0:
            errors.append(f"{netns}: ip netns del: {done.stderr.strip()}")
    return errors


def _remove_stale() -> None:
    """Namespaces of sessions that died without their finally (their pid is gone); the
    veth pair goes with the namespace."""
    for netns in _ip("netns", "list").split():
        parts = netns.split("-")
        if len(parts) == 4 and parts[0] == "ddt" and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            _delete_netns(netns, "")


@contextmanager
def _allocation_lock() -> Iterator[None]:
    """Serialises subnet picking across sessions on this machine (they share one stack)."""
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    with _LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_subnets(count: int) -> list[int]:
    """``count`` values of N whose 10.77.N.0/24 no interface or route here uses."""
    used = _ip("-o", "addr", "show") + _ip("route", "show", "table", "all")
    taken = {n for n in range(256) if f"10.77.{n}." in used}
    free = [n for n in range(1, 255) if n not in taken]
    if len(free) < count:
        raise RuntimeError("no free 10.77.N.0/24 subnets left")
    return random.sample(free, count)


def _make_netns(netns: str, veth: str, subnet: int) -> tuple[str, str]:
    """The namespace, its veth pair and addresses; returns (root side, inside) addresses."""
    outer, inner = f"10.77.{subnet}.1", f"10.77.{subnet}.2"
    peer = veth[:-1] + "b"
    _ip("netns", "add", netns)
    _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
    _ip("link", "set", peer, "netns", netns)
    _ip("addr", "add", f"{outer}/24", "dev", veth)
    _ip("link", "set", veth, "up")
    _ip("-n", netns, "addr", "add", f"{inner}/24", "dev", peer)
    _ip("-n", netns, "link", "set", peer, "up")
    _ip("-n", netns, "link", "set", "lo", "up")
    return outer, inner


def build_netns_fleet(root: Path, gpus: Sequence[str] = ("rtx-pro-6000", "b300")) -> NetnsFleet:
    """One namespace host per entry of ``gpus``; the inventory is written but holds only
    the connection settings (the caller adds ``ddtree.server``)."""
    root.mkdir(parents=True, exist_ok=True)
    client_key = keygen(root / "client" / "id_ed25519", "ddtree-ops-netns-client")
    authorized = root / "client" / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    template = cached_prefix_template(find_wheel())
    suffix = secrets.token_hex(3)
    fleet = NetnsFleet(
        root=root, hosts=[], inventory=root / "netns.yaml", client_key=client_key,
        known_hosts=root / "client" / "known_hosts",
    )
    try:
        with _allocation_lock():
            _remove_stale()
            subnets = _free_subnets(len(gpus))
            for i, (gpu, subnet) in enumerate(zip(gpus, subnets, strict=True)):
                name = f"ns-{i}"
                # The owner's pid in the namespace name lets a later session remove what a
                # killed one left; interface names must stay within 15 characters.
                netns, veth = f"ddt-{os.getpid()}-{suffix}-{i}", f"dv{suffix}{i}a"
                host = NetnsHost(
                    name=name, gpu=gpu, server=None, prefix=root / name / "prefix",  # type: ignore[arg-type]
                    bin_dir=root / name / "bin", run_dir=root / name / "run", netns=netns, veth=veth,
                )
                fleet.hosts.append(host)  # before anything exists, so close() cleans up a half-built host
                _, host.address = _make_netns(netns, veth, subnet)
        for host in fleet.netns_hosts:
            hdir = root / host.name
            shutil.copytree(template, host.prefix, symlinks=True, ignore=shutil.ignore_patterns(".ready"))
            if host.gpu is not None:
                write_nvidia_smi(host.bin_dir, host.gpu)
            host.server = SshdServer(
                root=hdir / "sshd",
                port=SSH_PORT,
                host_key=keygen(hdir / "ssh_host_ed25519_key", host.name),
                authorized_keys=authorized,
                path_env=f"{host.bin_dir}:{host.prefix / 'bin'}:/usr/local/bin:/usr/bin:/bin",
                home=hdir / "home",
                listen_address=host.address,
                launch_prefix=("ip", "netns", "exec", host.netns),
            )
            host.server.start()
        # Port 22: known_hosts names the bare address, as for any real host.
        lines = [f"{h.address} {public_key(h.server.host_key)}\n" for h in fleet.netns_hosts]
        fleet.known_hosts.write_text("".join(lines))
        fleet.inventory.write_text(yaml.safe_dump(netns_inventory(fleet), sort_keys=False))
    except BaseException:
        fleet.close()
        raise
    return fleet


def netns_inventory(fleet: NetnsFleet, server: dict[str, object] | None = None) -> dict[str, object]:
    """The fleet as a user would write it for real hosts (``examples/inventories/ct200.yaml``'s
    shape): ``ansible_host`` is each host's own address, the server settings are shared."""
    hosts: dict[str, object] = {}
    for h in fleet.netns_hosts:
        ddtree: dict[str, object] = {"python": str(h.python), "run_dir": str(h.run_dir)}
        if h.gpu:
            ddtree["gpu"] = h.gpu
        hosts[h.name] = {"ansible_host": h.address, "ddtree": ddtree}
    group_ddtree: dict[str, object] = {"known_hosts": str(fleet.known_hosts)}
    if server is not None:
        group_ddtree["server"] = server
    return {
        "all": {
            "children": {
                "netns": {
                    "vars": {
                        "ansible_user": "root",
                        "ansible_ssh_private_key_file": str(fleet.client_key),
                        "ddtree": group_ddtree,
                    },
                    "hosts": hosts,
                }
            }
        }
    }


def exposed_listeners(host: NetnsHost, allowed_ports: Sequence[int] = (SSH_PORT,)) -> list[str]:
    """TCP sockets listening inside the host's namespace on a non-loopback address, other
    than ``allowed_ports``: ``addr:port`` strings. Read from ``/proc/<pid>/net/tcp{,6}``
    of a process in the namespace (its sshd), which shows that namespace's sockets."""
    return [f"{addr}:{port}" for addr, port in listeners(host) if port not in allowed_ports
            and not ipaddress.ip_address(addr).is_loopback
            and not _mapped_loopback(addr)]


def listeners(host: NetnsHost) -> list[tuple[str, int]]:
    """Every TCP (v4 and v6) socket in LISTEN state inside the host's namespace."""
    pids = netns_pids(host.netns)
    if not pids:
        raise RuntimeError(f"{host.name}: no process in {host.netns} to read its sockets through")
    found: list[tuple[str, int]] = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        path = Path(f"/proc/{pids[0]}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def _mapped_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback
