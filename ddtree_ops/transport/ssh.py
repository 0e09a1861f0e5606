"""SSHTransport: the Transport protocol over paramiko.

Connection settings come from the inventory first, then ``~/.ssh/config`` (HostName,
User, Port, IdentityFile, ProxyJump), so that hosts people already reach with ``ssh``
work unchanged (its ``Include`` files too: ddtree_ops.sshconfig reads it). One SSH
connection per transport, opened on first use and reused for every command and file
operation (commands are channels on it, files go through one SFTP session).

Host keys are checked against ``~/.ssh/known_hosts`` plus the inventory's optional
``known_hosts`` file. ``strict`` rejects unknown keys; ``accept-new`` records an unknown
key (in the inventory's file when there is one, else ``~/.ssh/known_hosts``) but, like
OpenSSH's ``StrictHostKeyChecking=accept-new``, never accepts a *changed* key.

paramiko and socket exceptions are translated here, once, into ConnectError /
AuthError / HostKeyError / CommandTimeout / CommandFailed / RemoteFileError: every
operation runs inside :func:`~ddtree_ops.transport.translate.translate_errors` (one
table, shared with the local transport), which gives the message its host and context.

A command that outlives its ``timeout`` is ended, not abandoned: without a pty sshd sends
no SIGHUP when the channel closes, so a timed-out command (and whatever it spawned) would
keep running on the host. Every command therefore runs under a constant ``sh`` prologue
that reports its process group id before ``exec``-ing the argv; on timeout a second
channel on the same connection sends SIGTERM to that group and SIGKILL after
:data:`KILL_GRACE_S`. Commands that finish on time cost one round trip, as before, and a
process that left the group on purpose (``setsid``, ``start_new_session``: a launched
server) is never touched.
"""

from __future__ import annotations

import errno
import getpass
import os
import re
import select
import shlex
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko

from ddtree_ops.errors import (
    AuthError,
    CommandFailed,
    CommandTimeout,
    ConfigError,
    ConnectError,
    HostKeyError,
    Interrupted,
    RemoteFileError,
)
from ddtree_ops.fsutil import NOT_REGULAR, read_regular_text
from ddtree_ops.inventory_types import Host
from ddtree_ops.sshconfig import SshConfig, load_ssh_config, user_ssh_config_path
from ddtree_ops.transport.base import (
    Command,
    CommandResult,
    LineCallback,
    LineFeed,
    RoundTripCounter,
    Script,
    command_text,
    interrupted,
    os_error_reason,
)
from ddtree_ops.transport.translate import Message, strerror_or_text, text_or_type, translate_errors

