"""SSH-only behaviour against real sshd: reuse, ssh_config, ProxyJump, host keys, failures."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fleetlib import Fleet, SshdServer, free_port, keygen, known_hosts_line

from ddtree_ops.errors import AuthError, ConfigError, ConnectError, HostKeyError, TransportError
from ddtree_ops.inventory import load_inventory
from ddtree_ops.inventory_types import DdtreeSettings, Host
from ddtree_ops.transport.ssh import _PROLOGUE, SSHTransport, _strip_pgid_marker, build_command_line, resolve_endpoint

pytestmark = pytest.mark.fleet


@pytest.fixture
def home(clean_home: Path) -> Path:
    """An empty HOME: no ~/.ssh/config or ~/.ssh/known_hosts of the machine's user leaks in."""
    return clean_home


def fleet_host(fleet: Fleet, index: int = 0) -> Host:
    return fleet.load().hosts[fleet.hosts[index].name]


def test_one_connection_is_reused(ssh_fleet: Fleet, home: Path) -> None:
    # The client's source port (in $SSH_CLIENT) is the same for every command: one connection.
    with SSHTransport(fleet_host(ssh_fleet)) as t:
        seen = {t.run(["sh", "-c", "echo $SSH_CLIENT"]).stdout.split()[1] for _ in range(3)}
        t.write_atomic(f"{ssh_fleet.hosts[0].run_dir}/reuse.txt", b"x")
        seen.add(t.run(["sh", "-c", "echo $SSH_CLIENT"]).stdout.split()[1])
    assert len(seen) == 1


def test_reconnects_after_the_host_came_back(ssh_fleet: Fleet, home: Path) -> None:
    name = ssh_fleet.hosts[2].name
    with SSHTransport(fleet_host(ssh_fleet, 2)) as t:
        assert t.run(["true"]).ok
        ssh_fleet.stop(name)
        with pytest.raises(ConnectError, match=rf"^{name}: connection refused by 127\.0\.0\.1:"):
            t.run(["true"])
        ssh_fleet.start(name)
        assert t.run(["echo", "back"]).stdout == "back\n"


def _kill_sessions(server: SshdServer) -> int:
    """SIGKILL the listener's per-connection children: the connection dies, the host stays."""
    assert server.proc is not None
    pids = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in pids:
        subprocess.run(["kill", "-KILL", pid], check=False)
    return len(pids)


@pytest.mark.parametrize("op", ["write_atomic", "read_bytes", "exists"])
def test_a_file_operation_on_a_dead_connection_fails_once_then_reconnects(
    ssh_fleet: Fleet, home: Path, op: str
) -> None:
    fh = ssh_fleet.hosts[1]
    path = f"{fh.run_dir}/dead-conn-{op}.txt"
    with SSHTransport(fleet_host(ssh_fleet, 1)) as t:
        t.write_atomic(path, b"before")
        assert _kill_sessions(fh.server) >= 1
        calls = {
            "write_atomic": lambda: t.write_atomic(path, b"during"),
            "read_bytes": lambda: t.read_bytes(path),
            "exists": lambda: t.exists(path),
        }
        # Whether the client saw the connection die before the call: its transport thread
        # reads the EOF on its own, and then the call reconnects at once as after a host
        # restart (SSHTransport._client). On a loaded machine that came first now and then.
        transport = t._clients[-1].get_transport()
        if transport is not None and transport.is_active():
            with pytest.raises(TransportError, match=rf"^{fh.name}: cannot \w+ {path}: connection lost \("):
                calls[op]()
        else:
            calls[op]()
        # The dead connection was dropped: the next operations reconnect and succeed.
        t.write_atomic(path, b"after")
        assert t.read_bytes(path) == b"after" and t.exists(path)
        assert t.run(["true"]).ok


def test_ssh_config_alias(ssh_fleet: Fleet, home: Path) -> None:
    fh = ssh_fleet.hosts[1]
    (home / ".ssh" / "config").write_text(
        f"Host gpu-b300\n  HostName 127.0.0.1\n  Port {fh.port}\n  User root\n  IdentityFile {ssh_fleet.client_key}\n"
    )
    host = Host("gpu-b300", ddtree=DdtreeSettings(known_hosts=str(ssh_fleet.known_hosts)))
    with SSHTransport(host) as t:
        assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(fh.server.home)


