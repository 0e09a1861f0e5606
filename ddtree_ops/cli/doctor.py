"""`ddtree-ops doctor TARGET`: is each host ready for a DDTree deployment?

One remote round trip per host (see :mod:`ddtree_ops.probe`), all hosts in parallel.
Exits non-zero when a host could not be probed; the table says why, per host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import typer
from rich.text import Text

from ddtree_ops.cli.common import load_hosts, raise_if_failed, render_host_results
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.errors import DdtreeOpsError, InventoryError, UnitRefused, recorded_error
from ddtree_ops.inventory_types import Host
from ddtree_ops.probe import HostFacts, probe_hosts, slot_gpu_problem


def _gpus(f: HostFacts) -> Text | str:
    if f.gpu_error:
        return Text(f.gpu_error, style="yellow")
    if not f.gpus:
        return Text("no GPU visible", style="yellow")
    kinds: dict[str, int] = {}
    for g in f.gpus:
        key = f"{g.name} ({g.sm}, {g.memory_total}, driver {g.driver_version})"
        kinds[key] = kinds.get(key, 0) + 1
    return "; ".join(f"{n}x {k}" for k, n in kinds.items())


def _sglang(f: HostFacts) -> Text | str:
    if not f.sglang_version and not f.sglang_dir:
        return Text("not installed", style="red")
    return f"{f.sglang_version or '?'} at {f.sglang_dir or '?'}"


def _torch(f: HostFacts) -> Text | str:
    if not f.torch_version:
        return Text("no torch", style="yellow")
    if not f.torch_cuda:
        return f"{f.torch_version}, CPU-only build"
    if not f.cuda_available:
        return Text(f"{f.torch_version}, CUDA {f.torch_cuda} build but no GPU visible", style="yellow")
    return f"{f.torch_version}, CUDA {f.torch_cuda}"


def _disk(f: HostFacts) -> str | None:
    if f.disk_free_bytes is None:
        return None
    return f"{f.disk_free_bytes / 2**30:.1f} GiB free"


def _port(f: HostFacts) -> Text | str | None:
    if f.port_in_use is None:
        return None
    if len(f.ports) > 1:  # one per GPU slot
        busy = ", ".join(map(str, f.ports_busy))
        listed = ", ".join(map(str, f.ports))
        return Text(f"{busy} in use (of {listed})", style="yellow") if busy else f"{listed} free"
    return Text(f"{f.port} in use", style="yellow") if f.port_in_use else f"{f.port} free"


def _graph_ceiling(f: HostFacts) -> str | None:
    """What each server running on the host says of its CUDA-graph ceiling per budget."""
    return "; ".join(s.describe() for s in f.servers) or None


def _slots(host: Host) -> str | None:
    slots = host.ddtree.server.slots
    if not slots:
        return None
    return ", ".join(f"{i}: GPU {s.cuda_visible_devices} port {s.port}" for i, s in enumerate(slots))


def _service(host: Host, f: HostFacts) -> Text | str:
    """Who runs the server, and under systemd the unit's state."""
    if host.ddtree.server.manager != "systemd":
        return "process manager (ddtree-ops launches SGLang)"
    if not f.units:
        return Text(f"systemd: {host.ddtree.server.unit} not reported", style="yellow")
    text = "; ".join(u.describe() for u in f.units)
    return Text(f"systemd: {text}", style="yellow" if any(u.problem for u in f.units) else "")


Getter = Callable[[HostFacts], object]


def _probed(getter: Getter) -> Getter:
    """A fact only where the probe ran: a host it could not reach (or whose Python did not
    answer) has no SGLang, torch or GPU to report, so it says nothing of them ("-")."""
    return lambda f: getter(f) if f.error is None else None


def _columns(hosts: Sequence[Host]) -> list[tuple[str, Getter]]:
    by_name = {h.name: h for h in hosts}
    columns: list[tuple[str, Getter]] = [
        ("service", _probed(lambda f: _service(by_name[f.host], f))),
        ("python", _probed(lambda f: f.python_version)),
        ("sglang", _probed(_sglang)),
        ("torch", _probed(_torch)),
        ("gpus", _probed(_gpus)),
        ("disk", _probed(_disk)),
        ("port", _probed(_port)),
        ("graph ceiling", _probed(_graph_ceiling)),
    ]
    if any(h.ddtree.server.slots for h in hosts):
        columns.append(("slots", lambda f: _slots(by_name[f.host])))
    return columns


def _failure(f: HostFacts) -> DdtreeOpsError | None:
    """The probe keeps an unreachable host's error as a fact; as an error again, with its code."""
    return None if f.error is None else recorded_error(f.error_type, f.error, host=f.host)


def _judge(hosts: Sequence[Host]) -> Callable[[HostFacts], DdtreeOpsError | None]:
    """A host fails doctor when it could not be probed, or when its GPU slots name GPUs
    it does not have (known only now that nvidia-smi has counted them)."""
    by_name = {h.name: h for h in hosts}

    def judge(f: HostFacts) -> DdtreeOpsError | None:
        problem = slot_gpu_problem(by_name[f.host], f)
        unit = next((u.problem for u in f.units if u.problem), None)
        return _failure(f) or (InventoryError(problem, host=f.host) if problem else None) or (
            UnitRefused(f"{unit}: restart would refuse this host", host=f.host) if unit else None)

    return judge


@app.command("doctor")
def doctor_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Group, host, 'all', or a comma list."),
    connect_timeout: float = typer.Option(10.0, "--connect-timeout", min=0.1, help="Seconds to reach each host."),
) -> None:
    """Check each host in one remote round trip: who runs the server (ddtree-ops, or a systemd
    unit and its state), SSH, Python, SGLang, torch/CUDA, GPUs, disk, port (and that its GPU slots
    name GPUs it has), and for a server running there its CUDA-graph ceiling per tree budget (the
    largest batch that replays a graph; concurrency above it runs eager). A slot HOST/I checks its
    host."""
    obj: AppContext = ctx.obj
    hosts = load_hosts(obj, target)
    results = probe_hosts(
        hosts, host_key_policy=obj.host_key_policy, connect_timeout=connect_timeout, max_parallel=obj.max_parallel
    )
    judge = _judge(hosts)
    render_host_results(obj, f"doctor: {target}", results, _columns(hosts), failure=judge)
    raise_if_failed("doctor", results, failure=judge)
