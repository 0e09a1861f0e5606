"""Test hosts run by a real systemd: systemd 252 booted as PID 1 of its own namespaces.

A production GPU host runs SGLang as a systemd unit. These hosts make that testable here
without ever letting systemd touch the machine the tests run on (shared/design.md §9):

* **its own root**: an overlay of ``/`` whose upper layer is a directory of the test's
  (everything the host writes, ``/etc/systemd/system`` included, lands there and nowhere
  else), with fresh ``/proc`` and ``/sys``, a private ``/dev`` of a few device nodes,
  tmpfs ``/tmp``, ``/run`` and ``/var/tmp`` (``systemd-tmpfiles`` empties those at boot),
  entered with ``pivot_root``;
* **its own cgroups**: the launcher moves itself into a sub-cgroup of its own in every
  hierarchy it is in (``/proc/self/cgroup`` read once, before moving; cpuset skipped: a
  new cpuset group has no CPUs to join) before ``unshare --cgroup``, and a fresh
  ``name=systemd`` hierarchy is mounted inside, so what systemd creates lives under
  those sub-cgroups; they are removed, deepest first, once the host is down;
* **its own PID, mount, UTS, IPC and network namespaces**: the network one is a
  ``netnsfleet`` namespace joined to this machine by a veth pair, so the host is reached
  over SSH at its own address, by an sshd that runs as a unit of the host's systemd;
* units that would reach past the namespaces (sysctl, kernel modules, binfmt, the clock)
  or that a GPU host does not run (getty, the image's database and sshd, timers) are
  masked with ``/dev/null`` links in the upper layer before the first boot.

The upper layer outlives a boot: :meth:`SystemdHost.shutdown` then :meth:`SystemdHost.boot`
is a reboot, and what was enabled or written (a unit, a drop-in, the patched SGLang files)
is there again, as on a real disk.

Each host's SGLang is the operator's unit ``sglang.service`` (``Restart=always``, enabled),
whose ``ExecStart`` runs the simulator (it stands in for SGLang) from the host's Python
prefix ``/opt/sglang/venv``, a copy of the fleet's prefix template with the real SGLang
0.5.23 files.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from fleetlib import cached_prefix_template, find_wheel, keygen, public_key, write_nvidia_smi
from netnsfleet import FAST_SIM_ENV, _allocation_lock, _delete_netns, _free_subnets, _make_netns, _remove_stale

SYSTEMD = "/lib/systemd/systemd"
PREFIX = "/opt/sglang/venv"
PYTHON = f"{PREFIX}/bin/python"
UNIT = "sglang.service"
SERVER_PORT = 30000
MODEL = "sim/qwen3-8b"
DRAFT = "sim/qwen3-8b-dflash"
REPO = Path(__file__).resolve().parents[1]
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_PREFIX = "ddtsd"

# Units the image ships that reach past the namespaces or that a GPU host does not need.
MASKED_UNITS = (
    # consoles and logins
    "getty@tty1.service", "getty-static.service", "console-getty.service", "serial-getty@.service",
    "systemd-ask-password-console.path", "systemd-ask-password-wall.path",
    # the image's own services and timers
    "postgresql.service", "ssh.service", "sshd.service", "e2scrub_reap.service", "e2scrub_all.timer",
    "apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "fstrim.timer", "man-db.timer",
    "systemd-tmpfiles-clean.timer", "cron.service",
    # kernel-wide settings: sysctl, modules, binfmt, the clock, the random seed, udev, audit
    "systemd-sysctl.service", "systemd-modules-load.service", "kmod-static-nodes.service",
    "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount", "proc-sys-fs-binfmt_misc.mount",
    "systemd-timesyncd.service", "systemd-random-seed.service", "systemd-pstore.service",
    "systemd-udevd.service", "systemd-udev-trigger.service", "systemd-udev-settle.service",
    "systemd-udevd-control.socket", "systemd-udevd-kernel.socket", "systemd-hwdb-update.service",
    "systemd-journald-audit.socket",
    # mounts of kernel filesystems the host does not need
    "sys-kernel-config.mount", "sys-kernel-debug.mount", "sys-kernel-tracing.mount",
    "sys-fs-fuse-connections.mount", "dev-hugepages.mount", "dev-mqueue.mount",
    # first-boot and disk tooling
    "systemd-firstboot.service", "systemd-machine-id-commit.service", "systemd-repart.service",
    "systemd-pcrphase.service", "systemd-pcrphase-sysinit.service", "systemd-remount-fs.service",
)

# Runs as PID 1 of the new PID namespace, in the new mount, UTS, IPC and cgroup
# namespaces, before it execs systemd. $1: the host's state dir; $2..: host paths bound
# read-only at their own path (the project's venv and the base interpreter).
_INIT = r"""
set -eu
state=$1; shift
root=$state/root
mount --make-rprivate /
mount -t overlay overlay -o "lowerdir=/,upperdir=$state/upper,workdir=$state/work" "$root"
mount -t proc proc "$root/proc"
mount -t sysfs sysfs "$root/sys"
mount -t tmpfs -o mode=755 tmpfs "$root/sys/fs/cgroup"
mkdir -p "$root/sys/fs/cgroup/systemd"
mount -t cgroup -o none,name=systemd cgroup "$root/sys/fs/cgroup/systemd"
mount -t tmpfs -o mode=755 tmpfs "$root/dev"
for node in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
  IFS=: read -r name major minor <<EOF
