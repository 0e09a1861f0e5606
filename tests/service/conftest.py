"""Hosts that run the simulator on this machine, fast: small SIM_LOAD_S, fast SIM_TIME_SCALE."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.service import lifecycle
from ddtree_ops.transport.local import LocalTransport

SimHostFactory = Callable[..., Host]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sim_host(
    run_dir: Path,
    *,
    name: str = "sim",
    gpu: str = "rtx-pro-6000",
    load_s: float = 2.0,
    time_scale: float = 0.1,
    expected_load_s: float = 2.0,
    python: str = sys.executable,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    connection: str = "local",
    **host_fields: object,
) -> Host:
    env = {"SIM_GPU": gpu, "SIM_LOAD_S": str(load_s), "SIM_TIME_SCALE": str(time_scale)}
    env.update(extra_env or {})
    server = ServerSettings(
        model_path="sim/qwen3-8b",
        draft_model_path="sim/qwen3-8b-dflash",
        port=port or free_port(),
        env=env,
        expected_load_s=expected_load_s,
        command="{python} -m ddtree_ops.sim",
        extra_args=extra_args,
    )
    return Host(
        name=name,
        connection=connection,  # type: ignore[arg-type]
        ddtree=DdtreeSettings(python=python, run_dir=str(run_dir), gpu=gpu, server=server),
        source="<test>",
        **host_fields,  # type: ignore[arg-type]
    )


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