def test_a_host_named_by_dns_without_ansible_host_is_reached_at_its_name(
    ssh_fleet: Fleet, home: Path, tmp_path: Path
) -> None:
    # Ansible's rule: no ansible_host and no ssh_config alias -> connect to the inventory
    # name. `localhost` is a name the resolver knows on every machine.
    fh = ssh_fleet.hosts[0]
    known = tmp_path / "known_hosts"
    known.write_text(known_hosts_line(fh.port, fh.server.host_key, address="localhost") + "\n")
    inv = tmp_path / "dns.yml"
    inv.write_text(
        f"all:\n  hosts:\n    localhost:\n      ansible_port: {fh.port}\n      ansible_user: root\n"
        f"      ansible_ssh_private_key_file: {ssh_fleet.client_key}\n"
        f"      ddtree: {{known_hosts: {known}}}\n"
    )
    host = load_inventory([inv]).hosts["localhost"]
    assert host.address is None
    with SSHTransport(host) as t:
        assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(fh.server.home)


def test_inventory_values_win_over_ssh_config() -> None:
    import paramiko

    cfg = paramiko.SSHConfig.from_text("Host h\n  HostName 10.0.0.9\n  Port 2200\n  User alice\n  IdentityFile ~/k\n")
    ep = resolve_endpoint("h", cfg, port=2222, user="bob")
    assert (ep.hostname, ep.port, ep.user) == ("10.0.0.9", 2222, "bob")
    assert ep.key_files[0].endswith("/k") and not ep.key_files[0].startswith("~")
    assert resolve_endpoint("other", cfg).hostname == "other"


def test_command_line_quotes_everything() -> None:
    import shlex

    line = build_command_line(["echo", "$(id)", "a b"], env={"X": "; rm -rf /"}, cwd="~/my dir")
    words = shlex.split(line)
    # A constant prologue; every value after it is one quoted positional parameter.
    assert words[:3] == ["exec", "sh", "-c"] and words[3] == _PROLOGUE
    assert words[4:] == ["sh", "~/my dir", "env", "X=; rm -rf /", "echo", "$(id)", "a b"]
    assert line.endswith(" sh '~/my dir' env 'X=; rm -rf /' echo '$(id)' 'a b'")
    assert shlex.split(build_command_line(["true"]))[4:] == ["sh", "", "true"]
    with pytest.raises(ValueError, match="invalid environment variable name"):
        build_command_line(["true"], env={"A B": "1"})


@pytest.mark.parametrize(
    ("arrived", "settled", "pgid", "left"),
    [
        (b"", False, None, b""),
        (b"ddtree-op", False, None, b"ddtree-op"),
        (b"ddtree-ops-pgid 41", False, None, b"ddtree-ops-pgid 41"),
        (b"ddtree-ops-pgid 4242\n", True, 4242, b""),
        (b"ddtree-ops-pgid 4242\nddtree-ops-pgid 7\n\x00\xff", True, 4242, b"ddtree-ops-pgid 7\n\x00\xff"),
        # Not our line (the prologue did not run): stdout is the command's, untouched.
        (b"hello\n", True, None, b"hello\n"),
        (b"ddtree-ops-pgid x1\n", True, None, b"ddtree-ops-pgid x1\n"),
        (b"ddtree-ops-pgid " + b"9" * 60, True, None, b"ddtree-ops-pgid " + b"9" * 60),
        # Group 1 is init's: never a command's, never signalled.
        (b"ddtree-ops-pgid 1\n", True, None, b""),
    ],
)
def test_strip_pgid_marker(arrived: bytes, settled: bool, pgid: int | None, left: bytes) -> None:
    out = bytearray(arrived)
    assert _strip_pgid_marker(out) == (settled, pgid)
    assert bytes(out) == left


def test_stdout_is_binary_safe_and_streams_stay_apart(ssh_fleet: Fleet, home: Path) -> None:
    # No pty: no CR/LF rewriting, no merged streams, every byte value intact (bytes that
    # are not UTF-8 decode to U+FFFD, as CommandResult documents for both transports).
    src = "import sys\nsys.stdout.buffer.write(bytes(range(256)))\nsys.stderr.write('e\\n')\n"
    from ddtree_ops.transport import Script

    with SSHTransport(fleet_host(ssh_fleet)) as t:
        result = t.run(Script((str(ssh_fleet.hosts[0].python), "-"), src), check=True)
    assert result.stderr == "e\n"
    assert result.stdout == bytes(range(256)).decode(errors="replace")


def test_command_runs_as_its_own_process_group(ssh_fleet: Fleet, home: Path) -> None:
    """What the timeout kill relies on: the command is a group leader (sshd's setsid, kept
    through the prologue's exec), so its children share a group nothing else is in."""
    src = "import os\nprint(os.getpid(), os.getpgid(0), os.getsid(0))\n"
    from ddtree_ops.transport import Script

    with SSHTransport(fleet_host(ssh_fleet)) as t:
        pid, pgid, sid = map(int, t.run(Script((str(ssh_fleet.hosts[0].python), "-"), src), check=True).stdout.split())
    assert pid == pgid == sid


