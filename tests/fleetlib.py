"""A fleet of real OpenSSH servers on loopback, for tests that must talk SSH for real.

Each test host is one ``/usr/sbin/sshd -D -f <own config>`` on 127.0.0.1 and a random
free port, with a generated host key, accepting one generated client key for root. Each
host has its own Python prefix (a venv holding the real SGLang 0.5.23 files installed
from the wheel without dependencies, plus a ``.pth`` exposing this project's venv so that
torch and ddtree_ops import there) and its own PATH (set by sshd's ``SetEnv``), on which
some hosts find an ``nvidia-smi`` stand-in printing what the real tool prints for an RTX
PRO 6000 Blackwell or a B300, and one host finds none.

The slow part is the prefixes: one template (``pip install --no-compile``), cached under
``.cache/fleet-prefix`` across sessions, copied per host. sshd itself starts in
milliseconds, so tests may stop and start a host's sshd freely (fault tests cut a host
mid-run).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from testports import free_port

SSHD = "/usr/sbin/sshd"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_WHEELS = REPO / ".cache" / "wheels"
SGLANG_VERSION = "0.5.23"

# name, driver, memory.total (MiB), compute_cap; what `nvidia-smi --query-gpu=...` reports.
GPU_MODELS: dict[str, tuple[str, str, str, str]] = {
    "rtx-pro-6000": ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "575.57.08", "97887", "12.0"),
    "b300": ("NVIDIA B300 SXM6 AC", "580.65.06", "275040", "10.3"),
}

_NVIDIA_SMI_STUB = '''#!/usr/bin/env python3
"""Stand-in for nvidia-smi: answers --query-gpu=... --format=csv[,noheader][,nounits] like the real tool."""
import sys
GPU = {gpu!r}
COUNT = {count}
fields = {{"name": GPU[0], "driver_version": GPU[1], "memory.total": GPU[2] + " MiB", "compute_cap": GPU[3],
          "index": None, "uuid": None, "memory.used": "0 MiB", "utilization.gpu": "0 %"}}
args = sys.argv[1:]
query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "")
if "-L" in args:
    for i in range(COUNT):
        print(f"GPU {{i}}: {{GPU[0]}} (UUID: GPU-00000000-0000-0000-0000-00000000000{{i}})")
    sys.exit(0)
if query is None:
    print("stand-in nvidia-smi: use --query-gpu", file=sys.stderr)
    sys.exit(0)
names = [q.strip() for q in query.split(",")]
unknown = [n for n in names if n not in fields]
if unknown:
    print(f'Field "{{unknown[0]}}" is not a valid field to query.', file=sys.stderr)
    sys.exit(2)
opts = fmt.split(",")
if "noheader" not in opts:
    print(", ".join(n + (" [MiB]" if n.startswith("memory") and "nounits" not in opts else "") for n in names))
for i in range(COUNT):
    row = []
    for n in names:
        v = fields[n]
        if n == "index":
            v = str(i)
        elif n == "uuid":
            v = f"GPU-00000000-0000-0000-0000-00000000000{{i}}"
        elif "nounits" in opts:
            v = v.split(" ")[0]
        row.append(v)
    print(", ".join(row))
'''


def keygen(path: Path, comment: str = "ddtree-ops-test") -> Path:
    """A fresh ed25519 key pair at ``path`` / ``path.pub``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return path


def public_key(path: Path) -> str:
    """``<type> <base64>`` of a key pair's public half."""
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


def known_hosts_line(port: int, host_key: Path, address: str = "127.0.0.1") -> str:
    return f"[{address}]:{port} {public_key(host_key)}"


