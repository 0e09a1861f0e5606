"""`ddtree-ops doctor TARGET`: is each host ready for a DDTree deployment?

One remote round trip per host (see :mod:`ddtree_ops.probe`), all hosts in parallel.
Exits non-zero when a host could not be probed; the table says why, per host.
"""

from __future__ import annotations

import typer
from rich.text import Text

from ddtree_ops.cli.common import load_hosts, raise_if_failed, render_host_results
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.errors import DdtreeOpsError, recorded_error
from ddtree_ops.probe import HostFacts, probe_hosts


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
    return Text(f"{f.port} in use", style="yellow") if f.port_in_use else f"{f.port} free"


COLUMNS = [
    ("python", lambda f: f.python_version),
    ("sglang", _sglang),
    ("torch", _torch),
    ("gpus", _gpus),
    ("disk", _disk),
    ("port", _port),
]


def _failure(f: HostFacts) -> DdtreeOpsError | None:
    """The probe keeps an unreachable host's error as a fact; as an error again, with its code."""
    return None if f.error is None else recorded_error(f.error_type, f.error, host=f.host)


@app.command("doctor")
def doctor_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="Group, host, 'all', or a comma list."),
    connect_timeout: float = typer.Option(10.0, "--connect-timeout", min=0.1, help="Seconds to reach each host."),
) -> None:
    """Check each host in one remote round trip: SSH, Python, SGLang, torch/CUDA, GPUs, disk, port."""
    obj: AppContext = ctx.obj
    hosts = load_hosts(obj, target)
    results = probe_hosts(
        hosts, host_key_policy=obj.host_key_policy, connect_timeout=connect_timeout, max_parallel=obj.max_parallel
    )
    render_host_results(obj, f"doctor: {target}", results, COLUMNS, failure=_failure)
    raise_if_failed("doctor", results, failure=_failure)