@pytest.fixture
def bastion(ssh_fleet: Fleet, tmp_path: Path) -> Iterator[SshdServer]:
    key = keygen(tmp_path / "bastion_host_key", "bastion")
    server = SshdServer(
        root=tmp_path / "bastion",
        port=free_port(),
        host_key=key,
        authorized_keys=ssh_fleet.client_key.parent / "authorized_keys",
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_proxyjump_through_a_bastion(ssh_fleet: Fleet, home: Path, bastion: SshdServer, tmp_path: Path) -> None:
    fh = ssh_fleet.hosts[0]
    known = tmp_path / "known_hosts"
    known.write_text(ssh_fleet.known_hosts.read_text() + known_hosts_line(bastion.port, bastion.host_key) + "\n")
    (home / ".ssh" / "config").write_text(
        f"Host jumpbox\n  HostName 127.0.0.1\n  Port {bastion.port}\n  User root\n"
        f"  IdentityFile {ssh_fleet.client_key}\n\n"
        f"Host behind\n  HostName 127.0.0.1\n  Port {fh.port}\n  User root\n  IdentityFile {ssh_fleet.client_key}\n"
        f"  ProxyJump jumpbox\n"
    )
    host = Host("behind", ddtree=DdtreeSettings(known_hosts=str(known)))
    with SSHTransport(host) as t:
        assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(fh.server.home)
        t.write_atomic(f"{fh.run_dir}/via-bastion.txt", b"jumped")
        assert (fh.run_dir / "via-bastion.txt").read_bytes() == b"jumped"
    # The path really goes through the bastion: without it, the (running) target is unreachable.
    bastion.stop()
    with SSHTransport(host, connect_timeout=3) as t, pytest.raises(ConnectError, match=r"jump host 127\.0\.0\.1:\d+"):
        t.run(["true"])


def test_connection_refused(home: Path) -> None:
    port = free_port()  # nothing listens there
    with SSHTransport(Host("down", address="127.0.0.1", port=port, user="root")) as t:
        with pytest.raises(ConnectError, match=rf"down: connection refused by 127\.0\.0\.1:{port}"):
            t.run(["true"])


def test_silent_server_times_out(home: Path) -> None:
    # A listener that accepts TCP but never speaks SSH: a hung host or a black-holed service.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(5)
    port = sock.getsockname()[1]
    try:
        with SSHTransport(Host("hung", address="127.0.0.1", port=port, user="root"), connect_timeout=1) as t:
            with pytest.raises(ConnectError, match=r"hung: .*did not complete the SSH handshake within 1s"):
                t.run(["true"])
    finally:
        sock.close()


def test_wrong_key_is_an_auth_error(ssh_fleet: Fleet, home: Path, tmp_path: Path) -> None:
    stranger = keygen(tmp_path / "stranger")
    host = replace(fleet_host(ssh_fleet), key_file=str(stranger))
    with SSHTransport(host) as t, pytest.raises(AuthError, match=r"authentication failed for host root@127\.0\.0\.1"):
        t.run(["true"])
    missing = replace(fleet_host(ssh_fleet), key_file=str(tmp_path / "nope"))
    with SSHTransport(missing) as t, pytest.raises(AuthError, match="private key file not found"):
        t.run(["true"])


def test_a_missing_key_file_is_said_before_any_connection(tmp_path: Path) -> None:
    # A host that would hang the connect (it accepts and never speaks): the missing key is
    # said without connecting at all, so an unreachable host does not cost the timeout first.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    host = Host(name="far", address="127.0.0.1", port=listener.getsockname()[1], user="root",
                key_file=str(tmp_path / "nope"))
    try:
        with SSHTransport(host, connect_timeout=30) as t, pytest.raises(AuthError, match="private key file not found"):
            t.run(["true"])
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


def test_encrypted_key_without_passphrase_is_an_auth_error(ssh_fleet: Fleet, home: Path, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(locked)], check=True, stdin=subprocess.DEVNULL
    )
    host = replace(fleet_host(ssh_fleet), key_file=str(locked))
    with (
        SSHTransport(host) as t,
        pytest.raises(
            AuthError,
            match=rf"private key for host root@127\.0\.0\.1:\d+ is encrypted"
            rf" and no passphrase is available \(tried {locked}\)$",
        ),
    ):
        t.run(["true"])


