"""Remote facts about a host, gathered in ONE round trip.

A small stdlib-only Python program is sent on stdin to the host's configured interpreter
and answers one message (transport/hostprogram.py): Python version, SGLang version and package directory (found
with ``importlib.util.find_spec`` / ``importlib.metadata`` — importing SGLang takes
seconds and may fail for reasons unrelated to whether it is installed), torch and the
CUDA version it was built for (read from its version file, not imported), GPUs from
``nvidia-smi`` (compute capability included: the B300 CUDA-graph fault is specific to
sm_103), free disk at the package directory, whether the configured server port is
taken, and what a server answering on a taken port says of its CUDA-graph ceiling per
tree budget (``/server_info``; :mod:`ddtree_ops.graphceiling`). Many hosts times many
checks would otherwise be many SSH round trips; here it is one per host, which a test
counts.

:func:`probe_host` never raises: an unreachable host is a fact (``error``), so that a
fleet-wide doctor always reports every host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ddtree_ops.errors import DdtreeOpsError, stderr_tail
from ddtree_ops.fleet import FleetResult, run_on_hosts
from ddtree_ops.graphceiling import GraphCeilings, graph_ceilings
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport import RoundTripCounter, Transport, open_transport
from ddtree_ops.transport.hostprogram import run_program

PROBE_TIMEOUT_S = 120.0

# Runs on the host with only the standard library (Python >= 3.8), framed as every host
# program is (transport/hostprogram.py): the ports and bind address arrive in PAYLOAD.
PROBE_SOURCE = r'''
import json, os, platform, shutil, socket, subprocess, sys
import urllib.request

def main(ports, bind_host):
    out = {"python_version": platform.python_version(), "python_executable": sys.executable}
    sglang_dir = sglang_version = None
    try:
        import importlib.util
        spec = importlib.util.find_spec("sglang")
        if spec is not None:
            if spec.submodule_search_locations:
                sglang_dir = list(spec.submodule_search_locations)[0]
            elif spec.origin:
                sglang_dir = os.path.dirname(spec.origin)
    except Exception as exc:
        out["sglang_error"] = "find_spec failed: %s" % exc
    try:
        import importlib.metadata as md
        try:
            sglang_version = md.version("sglang")
        except md.PackageNotFoundError:
            pass
        try:
            out["torch_version"] = md.version("torch")
        except md.PackageNotFoundError:
            out["torch_version"] = None
    except ImportError:
        out["torch_version"] = None
    out["sglang_dir"] = sglang_dir
    out["sglang_version"] = sglang_version
    # Whether SGLang there would know DDTREE: the DDTree plugin's entry point, and the
    # module it names present (what the bundle's deploy puts there, and rollback takes away).
    out["ddtree_plugin"] = None
    if sglang_dir:
        try:
            eps = md.entry_points()
            group = (eps.select(group="sglang.srt.plugins") if hasattr(eps, "select")
                     else eps.get("sglang.srt.plugins", []))
            names = [ep.value.split(":")[0] for ep in group if ep.name == "ddtree"]
            out["ddtree_plugin"] = bool(names) and os.path.isfile(
                os.path.join(os.path.dirname(sglang_dir), *names[0].split(".")) + ".py")
        except Exception:
            pass

    gpus = []
    smi = shutil.which("nvidia-smi")
    out["gpu_error"] = None
    if smi:
        try:
            res = subprocess.run(
                [smi, "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=30)
            if res.returncode == 0:
                for line in res.stdout.splitlines():
                    parts = [p.strip() for p in line.split(",")]
                    if len(parts) >= 4 and parts[0]:
                        gpus.append({"name": parts[0], "driver_version": parts[1],
                                     "memory_total": parts[2], "compute_cap": parts[3]})
            else:
                tail = (res.stderr or res.stdout).strip()[-300:]
                out["gpu_error"] = "nvidia-smi exit %d: %s" % (res.returncode, tail)
        except Exception as exc:
            out["gpu_error"] = "nvidia-smi failed: %s" % exc
    out["gpus"] = gpus
    # Only a list nvidia-smi gave counts the host's GPUs; without it "no GPUs" means unknown.
    out["gpus_counted"] = bool(smi) and out["gpu_error"] is None

    # Importing torch to ask torch.cuda.is_available() takes seconds per host; its
    # version.py says which CUDA it was built for, and nvidia-smi says whether a GPU and
    # driver are there. Both together is what "CUDA available" means for a server launch.
    out["torch_cuda"] = None
    out["cuda_available"] = None
    if out["torch_version"]:
        try:
            tspec = importlib.util.find_spec("torch")
            vfile = os.path.join(list(tspec.submodule_search_locations)[0], "version.py")
            with open(vfile) as fh:
                for vline in fh:
                    if vline.startswith("cuda"):
                        value = vline.split("=", 1)[1].strip().strip("'\"")
                        out["torch_cuda"] = None if value == "None" else value
                        break
        except Exception:
            pass
        out["cuda_available"] = bool(out["torch_cuda"] and gpus)

    where = sglang_dir or os.path.expanduser("~")
    try:
        out["disk_free_bytes"] = shutil.disk_usage(where).free
    except OSError:
        out["disk_free_bytes"] = None

    # Every port a server of this host will use: one, or one per GPU slot.
    out["port"] = ports[0]
    busy = []
    for port in ports:
        sock = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET)
        # Same options as the server's own listener, so "free" here means it could bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError:
            busy.append(port)
        finally:
            sock.close()
    out["port_in_use"] = ports[0] in busy
    out["ports_busy"] = busy
    out["servers"] = [s for s in (server_info(bind_host, p) for p in busy) if s is not None]
    out["units"] = [unit_facts(u) for u in units]
    return out

def server_info(bind_host, port):
    """What a server answering on a busy port says of its DDTree tree and graphs (the
    parts of /server_info doctor shows), or None: not an SGLang server, or no answer."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(bind_host, bind_host)
    url = "http://%s:%d/server_info" % ("[%s]" % host if ":" in host else host, port)
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            info = json.loads(resp.read().decode("utf-8"))
    except Exception:
        return None
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    live = states[0].get("ddtree") if isinstance(states, list) and states and isinstance(states[0], dict) else None
    return {"port": port, "speculative_algorithm": info.get("speculative_algorithm"), "ddtree": info.get("ddtree"),
            "internal_states": [{"ddtree": live}] if isinstance(live, dict) else []}