$node
EOF
  mknod -m 666 "$root/dev/$name" c "$major" "$minor"
done
mkdir -p "$root/dev/pts" "$root/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$root/dev/pts"
ln -s pts/ptmx "$root/dev/ptmx"
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
: > "$state/console.log"
touch "$root/dev/console"
mount --bind "$state/console.log" "$root/dev/console"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
mount -t tmpfs -o mode=755 tmpfs "$root/run"
mount -t tmpfs -o mode=1777 tmpfs "$root/var/tmp"
for path in "$@"; do
  mkdir -p "$root$path"
  mount --bind "$path" "$root$path"
  mount -o remount,bind,ro "$root$path"
done
mkdir -p "$root/.oldroot"
cd "$root"
pivot_root . .oldroot
umount -l /.oldroot
rmdir /.oldroot
hostname "$(cat /etc/hostname)"
exec env -i container=ddtree-ops-test PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  "$SYSTEMD" --log-target=console --log-level=notice </dev/null >/dev/console 2>&1
"""

# The launcher: into the sub-cgroups ($1, colon-separated cgroup.procs files), then into
# the host's network namespace and new namespaces of every other kind.
_LAUNCH = r"""
IFS=: ; for procs in $1; do echo $$ > "$procs"; done; unset IFS
shift
exec "$@"
"""


def systemd_unavailable() -> str | None:
    """Why systemd hosts cannot be booted here, or None when they can."""
    if sys.platform != "linux":
        return "systemd hosts need Linux"
    if os.geteuid() != 0:
        return "systemd hosts need root (namespaces, overlay and cgroup mounts)"
    if not Path(SYSTEMD).exists():
        return f"{SYSTEMD} is not installed (apt-get install systemd)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    if not (_CGROUP_ROOT / "systemd").is_dir() and not (_CGROUP_ROOT / "cgroup.procs").exists():
        return "no cgroup hierarchy mounted at /sys/fs/cgroup"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--cgroup", "--uts", "--ipc", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare of PID, mount, cgroup, UTS and IPC namespaces is not allowed: {probe.stderr.strip()}"
    return None


def _controllers(field: str) -> frozenset[str]:
    """A hierarchy's identity: its controllers and ``name=`` (empty for the unified one)."""
    return frozenset(part for part in field.split(",") if part)