def test_a_known_hosts_file_that_is_not_text_is_bad_input_naming_it(
    ssh_fleet: Fleet, home: Path, tmp_path: Path
) -> None:
    known = tmp_path / "known_hosts"
    known.write_bytes(bytes(range(128, 256)))
    host = replace(fleet_host(ssh_fleet, 1), ddtree=DdtreeSettings(known_hosts=str(known)))
    with SSHTransport(host) as t, pytest.raises(ConfigError) as info:
        t.run(["true"])
    assert info.value.exit_code == 2
    assert str(info.value).endswith(f"{known}: not a known_hosts file: not UTF-8 text (byte 0)")


def test_host_key_unknown_then_accept_new_then_changed(ssh_fleet: Fleet, home: Path, tmp_path: Path) -> None:
    fh = ssh_fleet.hosts[1]
    known = tmp_path / "inv_known_hosts"
    host = replace(fleet_host(ssh_fleet, 1), ddtree=DdtreeSettings(known_hosts=str(known)))
    with SSHTransport(host) as t, pytest.raises(HostKeyError, match=r"unknown host key .*--host-key-policy accept-new"):
        t.run(["true"])
    assert not known.exists()

    notices: list[str] = []
    with SSHTransport(host, host_key_policy="accept-new", on_notice=notices.append) as t:
        assert t.run(["true"]).ok
    assert known.read_text() == known_hosts_line(fh.port, fh.server.host_key) + "\n"
    # Where the key went is said, once.
    assert len(notices) == 1 and notices[0].startswith(f"{fh.name}: recorded the new host key of host [127.0.0.1]:")
    assert notices[0].endswith(f" in {known}")
    with SSHTransport(host) as t:  # now known: strict accepts it
        assert t.run(["true"]).ok

    # Same address and port, another key: what a man-in-the-middle looks like.
    impostor_key = keygen(tmp_path / "impostor_host_key")
    ssh_fleet.stop(fh.name)
    impostor = SshdServer(
        root=tmp_path / "impostor", port=fh.port, host_key=impostor_key, authorized_keys=fh.server.authorized_keys
    )
    impostor.start()
    try:
        for policy in ("strict", "accept-new"):
            with SSHTransport(host, host_key_policy=policy) as t, pytest.raises(HostKeyError, match="has CHANGED"):
                t.run(["true"])
        assert known.read_text().count("\n") == 1  # the changed key was not recorded
    finally:
        impostor.stop()
        ssh_fleet.start(fh.name)


def test_parallel_accept_new_records_each_key_once(ssh_fleet: Fleet, home: Path, tmp_path: Path) -> None:
    known = tmp_path / "kh"
    hosts = [replace(h, ddtree=DdtreeSettings(known_hosts=str(known))) for h in ssh_fleet.load().hosts.values()]
    errors: list[BaseException] = []

    def go(h: Host) -> None:
        try:
            with SSHTransport(h, host_key_policy="accept-new") as t:
                t.run(["true"])
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(h,)) for h in hosts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sorted(known.read_text().splitlines()) == sorted(
        known_hosts_line(fh.port, fh.server.host_key) for fh in ssh_fleet.hosts
    )


@pytest.fixture
def blackhole_address() -> Iterator[str]:
    """An address whose packets vanish: a veth pair into a network namespace whose end is
    down (a host that lost power or network). Needs root and iproute2, as CI has."""
    import os
    import subprocess

    tag = f"{os.getpid() % 100000}{threading.get_ident() % 100}"
    ns, near, far = f"ddtbh{tag}", f"vbh{tag}a", f"vbh{tag}b"
    octet = os.getpid() % 250 + 1
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", near, "type", "veth", "peer", "name", far],
        ["ip", "link", "set", far, "netns", ns],
        ["ip", "addr", "add", f"10.213.{octet}.1/30", "dev", near],
        ["ip", "link", "set", near, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"10.213.{octet}.2/30", "dev", far],
        ["ip", "netns", "exec", ns, "ip", "link", "set", far, "down"],
    ]
    try:
        for step in steps:
            res = subprocess.run(step, capture_output=True, text=True)
            if res.returncode != 0:
                pytest.skip(f"cannot build a black-holed address here ({' '.join(step)}: {res.stderr.strip()})")
        yield f"10.213.{octet}.2"
    finally:
        subprocess.run(["ip", "link", "del", near], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_blackholed_host_times_out(blackhole_address: str, home: Path) -> None:
    with SSHTransport(Host("gone", address=blackhole_address, user="root"), connect_timeout=1.5) as t:
        with pytest.raises(ConnectError, match=rf"gone: connection to {blackhole_address}:22 timed out after 1\.5s"):
            t.run(["true"])
