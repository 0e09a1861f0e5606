"""Simulator hosts for the service tests, importable by name (``from simhosts import
sim_host``): ``from conftest import ...`` would get whichever directory's conftest was
imported last when several test directories are collected together."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from minisglang import deployed_python
from testports import free_port

from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings


def run_cli(
    inventory: Path, *args: str, state: Path, timeout: float = 150, path_first: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess, as a user runs it, with its own local state file and
    a terminal wide enough that no table column is dropped; ``path_first`` goes ahead of
    ``$PATH`` (stand-in tools, e.g. an nvidia-smi, for a local host)."""
    env = dict(os.environ, DDTREE_OPS_STATE=str(state), COLUMNS="200")
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [sys.executable, "-m", "ddtree_ops", "-i", str(inventory), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )


def sim_host(
    run_dir: Path,
    *,
    name: str = "sim",
    gpu: str = "rtx-pro-6000",
    load_s: float = 2.0,
    time_scale: float = 0.1,
    expected_load_s: float = 2.0,
    python: str | None = None,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    connection: str = "local",
    base: Host | None = None,
    **host_fields: object,
) -> Host:
    """A host whose server command is the simulator. With ``base`` (a fleet host) the
    connection settings are ``base``'s. ``python`` defaults to an interpreter whose SGLang
    has the DDTree bundle deployed (a loopback or netns fleet host sees this machine's
    files): the simulator serves DDTREE only from a deployed plugin."""
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
    if base is not None:
        ddtree = replace(base.ddtree, python=python or deployed_python(), run_dir=str(run_dir), gpu=gpu, server=server)
        return replace(base, name=name, ddtree=ddtree, **host_fields)  # type: ignore[arg-type]
    return Host(
        name=name,
        connection=connection,  # type: ignore[arg-type]
        ddtree=DdtreeSettings(python=python or deployed_python(), run_dir=str(run_dir), gpu=gpu, server=server),
        source="<test>",
        **host_fields,  # type: ignore[arg-type]
    )