def _mountpoints() -> dict[frozenset[str], Path]:
    """cgroup hierarchy (as :func:`_controllers` names it) -> where this machine mounts it."""
    known = {line.split()[0] for line in Path("/proc/cgroups").read_text().splitlines()[1:] if line.strip()}
    found: dict[frozenset[str], Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _source, options = (right.split() + ["", "", ""])[:3]
        mountpoint = Path(left.split()[4])
        if fstype == "cgroup2":
            found.setdefault(frozenset(), mountpoint)
        elif fstype == "cgroup":
            ids = [o for o in options.split(",") if o in known or o.startswith("name=")]
            found.setdefault(frozenset(ids), mountpoint)
    return found


def _own_cgroups(tag: str) -> list[Path]:
    """A new sub-cgroup named ``tag`` under the current one in every hierarchy but cpuset.

    /proc/self/cgroup is read once, here, before anything moves (moving changes it)."""
    mounts = _mountpoints()
    made: list[Path] = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, field, path = line.split(":", 2)
        controllers = _controllers(field)
        if "cpuset" in controllers:
            continue
        mountpoint = mounts.get(controllers)
        if mountpoint is None:
            continue
        group = mountpoint / path.lstrip("/") / tag
        group.mkdir(parents=True, exist_ok=True)
        made.append(group)
    return made


def _remove_cgroup_tree(group: Path, timeout_s: float = 10.0) -> None:
    """rmdir ``group`` and every group under it, deepest first, once they are empty."""
    deadline = time.monotonic() + timeout_s
    while group.exists():
        dirs = sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, group]:
            with suppress(OSError):
                d.rmdir()
        if not group.exists():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"cgroup {group} could not be removed (processes still in it?)")
        time.sleep(0.05)


def remove_stale_cgroups() -> None:
    """Sub-cgroups a killed test session left (its pid, in the name, is gone)."""
    for controllers, mountpoint in _mountpoints().items():
        if "cpuset" in controllers:
            continue
        for group in mountpoint.rglob(f"{_CGROUP_PREFIX}-*"):
            pid = group.name.split("-")[1] if group.name.count("-") >= 2 else ""
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with suppress(RuntimeError):
                    _remove_cgroup_tree(group, timeout_s=1.0)


def _parents_to_open() -> list[str]:
    """Directories above the bound interpreter and checkout that other users cannot pass."""
    out: list[str] = []
    for target in (os.path.realpath(sys.base_prefix), str(REPO)):
        path = Path(target)
        for parent in reversed(path.parents):
            if str(parent) != "/" and not os.stat(parent).st_mode & 0o001 and str(parent) not in out:
                out.append(str(parent))
    return out


def _ini(sections: Mapping[str, Sequence[str]]) -> str:
    return "".join(f"[{name}]\n" + "".join(f"{line}\n" for line in lines) + "\n" for name, lines in sections.items())


def operator_unit(
    exec_start: Sequence[str], environment: Mapping[str, str], *, restart: str = "always"
) -> str:
    """The operator's own unit file, as a GPU host would have it (never rewritten by ddtree-ops)."""
    service = [f"Environment={shlex.quote(f'{k}={v}')}" for k, v in environment.items()]
    service += [
        "ExecStart=" + " ".join(shlex.quote(a) for a in exec_start),
        f"Restart={restart}",
        "RestartSec=1",
        "TimeoutStopSec=20",
    ]
    return _ini({
        "Unit": ["Description=SGLang server (the operator's unit)", "After=network.target"],
        "Service": service,
        "Install": ["WantedBy=multi-user.target"],
    })


def operator_exec_start(port: int = SERVER_PORT) -> list[str]:
    """What the operator's unit runs: the simulator standing in for SGLang, AR."""
    return [PYTHON, "-m", "ddtree_ops.sim", "--model-path", MODEL, "--host", "127.0.0.1", "--port", str(port)]