@dataclass
class SshdServer:
    """One sshd on loopback. ``path_env`` becomes the PATH of every session (SetEnv)."""

    root: Path
    port: int
    host_key: Path
    authorized_keys: Path
    path_env: str = "/usr/local/bin:/usr/bin:/bin"
    # A per-host home (HOME for sessions, the SFTP start directory) makes `~` differ per
    # host like on real machines, and keeps the login user's shell rc files out of the way.
    home: Path | None = None
    extra_config: str = ""
    # Hosts with their own address (tests/netnsfleet.py) listen there, started through
    # `ip netns exec <ns>`, which execs sshd in place so that proc.pid stays sshd's.
    listen_address: str = "127.0.0.1"
    launch_prefix: tuple[str, ...] = ()
    # False: no SFTP subsystem, as some hosts' sshd are configured (a file must then travel
    # some other way, as Ansible falls back to piping).
    sftp: bool = True
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def config_path(self) -> Path:
        return self.root / "sshd_config"

    @property
    def log_path(self) -> Path:
        return self.root / "sshd.log"

    def write_config(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    f"ListenAddress {self.listen_address}",
                    f"HostKey {self.host_key}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "AllowTcpForwarding yes",
                    "MaxStartups 100:30:200",
                    "MaxSessions 100",
                    "LogLevel ERROR",
                    f"SetEnv PATH={self.path_env}" + (f" HOME={self.home}" if self.home else ""),
                    ("Subsystem sftp internal-sftp" + (f" -d {self.home}" if self.home else "")) if self.sftp else "",
                    self.extra_config,
                ]
            )
            + "\n"
        )

    def start(self, *, timeout: float = 10.0) -> None:
        if self.running:
            return
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation dir
        self.write_config()
        if self.home is not None:
            self.home.mkdir(parents=True, exist_ok=True)
        # A new session, so that stop() can end the listener and its per-connection
        # children together (that is what "the host went away" looks like to a client).
        self.proc = subprocess.Popen(
            [*self.launch_prefix, SSHD, "-D", "-e", "-f", str(self.config_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log_path.open("ab"),
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd on port {self.port} exited: {self.log_path.read_text()[-2000:]}")
            try:  # where the operator reaches the host
                with socket.create_connection((self.listen_address, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.01)
        raise RuntimeError(f"sshd on {self.listen_address}:{self.port} did not listen within {timeout}s")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """End the listener and every connection it serves (what a crashed or rebooted
        host looks like to a client). sshd puts each connection in its own session, so the
        listener's process group is not enough: its descendants are collected first (once
        the listener is gone they would be re-parented and untraceable) and killed too."""
        if self.proc is None:
            return
        victims = [self.proc.pid, *_descendants(self.proc.pid)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=5)
        self.proc = None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class FleetHost:
    name: str
    gpu: str | None
    server: SshdServer
    prefix: Path
    bin_dir: Path
    run_dir: Path
    server_port: int = 0  # where an SGLang (or simulated) server on this host listens

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        return Path(_purelib(self.prefix))

    @property
    def sglang_dir(self) -> Path:
        return self.site_packages / "sglang"


@dataclass
class Fleet:
    """What the ``ssh_fleet`` fixture yields."""

    root: Path
    hosts: list[FleetHost]
    inventory: Path
    client_key: Path
    known_hosts: Path

    def __getitem__(self, name: str) -> FleetHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def stop(self, name: str) -> None:
        self[name].server.stop()

    def start(self, name: str) -> None:
        self[name].server.start()

    def load(self):  # -> Inventory; imported lazily so this module stays import-light
        from ddtree_ops.inventory import load_inventory

        return load_inventory([self.inventory])

    def close(self) -> None:
        for host in self.hosts:
            host.server.stop()


def fast_root(fallback: Path) -> tuple[Path, bool]:
    """A directory on tmpfs when there is one (copying the prefixes there takes under a
    second instead of ~10 s on a busy disk), else ``fallback``. Returns (dir, owned): an
    owned dir must be removed by whoever made it. Leftovers of killed sessions (their pid
    is gone) are removed here, since tmpfs is memory.
    """
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return fallback, False
    for stale in shm.glob("ddtree-ops-fleet-*"):
        pid = stale.name.rsplit("-", 2)[-2] if stale.name.count("-") >= 4 else ""
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f"ddtree-ops-fleet-{os.getpid()}-", dir=shm)), True


def _purelib(prefix: Path) -> str:
    return sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)})


def find_wheel(wheels_dir: Path | None = None) -> Path:
    """The SGLang wheel, downloaded once into the wheels dir if it is not there."""
    wheels = Path(wheels_dir or os.environ.get("DDTREE_OPS_WHEELS") or DEFAULT_WHEELS)
    found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={SGLANG_VERSION}",
             "-d", str(wheels)],
            check=True,
        )
        found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    return found[-1]


def build_prefix_template(dest: Path, wheel: Path) -> Path:
    """A venv with the real SGLang files and a .pth to this project's site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = dest / "bin" / "python"
    # --no-compile: byte-compiling 130 MB of SGLang triples the install time, and no test
    # imports all of it.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile", "--no-deps",
         "--disable-pip-version-check", str(wheel)],
        check=True,
    )
    (Path(_purelib(dest)) / "ddtree_ops_dev.pth").write_text(TOOLKIT_PTH)
    return dest


# The .pth line that lets a test host's interpreter import what this project's venv holds
# (ddtree_ops for ``python -m ddtree_ops.sim``, torch, uvicorn). Bare sys.path entries, the
# venv's site-packages and the checkout, not ``site.addsitedir``: that runs the venv's own
# .pth files at every start of the host's Python, the editable install's finder among them,
# which imports pathlib: 24 ms of CPU per start instead of 12, and the suite's test hosts
# start about 10,000 (one per host program), on two CPUs.
TOOLKIT_PTH = f"import sys; sys.path.extend([{sysconfig.get_path('purelib')!r}, {str(REPO)!r}])\n"


def cached_dir(cache_root: Path, key: str, build: Callable[[Path], object]) -> Path:
    """``cache_root/key``, made by ``build(dir)`` the first time and reused afterwards.

    Built under a temporary name and renamed into place, so a session killed halfway (or
    two sessions at once) never leaves a half-built directory behind for the next one.
    """
    final = cache_root / key
    if (final / ".ready").exists():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = cache_root / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    build(staging)
    (staging / ".ready").touch()
    try:
        staging.rename(final)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another session won the race
    return final


def cached_prefix_template(wheel: Path, cache_root: Path = REPO / ".cache" / "fleet-prefix") -> Path:
    """The template, built once per wheel and interpreter and then reused by every session."""
    key = f"{wheel.stem}-py{sys.version_info.major}{sys.version_info.minor}-{_digest(TOOLKIT_PTH)}"
    return cached_dir(cache_root, key, lambda dest: build_prefix_template(dest, wheel))


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:8]


def write_nvidia_smi(bin_dir: Path, gpu: str, count: int = 8) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    stub = bin_dir / "nvidia-smi"
    stub.write_text(_NVIDIA_SMI_STUB.format(gpu=GPU_MODELS[gpu], count=count))
    stub.chmod(0o755)
    return stub


CHATTER = "chatty host: conda hook says hello"


def chatty_python(bin_dir: Path, python: str | Path) -> Path:
    """An interpreter that talks on stdout before any program runs, as hosts do: a shell
    hook (conda's activation, a login banner) echoes before ``exec``, and a
    ``sitecustomize`` prints at start-up, the second time without a newline so that the
    program's first output shares its line."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    site = bin_dir / "chatty-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        f"import sys\nprint({CHATTER!r})\nsys.stdout.write({CHATTER!r})\nsys.stdout.flush()\n"
    )
    wrapper = bin_dir / "python"
    wrapper.write_text(
        f"#!/bin/sh\necho {CHATTER!r}\nPYTHONPATH={str(site)!r} exec {str(python)!r} \"$@\"\n"
    )
    wrapper.chmod(0o755)
    return wrapper