KEEPALIVE_S = 15
# How long a timed-out command's process group gets between SIGTERM and SIGKILL.
KILL_GRACE_S = 2.0
# How long, after a timeout, to wait for a command's group id that has not arrived yet
# (the command started late: a slow host, a large Script still being sent).
_PGID_WAIT_S = 2.0
_PGID_MARKER = b"ddtree-ops-pgid "
# Run as ``sh -c _PROLOGUE sh CWD ARGV...``: every value is a positional parameter, never
# shell text. sshd makes each session's process a session (and so group) leader, and the
# exec keeps that pid, so ``$$`` is the group id of the command and of all it spawns. The
# marker goes out on stdout before the exec, so it is always the first line there; the
# client strips it. An empty CWD means "stay in the login directory".
_PROLOGUE = (
    'printf "ddtree-ops-pgid %s\\n" "$$"; '
    "d=$1; shift; "
    'case $d in "~") d=$HOME ;; "~/"*) d=$HOME/${d#??} ;; esac; '
    'if [ -n "$d" ]; then cd -- "$d" || exit 1; fi; '
    'exec "$@"'
)
# Run as ``sh -c _KILL_GROUP sh PGID STEPS``: SIGTERM to the group, up to STEPS waits of
# 0.1 s while any member is left, then SIGKILL. Only the group is signalled, never the bare
# pid: a group id cannot be reused while the group has members, a pid can.
# (No ``--`` before the negative id: dash's kill builtin rejects it, and -TERM already
# ends the options for every shell's kill.)
_KILL_GROUP = (
    "g=$1; n=$2; "
    'kill -TERM "-$g" 2>/dev/null || exit 0; '
    'while [ "$n" -gt 0 ] && kill -0 "-$g" 2>/dev/null; do sleep 0.1 2>/dev/null || sleep 1; n=$((n - 1)); done; '
    'kill -KILL "-$g" 2>/dev/null; exit 0'
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Appends to a known_hosts file from several per-host threads must not interleave.
_KNOWN_HOSTS_LOCK = threading.Lock()


def user_known_hosts_path() -> Path:
    return Path("~/.ssh/known_hosts").expanduser()


@dataclass(frozen=True)
class Endpoint:
    """Where and as whom to connect, after the inventory and ~/.ssh/config are combined."""

    alias: str
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    proxy_jump: str | None

    @property
    def known_hosts_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def describe(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def resolve_endpoint(
    alias: str,
    config: SshConfig | paramiko.SSHConfig | None,
    *,
    hostname: str | None = None,
    port: int | None = None,
    user: str | None = None,
    key_file: str | None = None,
) -> Endpoint:
    """Inventory values win; ~/.ssh/config fills the gaps (looked up by ``alias``, which
    is the inventory's ``ansible_host`` or, without one, the host's name — as Ansible does)."""
    found: dict[str, Any] = dict(config.lookup(alias)) if config is not None else {}
    cfg_port = found.get("port")
    keys: tuple[str, ...]
    if key_file:
        keys = (os.path.expanduser(key_file),)
    else:
        keys = tuple(os.path.expanduser(k) for k in found.get("identityfile", []))
    proxy = found.get("proxyjump")
    if proxy and proxy.lower() == "none":
        proxy = None
    return Endpoint(
        alias=alias,
        hostname=hostname or found.get("hostname") or alias,
        port=int(port or cfg_port or 22),
        user=user or found.get("user") or getpass.getuser(),
        key_files=keys,
        proxy_jump=proxy,
    )


def _parse_jump(spec: str, *, host: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` or ``[user@][addr]:port`` (one hop of a ProxyJump list).
    A hop that is not of that form is a ConnectError naming ``host`` and the hop."""
    rest = spec.removeprefix("ssh://")
    user = None
    if "@" in rest:
        user, rest = rest.rsplit("@", 1)
    port_s: str | None = None
    if rest.startswith("["):
        jhost, closed, tail = rest[1:].partition("]")
        if not closed or (tail and not tail.startswith(":")):
            raise ConnectError(f"ProxyJump hop {spec!r}: unbalanced [...] around the address", host=host)
        port_s = tail[1:] if tail else None
    elif rest.count(":") == 1:
        jhost, port_s = rest.split(":")
    else:
        jhost = rest
    if not jhost or user == "":
        raise ConnectError(f"ProxyJump hop {spec!r}: expected [user@]host[:port]", host=host)
    port = None
    if port_s is not None:
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise ConnectError(f"ProxyJump hop {spec!r}: port {port_s!r} is not a number from 1 to 65535", host=host)
        port = int(port_s)
    return user, jhost, port


def _send_stdin(chan: paramiko.Channel, data: bytes) -> None:
    """Send ``data`` as the command's stdin. A program may exit before reading it all (an
    interpreter that does not exist exits 127 at once): the server then closes the
    channel and paramiko's send raises "Socket is closed". That is the program's answer,
    as a broken pipe is for a local one (OpenSSH's client stops sending too), so it is
    read like any exit; only a dead connection is an error."""
    try:
        chan.sendall(data)
    except OSError:
        transport = chan.get_transport()
        if not chan.closed or transport is None or not transport.is_active():
            raise


def _fingerprint(key: paramiko.PKey) -> str:
    return key.fingerprint if hasattr(key, "fingerprint") else key.get_name()


def _check_known_hosts(path: Path, host: str) -> None:
    """A known_hosts file that is not text is the user's input at fault (exit 2, naming it),
    not an unreachable host: paramiko would fail on it with a decode error mid-connect."""
    try:
        read_regular_text(path)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a known_hosts file: not UTF-8 text (byte {exc.start})", host=host) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the known_hosts file: {exc.strerror or exc}", host=host) from None


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    def __init__(self, owner: SSHTransport, hop: str) -> None:
        self.owner = owner
        self.hop = hop

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        owner = self.owner
        if owner.host_key_policy != "accept-new":
            files = " or ".join(str(p) for p in owner.known_hosts_files)
            raise HostKeyError(
                f"unknown host key for {self.hop} {hostname} ({key.get_name()} {_fingerprint(key)}): not in {files}; "
                f"check it and add it, or run with --host-key-policy accept-new",
                host=owner.host,
            )
        target = owner.accept_new_file
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _KNOWN_HOSTS_LOCK:
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("a", encoding="utf-8") as fh:
                fh.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)
        # The operator must know which file now vouches for this host (OpenSSH says so too).
        if owner.on_notice is not None:
            owner.on_notice(
                f"{owner.host}: recorded the new host key of {self.hop} {hostname} "
                f"({key.get_name()} {_fingerprint(key)}) in {target}"
            )


class SSHTransport:
    """One host over SSH; see the module docstring for what it honours and guarantees."""

    def __init__(
        self,
        host: Host,
        *,
        host_key_policy: str = "strict",
        connect_timeout: float = 10.0,
        counter: RoundTripCounter | None = None,
        ssh_config: Path | None = None,
        user_known_hosts: Path | None = None,
        keepalive_s: int = KEEPALIVE_S,
        on_notice: Callable[[str], None] | None = None,
    ) -> None:
        self.host = host.name
        # Told what the operator must know that is not an error: where accept-new wrote a key.
        self.on_notice = on_notice
        self.spec = host
        self.host_key_policy = host_key_policy
        self.connect_timeout = connect_timeout
        self.counter = counter
        self.keepalive_s = keepalive_s
        self._ssh_config_path = ssh_config if ssh_config is not None else user_ssh_config_path()
        self._user_known_hosts = user_known_hosts if user_known_hosts is not None else user_known_hosts_path()
        self._lock = threading.RLock()
        self._clients: list[paramiko.SSHClient] = []  # jump hosts first, the target last
        self._sftp: paramiko.SFTPClient | None = None

    # ------------------------------------------------------------------ connection

    @property
    def known_hosts_files(self) -> list[Path]:
        files = [self._user_known_hosts]
        if self.spec.ddtree.known_hosts:
            files.append(Path(os.path.expanduser(self.spec.ddtree.known_hosts)))
        return files

    @property
    def accept_new_file(self) -> Path:
        """Where accept-new records keys: the inventory's file when it names one."""
        if self.spec.ddtree.known_hosts:
            return Path(os.path.expanduser(self.spec.ddtree.known_hosts))
        return self._user_known_hosts

    def _config(self) -> SshConfig:
        """The ssh_config with its Includes (ddtree_ops.sshconfig); empty without a file.
        A broken one is a ConfigError naming the file and line."""
        return load_ssh_config(self._ssh_config_path)

    def endpoint(self) -> Endpoint:
        h = self.spec
        return resolve_endpoint(
            h.address or h.name, self._config(), port=h.port, user=h.user, key_file=h.key_file
        )

    def _client(self) -> paramiko.SSHClient:
        with self._lock:
            if self._clients:
                transport = self._clients[-1].get_transport()
                if transport is not None and transport.is_active():
                    return self._clients[-1]
                self._close_clients()  # a dead connection (host restarted): reconnect once
            self._connect()
            return self._clients[-1]

    def _connect(self) -> None:
        config = self._config()
        target = self.endpoint()
        hops: list[Endpoint] = []
        if target.proxy_jump:
            for spec in target.proxy_jump.split(","):
                juser, jhost, jport = _parse_jump(spec.strip(), host=self.host)
                # Jump hosts are ssh_config aliases too (their own HostName/User/IdentityFile).
                hops.append(resolve_endpoint(jhost, config, port=jport, user=juser))
        hops.append(target)
        # A key file named but absent is known here, before a connection that may take the
        # whole connect timeout to fail: say so at once.
        for i, hop in enumerate(hops):
            missing = [k for k in hop.key_files if not os.path.exists(k)]
            if missing and len(missing) == len(hop.key_files):
                role = "" if i == len(hops) - 1 else f" (jump host {hop.hostname})"
                raise AuthError(f"private key file not found: {missing[0]}{role}", host=self.host)
        sock: Any = None
        try:
            for i, hop in enumerate(hops):
                role = "host" if i == len(hops) - 1 else "jump host"
                if sock is None:
                    sock = self._open_socket(hop, role)
                    self._await_banner(sock, hop, role)
                client = self._handshake(hop, sock, role)
                self._clients.append(client)
                if i < len(hops) - 1:
                    nxt = hops[i + 1]
                    sock = self._direct_tcpip(client, hop, nxt)
        except BaseException:
            if sock is not None and not self._clients:
                sock.close()
            self._close_clients()
            raise

    def _open_socket(self, hop: Endpoint, role: str) -> socket.socket:
        where = f"{role} {hop.hostname}:{hop.port}" if role != "host" else f"{hop.hostname}:{hop.port}"
        messages: dict[type[BaseException], Message] = {
            socket.gaierror: lambda exc: f"cannot resolve {hop.hostname!r} ({role}): {strerror_or_text(exc)}",
            ConnectionRefusedError: f"connection refused by {where} (no SSH server listening?)",
            TimeoutError: f"connection to {where} timed out after {self.connect_timeout:g}s",
        }
        with translate_errors(
            self.host, f"cannot connect to {where}", error=ConnectError, reason=strerror_or_text, messages=messages
        ):
            return socket.create_connection((hop.hostname, hop.port), timeout=self.connect_timeout)

    def _await_banner(self, sock: socket.socket, hop: Endpoint, role: str) -> None:
        """An SSH server speaks first. A port that accepts TCP and then stays silent (a hung
        host, a black-holed service) is told apart here, with a message that says so;
        paramiko would report it as an unrelated "No existing session"."""
        readable, _, _ = select.select([sock], [], [], self.connect_timeout)
        if not readable:
            sock.close()
            raise ConnectError(
                f"{role} {hop.hostname}:{hop.port} accepted the connection but did not complete the SSH handshake "
                f"within {self.connect_timeout:g}s (no SSH banner)",
                host=self.host,
            )

    def _direct_tcpip(self, client: paramiko.SSHClient, via: Endpoint, nxt: Endpoint) -> paramiko.Channel:
        transport = client.get_transport()
        assert transport is not None
        jump, to = f"jump host {via.hostname}:{via.port}", f"{nxt.hostname}:{nxt.port}"

        def unreachable(exc: BaseException) -> str:
            return f"{jump} could not reach {to}: {getattr(exc, 'text', exc)}"

        messages: dict[type[BaseException], Message] = {paramiko.ChannelException: unreachable}
        with translate_errors(
            self.host, f"{jump} could not open a channel to {to}", error=ConnectError, messages=messages
        ):
            return transport.open_channel(
                "direct-tcpip", (nxt.hostname, nxt.port), ("127.0.0.1", 0), timeout=self.connect_timeout
            )

    def _handshake(self, hop: Endpoint, sock: Any, role: str) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        try:
            self._connect_client(client, hop, sock, role)
        except BaseException:
            client.close()
            raise
        transport = client.get_transport()
        if transport is not None and self.keepalive_s:
            transport.set_keepalive(self.keepalive_s)
        return client

    def _connect_client(self, client: paramiko.SSHClient, hop: Endpoint, sock: Any, role: str) -> None:
        for path in self.known_hosts_files:
            if path.is_file():
                _check_known_hosts(path, self.host)
                with translate_errors(self.host, f"cannot read known_hosts file {path}", error=HostKeyError):
                    client.load_system_host_keys(str(path))
        client.set_missing_host_key_policy(_HostKeyPolicy(self, role))
        at = f"{role} {hop.hostname}:{hop.port}"
        keys = ", ".join(hop.key_files) or "agent/default keys"
        messages: dict[type[BaseException], Message] = {
            paramiko.BadHostKeyException: lambda exc: self._changed_key_message(exc, hop, role),
            paramiko.PasswordRequiredException: (
                f"private key for {role} {hop.describe()} is encrypted and no passphrase is available (tried {keys})"
            ),
            paramiko.AuthenticationException: lambda exc: (
                f"authentication failed for {role} {hop.describe()} (tried {keys}): {exc}"
            ),
            TimeoutError: (
                f"{at} accepted the connection but did not complete the SSH handshake within {self.connect_timeout:g}s"
            ),
            OSError: lambda exc: f"connection to {at} failed: {strerror_or_text(exc)}",
        }
        with translate_errors(self.host, f"SSH handshake with {at} failed", error=ConnectError, messages=messages):
            client.connect(
                hop.hostname,
                port=hop.port,
                username=hop.user,
                # paramiko takes a list of key files too (its docstring); types-paramiko says str.
                key_filename=[k for k in hop.key_files if os.path.exists(k)] or None,  # type: ignore[arg-type]
                look_for_keys=not hop.key_files,
                allow_agent=not hop.key_files,
                sock=sock,
                timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout,
                channel_timeout=self.connect_timeout,
            )

    def _changed_key_message(self, exc: BaseException, hop: Endpoint, role: str) -> str:
        assert isinstance(exc, paramiko.BadHostKeyException)
        return (
            f"host key for {role} {hop.known_hosts_name} has CHANGED (now {exc.key.get_name()} "
            f"{_fingerprint(exc.key)}, known {_fingerprint(exc.expected_key)}): possible man-in-the-middle; "
            f"if the host was reinstalled, remove its old key from {' / '.join(map(str, self.known_hosts_files))}"
        )

    def _close_clients(self) -> None:
        if self._sftp is not None:
            try:
                self._sftp.close()
            except Exception:  # closing a broken session must not mask the real error
                pass
            self._sftp = None
        for client in reversed(self._clients):
            client.close()
        self._clients = []

    def close(self) -> None:
        with self._lock:
            self._close_clients()

    def _drop(self, _cause: BaseException) -> None:
        """``on_error`` for a failure that means the connection is gone: the next call reconnects."""
        self.close()

    def __enter__(self) -> SSHTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, kind: str, what: str) -> None:
        if self.counter is not None:
            self.counter.record(self.host, kind, what)

    # ------------------------------------------------------------------ commands

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
        line = build_command_line(command, env=env, cwd=cwd)
        stdin = (command.source + command.extra_stdin).encode() if isinstance(command, Script) else b""
        self._count("command", text)
        start = time.monotonic()
        chan = self._open_session()
        try:
            feed = LineFeed(on_line) if on_line is not None else None
            result = self._exchange(chan, line, stdin, timeout, text, start, feed)
        finally:
            chan.close()
        if check and result.returncode != 0:
            raise CommandFailed(result.returncode, text, result.stderr, host=self.host)
        return result

    def _open_session(self) -> paramiko.Channel:
        """A channel for one command. A connection that died since its last use (the host
        rebooted, sshd restarted) is replaced once: nothing was sent on it yet, so retrying
        is safe; if the host is still down, connecting raises the precise ConnectError."""
        for attempt in (1, 2):
            transport = self._client().get_transport()
            try:
                with translate_errors(
                    self.host, "cannot open a session channel", error=ConnectError, on_error=self._drop
                ):
                    if transport is None:
                        raise paramiko.SSHException("no transport")
                    return transport.open_session(timeout=self.connect_timeout)
            except ConnectError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _exchange(
        self,
        chan: paramiko.Channel,
        line: str,
        stdin: bytes,
        timeout: float | None,
        text: str,
        start: float,
        feed: LineFeed | None = None,
    ) -> CommandResult:
        deadline = None if timeout is None else start + timeout
        out = bytearray()
        err: list[bytes] = []
        pgid: int | None = None  # learnt from the prologue's first stdout line
        marker_done = False
        fed = 0  # bytes of ``out`` handed to ``feed``; the pgid marker never is

        def take(data: bytes) -> None:
            nonlocal pgid, marker_done, fed
            out.extend(data)
            if not marker_done:
                marker_done, pgid = _strip_pgid_marker(out)
            if feed is not None and marker_done and fed < len(out):
                chunk, fed = bytes(out[fed:]), len(out)
                try:
                    feed.feed(chunk)
                except Exception:
                    # The caller gave up on the command: end it as Ctrl-C would.
                    if pgid is not None:
                        self._end_group(chan.get_transport(), pgid, reason="output callback failed")
                    raise

        def timed_out() -> CommandTimeout:
            # A pgid still in flight is worth a short wait: without it nothing can be ended.
            limit = time.monotonic() + _PGID_WAIT_S
            try:
                while not marker_done and not chan.closed and time.monotonic() < limit:
                    if chan.recv_ready():
                        take(chan.recv(65536))
                    elif chan.eof_received:
                        break
                    else:
                        select.select([chan], [], [], 0.1)
            except (paramiko.SSHException, OSError, EOFError):
                pass
            if pgid is None:
                ended = "could not end it: its process group id never arrived"
            else:
                ended = "ended: " + self._end_group(chan.get_transport(), pgid)
            return CommandTimeout(
                f"command did not finish within {timeout:g}s ({ended}): {text[:200]}", host=self.host, timeout=timeout
            )

        lost = f"connection lost while running {text[:200]}"
        with translate_errors(self.host, lost, error=ConnectError, reason=strerror_or_text, on_error=self._drop):
            try:
                chan.exec_command(line)
                if stdin:
                    chan.settimeout(None if deadline is None else max(0.01, deadline - time.monotonic()))
                    _send_stdin(chan, stdin)
                chan.shutdown_write()
                chan.settimeout(0.0)
                while True:
                    while chan.recv_ready():
                        take(chan.recv(65536))
                    while chan.recv_stderr_ready():
                        err.append(chan.recv_stderr(65536))
                    if (
                        chan.exit_status_ready()
                        and chan.eof_received
                        and not chan.recv_ready()
                        and not chan.recv_stderr_ready()
                    ):
                        break
                    if chan.closed and not chan.recv_ready() and not chan.recv_stderr_ready():
                        break
                    if interrupted():
                        # Another thread took the Ctrl-C (transport.base.interrupting).
                        raise KeyboardInterrupt
                    wait = 1.0
                    if deadline is not None:
                        wait = deadline - time.monotonic()
                        if wait <= 0:
                            raise timed_out()
                        wait = min(wait, 1.0)
                    select.select([chan], [], [], wait)
            except TimeoutError as exc:
                raise timed_out() from exc
            except KeyboardInterrupt:
                # Ctrl-C on the controller ends the remote command as it would end a local one;
                # without this the command would run on after the channel closes (no pty).
                if pgid is not None:
                    self._end_group(chan.get_transport(), pgid, reason="interrupted")
                if interrupted():
                    raise Interrupted("interrupted: the command was ended", host=self.host) from None
                raise
        if not chan.exit_status_ready():
            # The channel closed without an exit status: the connection (or sshd) went away.
            self.close()
            raise ConnectError(lost, host=self.host)
        if feed is not None:
            feed.close()
        code = chan.recv_exit_status()
        if code == -1:
            code = 255  # killed by a signal: OpenSSH's client reports 255 too
        return CommandResult(
            code, bytes(out).decode(errors="replace"), b"".join(err).decode(errors="replace"), time.monotonic() - start
        )

    def _end_group(self, transport: paramiko.Transport, pgid: int, *, reason: str = "timeout") -> str:
        """SIGTERM, then SIGKILL, to a timed-out or interrupted command's process group,
        over a second channel on the command's own connection (never a new one: the group
        lives on the host that connection reaches). Best effort: the caller is already
        raising, so a failure here is reported in its message, not raised."""
        steps = max(1, round(KILL_GRACE_S / 0.1))
        line = shlex.join(["sh", "-c", _KILL_GROUP, "sh", str(pgid), str(steps)])
        self._count("command", f"end process group {pgid} ({reason})")
        try:
            kill = transport.open_session(timeout=self.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            return f"could not end it: {exc or type(exc).__name__}"
        try:
            kill.exec_command(line)
            kill.shutdown_write()
            limit = time.monotonic() + KILL_GRACE_S + self.connect_timeout
            while not kill.exit_status_ready():
                if kill.closed or time.monotonic() > limit:
                    return f"sent SIGTERM to process group {pgid}; no confirmation it is gone"
                select.select([kill], [], [], 0.1)
                while kill.recv_ready():
                    kill.recv(65536)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            return f"could not end it: {exc or type(exc).__name__}"
        finally:
            kill.close()
        return f"process group {pgid} terminated"

    # ------------------------------------------------------------------ files

    def _sftp_client(self) -> paramiko.SFTPClient:
        with self._lock:
            client = self._client()
            if self._sftp is None:
                with translate_errors(self.host, "cannot open an SFTP session", error=RemoteFileError):
                    self._sftp = client.open_sftp()
            return self._sftp

    def _file_op(self, doing: str, *, cleanup: Callable[[], None] | None = None) -> AbstractContextManager[None]:
        """Translation for SFTP requests. An OSError is the server's answer (no such file,
        permission denied) and leaves the session usable, so ``cleanup`` (remove a temp
        file) can still run -- unless the SFTP channel is closed: paramiko then raises
        OSError("Socket is closed") for a connection that died under the request. A
        session that broke is dropped, so that the next call reconnects, and its message
        says the connection was lost."""
        sftp = self._sftp

        def gone(exc: BaseException) -> bool:
            channel = getattr(sftp, "sock", None)
            return not isinstance(exc, OSError) or (channel is not None and bool(channel.closed))

        def lost(exc: BaseException) -> str:
            return f"connection lost ({text_or_type(exc)})"

        def lost_doing(exc: BaseException) -> str:
            return f"{doing}: {lost(exc)}"

        def reason(exc: BaseException) -> str:
            return lost(exc) if gone(exc) else os_error_reason(exc)

        def on_error(exc: BaseException) -> None:
            if gone(exc):
                self._drop(exc)
            elif cleanup is not None:
                cleanup()

        return translate_errors(
            self.host,
            doing,
            error=RemoteFileError,
            reason=reason,
            messages={paramiko.SSHException: lost_doing, EOFError: lost_doing},
            on_error=on_error,
        )

    def read_bytes(self, path: str) -> bytes:
        self._count("read", path)
        sftp = self._sftp_client()
        remote = sftp_path(path)
        with self._file_op(f"cannot read {path}"):
            # Only a regular file, as the local transport reads (fsutil.open_regular), judged
            # before the open (one more round trip; SFTP has no non-blocking open):
            # sftp-server opens a FIFO blocking until a writer comes, so the request, the
            # session and the command waited for ever; a device (/dev/zero) read without end.
            _refuse_irregular(sftp.stat(remote).st_mode, path)
            with sftp.open(remote, "rb") as fh:
                fh.prefetch()
                return fh.read()

    def write_atomic(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._count("write", path)
        sftp = self._sftp_client()
        remote = sftp_path(path)
        parent, _, name = remote.rpartition("/")
        tmp = f"{parent + '/' if parent else ''}.{name}.{uuid.uuid4().hex[:12]}.tmp"
        with self._file_op(f"cannot write {path}", cleanup=lambda: _sftp_remove_quietly(sftp, tmp)):
            if parent:
                _sftp_makedirs(sftp, parent)
            with sftp.open(tmp, "wb") as fh:
                fh.set_pipelined(True)
                fh.write(data)
                fh.flush()
                _sftp_fsync(sftp, fh)
            sftp.chmod(tmp, mode)
            sftp.posix_rename(tmp, remote)

    def exists(self, path: str) -> bool:
        self._count("stat", path)
        sftp = self._sftp_client()
        with self._file_op(f"cannot stat {path}"):
            try:
                sftp.lstat(sftp_path(path))
                return True
            except OSError as exc:
                if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT:
                    return False
                raise


def build_command_line(command: Command, *, env: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """The exec request for ``command``: a constant ``sh`` prologue (see :data:`_PROLOGUE`)
    with ``cwd`` and the argv as its positional parameters, every value quoted with shlex,
    never interpolated.

    ``~`` / ``~/x`` in ``cwd`` mean the home directory, as for the local transport.
    """
    argv = list(command.argv) if isinstance(command, Script) else list(command)
    if not argv:
        raise ValueError("empty command")
    if env:
        bad = [k for k in env if not _ENV_NAME.match(k)]
        if bad:
            raise ValueError(f"invalid environment variable name: {bad[0]!r}")
        argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    return "exec " + shlex.join(["sh", "-c", _PROLOGUE, "sh", cwd or "", *argv])


def _strip_pgid_marker(out: bytearray) -> tuple[bool, int | None]:
    """Remove the prologue's ``ddtree-ops-pgid N`` line from the start of ``out``.

    Returns (settled, pgid): settled is False while the line may still be arriving. A
    stdout that does not start with the marker (the prologue never ran) is left as is.
    """
    probe = bytes(out[: len(_PGID_MARKER)])
    if not _PGID_MARKER.startswith(probe):
        return True, None
    newline = out.find(b"\n", 0, 64)
    if newline < 0:
        return len(out) >= 64, None
    digits = bytes(out[len(_PGID_MARKER) : newline])
    if not digits.isdigit():
        return True, None
    del out[: newline + 1]
    pgid = int(digits)
    return True, pgid if pgid > 1 else None


def sftp_path(path: str) -> str:
    """SFTP starts in the home directory, so ``~/x`` is the relative path ``x``."""
    if path == "~":
        return "."
    if path.startswith("~/"):
        return path[2:] or "."
    return path


def _refuse_irregular(mode: int | None, path: str) -> None:
    """Raise as :func:`ddtree_ops.fsutil.open_regular` does for anything but a regular file
    (the same reason in the message, whichever transport read it). A server that reports
    no mode is taken at its word."""
    if mode is None:
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    if not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, NOT_REGULAR, path)


def _sftp_makedirs(sftp: paramiko.SFTPClient, directory: str) -> None:
    try:
        sftp.stat(directory)
        return
    except FileNotFoundError:
        pass
    parent = directory.rpartition("/")[0]
    if parent and parent != directory:
        _sftp_makedirs(sftp, parent)
    try:
        sftp.mkdir(directory)
    except OSError:
        sftp.stat(directory)  # raced with another writer: fine if it exists now


def _sftp_remove_quietly(sftp: paramiko.SFTPClient, path: str) -> None:
    """Best effort: a failed write must report its own cause, not the cleanup's."""
    try:
        sftp.remove(path)
    except (OSError, paramiko.SSHException, EOFError):
        pass


def _sftp_fsync(sftp: paramiko.SFTPClient, fh: paramiko.SFTPFile) -> None:
    # paramiko has no fsync call; OpenSSH's sftp server offers it as an extension.
    from paramiko.sftp import CMD_EXTENDED

    try:
        # SFTPClient._request is private, so not in types-paramiko; it is how an extension is sent.
        sftp._request(CMD_EXTENDED, "fsync@openssh.com", fh.handle)  # type: ignore[attr-defined]
    except OSError as exc:
        if "unsupported" not in str(exc).lower():
            raise