@dataclass
class SystemdHost:
    """One host: its state dir outside (the overlay's upper layer and work dir, keys), its
    network namespace, and while booted the ``unshare`` process whose child is systemd."""

    name: str
    state: Path
    netns: str
    veth: str
    address: str = ""
    gpu: str | None = "rtx-pro-6000"
    ssh_host_key: Path = field(default_factory=Path)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    cgroups: list[Path] = field(default_factory=list)
    boots: int = 0
    # The operator's server as :func:`reset` last started it: (argv, environment).
    operator_run: tuple[tuple[str, ...], frozenset[str]] | None = field(default=None, repr=False)

    @property
    def upper(self) -> Path:
        """The host's disk, as far as it changed: ``upper / "etc/..."`` is ``/etc/...`` there."""
        return self.state / "upper"

    def path(self, inside: str) -> Path:
        """A file of the host, seen from outside (only what the host or the fixture wrote)."""
        return self.upper / inside.lstrip("/")

    @property
    def init_pid(self) -> int | None:
        """This machine's pid of the host's systemd (the child of the unshare process)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            found = children.read_text().split()
        except OSError:
            return None
        return int(found[0]) if found else None

    def outer_pid(self, inner: int) -> int:
        """This machine's pid of the host's process ``inner`` (a pid as the host sees it)."""
        init = self.init_pid
        if init is None:
            raise RuntimeError(f"{self.name} is not booted")
        ns = os.readlink(f"/proc/{init}/ns/pid")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(entry / "ns/pid") != ns:
                    continue
                nspid = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            if int(nspid.split()[-1]) == inner:
                return int(entry.name)
        raise RuntimeError(f"{self.name}: no process {inner}")

    def run(self, *argv: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside the booted host (all of its namespaces), for assertions."""
        pid = self.init_pid
        if pid is None:
            raise RuntimeError(f"{self.name} is not booted")
        done = subprocess.run(["nsenter", "-t", str(pid), "-a", *argv], capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def systemctl_show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"-p{p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def boot(self, timeout_s: float = 60.0) -> None:
        """Boot the host's systemd and wait until it is up and its sshd accepts connections."""
        if self.proc is not None and self.proc.poll() is None:
            return
        root = self.state / "root"
        root.mkdir(parents=True, exist_ok=True)
        (self.state / "work").mkdir(parents=True, exist_ok=True)
        tag = f"{_CGROUP_PREFIX}-{os.getpid()}-{self.netns.rsplit('-', 2)[-2]}-{self.name}-{self.boots}"
        self.cgroups = _own_cgroups(tag)
        procs = ":".join(str(g / "cgroup.procs") for g in self.cgroups)
        binds = sorted({str(REPO), os.path.realpath(sys.base_prefix)})
        argv = [
            "sh", "-c", _LAUNCH, "launch", procs,
            "nsenter", f"--net=/run/netns/{self.netns}", "--",
            "unshare", "--pid", "--fork", "--kill-child", "--mount", "--uts", "--ipc", "--cgroup",
            "bash", "-c", _INIT, "init", str(self.state), *binds,
        ]
        self.boots += 1
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SYSTEMD": SYSTEMD}
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=(self.state / "boot.log").open("ab"), env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        state = "not started"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: systemd exited at boot ({self.proc.returncode}): "
                                   f"{self.diagnostics()}")
            if self.init_pid is not None:
                with suppress(RuntimeError, subprocess.TimeoutExpired):
                    state = self.run("systemctl", "is-system-running", check=False, timeout=5).stdout.strip()
                if state in ("running", "degraded") and self._ssh_listens():
                    if state == "degraded":
                        failed = self.run("systemctl", "--failed", "--no-legend", check=False).stdout.strip()
                        raise RuntimeError(f"{self.name}: booted degraded: {failed}")
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: not up after {timeout_s}s (systemd says {state!r}): {self.diagnostics()}")

    def _ssh_listens(self) -> bool:
        try:
            with socket.create_connection((self.address, 22), timeout=0.5):
                return True
        except OSError:
            return False

    def diagnostics(self) -> str:
        parts = []
        for name in ("boot.log", "console.log"):
            path = self.state / name
            if path.exists():
                parts.append(f"{name}: {path.read_text(errors='replace')[-1500:]}")
        return " | ".join(parts) or "(no output)"

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """A clean power-off (``systemctl poweroff``'s signal to PID 1), then the cgroups
        removed. Killed after ``timeout_s`` if it does not go down."""
        pid = self.init_pid
        if self.proc is not None and pid is not None:
            os.kill(pid, signal.SIGRTMIN + 4)  # systemd's "power off" request
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """The host gone at once (power cut): the namespace's init killed, so every process
        in it dies; then its cgroups removed."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                pid = self.init_pid
                if pid is not None:
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None
        errors = []
        for group in reversed(self.cgroups):
            try:
                _remove_cgroup_tree(group)
            except RuntimeError as exc:
                errors.append(str(exc))
        self.cgroups = []
        if errors:
            raise RuntimeError("; ".join(errors))


@dataclass
class SystemdFleet:
    root: Path
    hosts: list[SystemdHost]
    inventory: Path
    client_key: Path
    known_hosts: Path

    def __getitem__(self, name: str) -> SystemdHost:
        return next(h for h in self.hosts if h.name == name)

    def close(self) -> None:
        errors: list[str] = []
        for host in self.hosts:
            try:
                host.kill()
            except Exception as exc:  # noqa: BLE001 - every host is cleaned up whatever one says
                errors.append(f"{host.name}: {exc}")
            errors += _delete_netns(host.netns, host.veth)
        if errors:
            raise RuntimeError("; ".join(errors))


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


_SHELL_RC_FILES = (".bashrc", ".profile", ".bash_profile", ".bash_login")


def _own_shell_rc_files(up: Path) -> None:
    """The host's root gets shell rc files of its own, empty, over whatever this machine's
    root has: sshd runs every command through root's bash, which reads ~/.bashrc when run by
    sshd. A machine's rc file is not the test host's (a `pyenv init` there forked ~40
    processes, ~0.1 s of CPU, for every command of every test on a systemd host, and put
    its shims first on the host's PATH)."""
    home = Path(pwd.getpwuid(0).pw_dir)
    mine = up / home.relative_to("/")
    for name in _SHELL_RC_FILES:
        if (home / name).exists():
            if not mine.exists():
                mine.mkdir(parents=True)
                mine.chmod(home.stat().st_mode & 0o7777)
            _write(mine / name, "# the test host's own (empty): not this machine's\n")


def _prepare_disk(host: SystemdHost, template: Path, authorized: Path, sim_env: Mapping[str, str]) -> None:
    """What the host's disk holds before its first boot: its identity, the masks, our
    sshd as an enabled unit, the Python prefix with SGLang, an nvidia-smi stand-in and
    the operator's enabled ``sglang.service``."""
    up = host.upper
    _write(up / "etc/hostname", host.name + "\n")
    # The Python the host runs lives under /root on this machine (0700): let other users
    # reach it, as a GPU host's Python is reachable by every account that may run it.
    for inside in _parents_to_open():
        (up / inside.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (up / inside.lstrip("/")).chmod(0o755 if os.stat(inside).st_mode & 0o005 else 0o711)
    _write(up / "etc/machine-id", secrets.token_hex(16) + "\n", 0o444)
    _own_shell_rc_files(up)
    system = up / "etc/systemd/system"
    system.mkdir(parents=True, exist_ok=True)
    for unit in MASKED_UNITS:
        link = system / unit
        if not link.is_symlink():
            link.symlink_to("/dev/null")
    # The host's own sshd, listening on its address only, as a unit of its systemd.
    ssh_dir = up / "etc/ddtree-test"
    key = keygen(ssh_dir / "ssh_host_ed25519_key", host.name)
    host.ssh_host_key = key
    # Readable by every user: sshd reads it with the privileges of the user logging in.
    _write(ssh_dir / "authorized_keys", authorized.read_text(), 0o644)
    _write(ssh_dir / "sshd_config", "\n".join([
        "Port 22", f"ListenAddress {host.address}", "HostKey /etc/ddtree-test/ssh_host_ed25519_key",
        "AuthorizedKeysFile /etc/ddtree-test/authorized_keys", "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        "StrictModes no", "MaxStartups 100:30:200", "MaxSessions 100", "LogLevel ERROR",
        "Subsystem sftp internal-sftp", "",
    ]))
    _write(system / "ddtree-test-sshd.service", _ini({
        "Unit": ["Description=sshd of the test host", "After=network.target"],
        "Service": ["ExecStartPre=/bin/mkdir -p /run/sshd",
                    "ExecStart=/usr/sbin/sshd -D -e -f /etc/ddtree-test/sshd_config", "Restart=always"],
        "Install": ["WantedBy=multi-user.target"],
    }))
    wants = system / "multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    (wants / "ddtree-test-sshd.service").symlink_to("/etc/systemd/system/ddtree-test-sshd.service")
    # SGLang's Python prefix and the GPU stand-in, where a GPU host has them.
    shutil.copytree(template, up / PREFIX.lstrip("/"), symlinks=True, ignore=shutil.ignore_patterns(".ready"))
    if host.gpu is not None:
        write_nvidia_smi(up / "usr/local/bin", host.gpu)
    env = {**sim_env, **({"SIM_GPU": host.gpu} if host.gpu else {})}
    _write(system / UNIT, operator_unit(operator_exec_start(), env))
    (wants / UNIT).symlink_to(f"/etc/systemd/system/{UNIT}")


def build_systemd_fleet(
    root: Path, count: int = 1, *, gpus: Sequence[str | None] = ("rtx-pro-6000",),
    sim_env: Mapping[str, str] = FAST_SIM_ENV,
) -> SystemdFleet:
    """``count`` systemd hosts (GPU models cycled from ``gpus``), booted, with an inventory
    (``manager: systemd``, ``unit: sglang.service``) that reaches them over SSH."""
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_cgroups()
    client_key = keygen(root / "client" / "id_ed25519", "ddtree-ops-systemd-client")
    authorized = root / "client" / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    template = cached_prefix_template(find_wheel())
    suffix = secrets.token_hex(3)
    fleet = SystemdFleet(root=root, hosts=[], inventory=root / "systemd.yaml", client_key=client_key,
                         known_hosts=root / "client" / "known_hosts")
    try:
        with _allocation_lock():
            _remove_stale()
            subnets = _free_subnets(count)
            for i, subnet in enumerate(subnets):
                host = SystemdHost(name=f"sd-{i}", state=root / f"sd-{i}", netns=f"ddt-{os.getpid()}-{suffix}-s{i}",
                                   veth=f"dv{suffix}s{i}a", gpu=gpus[i % len(gpus)])
                fleet.hosts.append(host)  # before anything exists, so close() cleans up a half-built host
                _, host.address = _make_netns(host.netns, host.veth, subnet)
        for host in fleet.hosts:
            _prepare_disk(host, template, authorized, sim_env)
        for host in fleet.hosts:
            host.boot()
        fleet.known_hosts.write_text("".join(f"{h.address} {public_key(h.ssh_host_key)}\n" for h in fleet.hosts))
        fleet.inventory.write_text(yaml.safe_dump(systemd_inventory(fleet), sort_keys=False))
    except BaseException:
        fleet.close()
        raise
    return fleet


def systemd_inventory(fleet: SystemdFleet, **server: object) -> dict[str, object]:
    """The fleet as an operator of systemd hosts writes it: the unit to drive, and the
    launch ddtree-ops computes into its drop-in."""
    hosts: dict[str, object] = {}
    for h in fleet.hosts:
        ddtree: dict[str, object] = {"python": PYTHON, "run_dir": "/var/lib/ddtree-ops"}
        if h.gpu:
            ddtree["gpu"] = h.gpu
        hosts[h.name] = {"ansible_host": h.address, "ddtree": ddtree}
    settings: dict[str, object] = {
        "manager": "systemd", "unit": UNIT, "port": SERVER_PORT, "command": "{python} -m ddtree_ops.sim",
        "model_path": MODEL, "draft_model_path": DRAFT, "expected_load_s": 5, **server,
    }
    return {"all": {"children": {"systemd_hosts": {
        "vars": {"ansible_user": "root", "ansible_ssh_private_key_file": str(fleet.client_key),
                 "ddtree": {"known_hosts": str(fleet.known_hosts), "server": settings}},
        "hosts": hosts,
    }}}}


def iter_fleet(root: Path, count: int = 1, **kw: object) -> Iterator[SystemdFleet]:
    """A fixture body: the fleet, closed (every host killed, namespaces and cgroups
    removed) however the test ends."""
    fleet = build_systemd_fleet(root, count, **kw)  # type: ignore[arg-type]
    try:
        yield fleet
    finally:
        fleet.close()


_HEALTH = (
    "import sys, urllib.request\n"
    "try:\n"
    "    code = urllib.request.urlopen('http://127.0.0.1:%d/health_generate' % int(sys.argv[1]), timeout=5).status\n"
    "except Exception:\n"
    "    code = 0\n"
    "print(code)\n"
)


def serving(host: SystemdHost, port: int = SERVER_PORT) -> bool:
    """Does the host's server answer a generation (from the host itself)?"""
    done = host.run(PYTHON, "-c", _HEALTH, str(port), check=False, timeout=20)
    return done.stdout.strip() == "200"


def wait_serving(host: SystemdHost, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serving(host):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{host.name}: sglang.service does not serve after {timeout_s}s: "
                       f"{host.systemctl_show(UNIT, 'ActiveState', 'SubState', 'Result')}")


# What a test may leave on a host that is not the operator's (reset removes all of it).
_NOT_THE_OPERATORS = ("/etc/systemd/system/*.d/50-ddtree-ops.conf /etc/ddtree-ops /var/lib/ddtree-ops "
                      "/etc/systemd/system/masked-sglang.service /etc/systemd/user/*.service "
                      "/etc/systemd/system/other.service")
# Set by systemd anew at every start of a unit, whatever the unit says.
_PER_START_ENV = ("INVOCATION_ID", "JOURNAL_STREAM", "SYSTEMD_EXEC_PID", "MEMORY_PRESSURE_WATCH",
                  "MEMORY_PRESSURE_WRITE")


def _observed_run(host: SystemdHost) -> tuple[tuple[str, ...], frozenset[str]] | None:
    """The unit's running server as (argv, environment), None where the unit is not running."""
    show = host.systemctl_show(UNIT, "ActiveState", "SubState", "MainPID")
    if (show.get("ActiveState"), show.get("SubState")) != ("active", "running") or show.get("MainPID") in ("", "0"):
        return None
    raw = host.run("sh", "-c", f"cat /proc/{show['MainPID']}/cmdline && echo && cat /proc/{show['MainPID']}/environ",
                   check=False)
    argv, _, environ = raw.stdout.partition("\n")
    if raw.returncode != 0 or not argv:
        return None
    env = frozenset(v for v in environ.split("\0") if v and v.split("=", 1)[0] not in _PER_START_ENV)
    return tuple(a for a in argv.split("\0") if a), env


def reset(host: SystemdHost) -> None:
    """Back to the operator's state: no drop-in or env file of ours, no launch record, the
    unit on its own ExecStart and serving. (The patch is the CLI's to roll back.)

    The unit is restarted unless it is observed to run the operator's server already: no
    drop-in of ours, and the very command line and environment it ran after the last
    restart here (a test that only read, or that put the operator's server back itself).
    A restart would start that same launch again, and a simulator start is seconds of CPU
    (mostly torch's import) in a lane that is CPU-bound."""
    dropin = host.run("sh", "-c", "ls /etc/systemd/system/*.d/50-ddtree-ops.conf", check=False).returncode == 0
    running = _observed_run(host)
    host.run("sh", "-c", f"rm -rf {_NOT_THE_OPERATORS} && systemctl daemon-reload && systemctl reset-failed")
    if not dropin and host.operator_run is not None and running == host.operator_run and serving(host):
        return
    host.run("systemctl", "restart", UNIT)
    wait_serving(host)
    host.operator_run = _observed_run(host)


def main_pid(host: SystemdHost, unit: str = UNIT) -> int:
    return int(host.systemctl_show(unit, "MainPID")["MainPID"])


def cmdline(host: SystemdHost, pid: int) -> list[str]:
    raw = host.run("cat", f"/proc/{pid}/cmdline").stdout
    return [a for a in raw.split("\0") if a]