def build_fleet(root: Path, gpus: Sequence[str | None] = ("rtx-pro-6000", "b300", None)) -> Fleet:
    """Start one sshd per entry of ``gpus`` (a GPU model, or None for a host without one)."""
    root.mkdir(parents=True, exist_ok=True)
    wheel = find_wheel()
    client_key = keygen(root / "client" / "id_ed25519", "ddtree-ops-test-client")
    authorized = root / "client" / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    template = cached_prefix_template(wheel)

    names = [f"fleet-{i}" for i in range(len(gpus))]

    def make_host(i: int) -> FleetHost:
        name, gpu = names[i], gpus[i]
        hdir = root / name
        prefix = hdir / "prefix"
        shutil.copytree(template, prefix, symlinks=True, ignore=shutil.ignore_patterns(".ready"))
        bin_dir = hdir / "bin"
        bin_dir.mkdir(parents=True)
        if gpu is not None:
            write_nvidia_smi(bin_dir, gpu)
        host_key = keygen(hdir / "ssh_host_ed25519_key", name)
        server = SshdServer(
            root=hdir / "sshd",
            port=free_port(),
            host_key=host_key,
            authorized_keys=authorized,
            path_env=f"{bin_dir}:{prefix / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            home=hdir / "home",
        )
        return FleetHost(
            name=name,
            gpu=gpu,
            server=server,
            prefix=prefix,
            bin_dir=bin_dir,
            run_dir=hdir / "run",
            server_port=free_port(),
        )

    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        hosts = list(pool.map(make_host, range(len(gpus))))

    known_hosts = root / "client" / "known_hosts"
    known_hosts.write_text("".join(known_hosts_line(h.port, h.server.host_key) + "\n" for h in hosts))
    fleet = Fleet(root=root, hosts=hosts, inventory=root / "fleet.yaml", client_key=client_key, known_hosts=known_hosts)
    fleet.inventory.write_text(yaml.safe_dump(fleet_inventory(fleet), sort_keys=False))
    try:
        for host in hosts:
            _start_with_fresh_port_on_collision(host.server)
    except BaseException:
        fleet.close()
        raise
    # Ports may have moved on a collision: rewrite what depends on them.
    known_hosts.write_text("".join(known_hosts_line(h.port, h.server.host_key) + "\n" for h in hosts))
    fleet.inventory.write_text(yaml.safe_dump(fleet_inventory(fleet), sort_keys=False))
    return fleet


def _start_with_fresh_port_on_collision(server: SshdServer, attempts: int = 5) -> None:
    # free_port() cannot reserve the port; another process may take it before sshd binds.
    for attempt in range(attempts):
        try:
            server.start()
            return
        except RuntimeError:
            if attempt == attempts - 1:
                raise
            server.stop()
            server.port = free_port()


def fleet_inventory(fleet: Fleet) -> dict[str, object]:
    """The fleet as an Ansible-style inventory (what a user would write for real hosts)."""
    hosts: dict[str, object] = {}
    for h in fleet.hosts:
        # All test hosts share one machine, so each needs its own server port.
        ddtree: dict[str, object] = {
            "python": str(h.python),
            "run_dir": str(h.run_dir),
            "server": {"port": h.server_port},
        }
        if h.gpu:
            ddtree["gpu"] = h.gpu
        hosts[h.name] = {"ansible_host": "127.0.0.1", "ansible_port": h.port, "ddtree": ddtree}
    return {
        "all": {
            "children": {
                "fleet": {
                    "vars": {
                        "ansible_user": "root",
                        "ansible_ssh_private_key_file": str(fleet.client_key),
                        "ddtree": {"known_hosts": str(fleet.known_hosts)},
                    },
                    "hosts": hosts,
                }
            }
        }
    }