def unit_facts(unit):
    """What the host's systemd says of the unit that runs SGLang there (manager: systemd)."""
    props = {"Id": unit}
    if not os.path.isdir("/run/systemd/system"):
        props["error"] = "systemd is not the service manager of this host"
        return props
    try:
        res = subprocess.run(
            ["systemctl", "show", "-pLoadState", "-pActiveState", "-pSubState", "-pNRestarts",
             "-pUnitFileState", "-pDropInPaths", "-pMainPID", "--", unit],  # "--": no unit name is an option
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=30)
    except Exception as exc:
        props["error"] = "systemctl: %s" % exc
        return props
    if res.returncode != 0:
        props["error"] = (res.stderr or res.stdout).strip()[-300:]
    for line in res.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key] = value
    return props

units = PAYLOAD.get("units") or []
reply(main([int(p) for p in PAYLOAD["ports"]], PAYLOAD["bind_host"]))
'''


@dataclass(frozen=True)
class GpuInfo:
    name: str
    driver_version: str
    memory_total: str
    compute_cap: str

    @property
    def sm(self) -> str:
        """``12.0`` -> ``sm_120``: the form CUDA errors and kernels speak."""
        return "sm_" + self.compute_cap.replace(".", "")


@dataclass(frozen=True)
class UnitFacts:
    """A systemd unit as the probe found it (``manager: systemd`` hosts)."""

    name: str
    load: str | None = None
    active: str | None = None
    sub: str | None = None
    restarts: int | None = None
    enabled: str | None = None
    dropin_in_effect: bool = False
    main_pid: int | None = None
    error: str | None = None

    @classmethod
    def from_probe(cls, props: dict[str, str]) -> UnitFacts:
        def number(key: str) -> int | None:
            value = props.get(key, "")
            return int(value) if value.isdigit() else None

        name = props.get("Id", "?")
        ours = f"/etc/systemd/system/{name}.d/50-ddtree-ops.conf"
        pid = number("MainPID")
        return cls(
            name=name, load=props.get("LoadState"), active=props.get("ActiveState"), sub=props.get("SubState"),
            restarts=number("NRestarts"), enabled=props.get("UnitFileState"),
            dropin_in_effect=ours in props.get("DropInPaths", "").split(), main_pid=pid or None,
            error=props.get("error"),
        )

    @property
    def problem(self) -> str | None:
        """Why ddtree-ops could not drive this unit, where the probe can tell."""
        if self.error:
            return f"{self.name}: {self.error}"
        if self.load == "not-found":
            return f"unit {self.name} not found"
        if self.load == "masked" or self.enabled == "masked":
            return f"unit {self.name} is masked"
        return None

    def describe(self) -> str:
        if self.problem:
            return self.problem
        restarts = f", NRestarts {self.restarts}" if self.restarts else ""
        dropin = "our drop-in" if self.dropin_in_effect else "its own ExecStart"
        return f"{self.name} {self.active} ({self.sub}), {self.enabled}{restarts}, {dropin}"


@dataclass(frozen=True)
class ServedLaunch:
    """A server answering ``/server_info`` on one of the host's ports."""

    port: int
    algorithm: str | None  # speculative_algorithm; None: autoregressive
    # Per budget, the largest batch its verify graph replays (DDTREE only; None where the
    # server does not report it).
    ceilings: GraphCeilings | None = None
    # The ceilings in words, saying that concurrency above them runs eager: a field, so
    # that --json carries the sentence the table shows.
    summary: str = field(init=False)

    def __post_init__(self) -> None:
        if self.ceilings is not None:
            text = self.ceilings.describe()
        elif self.algorithm == "DDTREE":
            text = "DDTREE, no graph ceiling reported (a bundle that predates it)"
        else:
            text = f"{self.algorithm or 'autoregressive'}: no DDTree states"
        object.__setattr__(self, "summary", text)

    def describe(self) -> str:
        return f"port {self.port}: {self.summary}"


def _served(raw: object) -> ServedLaunch | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("port"), int):
        return None
    algorithm = raw.get("speculative_algorithm")
    return ServedLaunch(port=raw["port"], algorithm=algorithm if isinstance(algorithm, str) else None,
                        ceilings=graph_ceilings(raw))


@dataclass(frozen=True)
class HostFacts:
    host: str
    reachable: bool = False
    python: str = ""
    python_version: str | None = None
    python_executable: str | None = None
    sglang_version: str | None = None
    sglang_dir: str | None = None
    # SGLang there has the DDTree plugin registered (None: unknown, or no SGLang).
    ddtree_plugin: bool | None = None
    torch_version: str | None = None
    torch_cuda: str | None = None  # the CUDA version torch was built for; None for CPU builds
    cuda_available: bool | None = None
    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)
    gpu_error: str | None = None
    gpus_counted: bool = False  # nvidia-smi listed the GPUs: len(gpus) is the host's count
    disk_free_bytes: int | None = None
    port: int | None = None
    port_in_use: bool | None = None
    ports: tuple[int, ...] = ()  # every server port checked: server.port, or each slot's
    ports_busy: tuple[int, ...] = ()
    units: tuple[UnitFacts, ...] = ()  # manager systemd: the unit (each slot's instance)
    servers: tuple[ServedLaunch, ...] = ()  # what answers /server_info on a taken port
    error: str | None = None
    error_type: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def probe_host(transport: Transport, host: Host, *, timeout: float = PROBE_TIMEOUT_S) -> HostFacts:
    """One remote command; every failure is returned as ``error``, never raised."""
    port = host.ddtree.server.port
    ports = tuple(slot.port for slot in host.ddtree.server.slots) or (port,)
    units = [slot.ddtree.server.unit for slot in host.slot_hosts()] if host.ddtree.server.manager == "systemd" else []
    payload = {"ports": list(ports), "bind_host": host.ddtree.server.bind_host, "units": units}
    try:
        run = run_program(transport, host.python, PROBE_SOURCE, payload, timeout=timeout)
    except DdtreeOpsError as exc:
        return HostFacts(
            host=host.name, python=host.python, port=port, error=exc.message or str(exc), error_type=type(exc).__name__
        )
    result, data = run.result, run.reply
    if data is None:
        if result.returncode in (126, 127):
            why = f"remote interpreter {host.python!r} not found or not executable (ddtree.python)"
        else:
            why = f"probe with {host.python} failed (exit {result.returncode})"
        tail = stderr_tail(result.stderr)
        return HostFacts(
            host=host.name,
            reachable=True,
            python=host.python,
            port=port,
            error=f"{why}: {tail}" if tail else why,
            error_type="CommandFailed",
            duration_s=result.duration,
        )
    return HostFacts(
        host=host.name,
        reachable=True,
        python=host.python,
        python_version=data.get("python_version"),
        python_executable=data.get("python_executable"),
        sglang_version=data.get("sglang_version"),
        sglang_dir=data.get("sglang_dir"),
        ddtree_plugin=data.get("ddtree_plugin"),
        torch_version=data.get("torch_version"),
        torch_cuda=data.get("torch_cuda"),
        cuda_available=data.get("cuda_available"),
        gpus=tuple(GpuInfo(**g) for g in data.get("gpus", [])),
        gpu_error=data.get("gpu_error"),
        gpus_counted=bool(data.get("gpus_counted")),
        disk_free_bytes=data.get("disk_free_bytes"),
        port=data.get("port"),
        port_in_use=data.get("port_in_use"),
        ports=ports,
        ports_busy=tuple(data.get("ports_busy") or ()),
        units=tuple(UnitFacts.from_probe(u) for u in data.get("units") or ()),
        servers=tuple(s for s in map(_served, data.get("servers") or ()) if s is not None),
        duration_s=result.duration,
    )


def slot_gpu_problem(host: Host, facts: HostFacts) -> str | None:
    """Why ``host``'s GPU slots do not fit the GPUs its probe saw, or None.

    Only the host knows how many GPUs it has, so the inventory cannot check this at load
    time; ``doctor`` does. None when the host has no slots, was not reached, or has no
    nvidia-smi (nothing counted its GPUs: the simulator's hosts)."""
    slots = host.ddtree.server.slots
    if not slots or not facts.ok or not facts.gpus_counted:
        return None
    count = len(facts.gpus)
    for index, slot in enumerate(slots):
        missing = [gpu for gpu in slot.gpus if gpu >= count]
        if missing:
            seen = f"GPUs 0-{count - 1}" if count else "no GPU"
            return (
                f"ddtree.server.slots: slot {index} uses GPU {missing[0]} but nvidia-smi on {host.name} "
                f"lists {seen} ({host.source})"
            )
    return None


def probe_hosts(
    hosts: Sequence[Host],
    *,
    host_key_policy: str = "strict",
    connect_timeout: float = 10.0,
    max_parallel: int = 8,
    counters: dict[str, RoundTripCounter] | None = None,
) -> FleetResult[HostFacts]:
    """``probe_host`` on every host in parallel; ``counters`` (host -> counter) lets a
    caller count the remote round trips per host."""

    def one(host: Host) -> HostFacts:
        counter = counters.get(host.name) if counters is not None else None
        with open_transport(
            host, host_key_policy=host_key_policy, connect_timeout=connect_timeout, counter=counter
        ) as t:
            return probe_host(t, host)

    return run_on_hosts(hosts, one, max_parallel=max_parallel)
