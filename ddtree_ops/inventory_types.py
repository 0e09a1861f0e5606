"""Typed, frozen host objects that an inventory resolves to.

Kept apart from the loader (:mod:`ddtree_ops.inventory`) so that every other module can
depend on the types without the YAML machinery. Defaults live here, in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

DEFAULT_SERVER_COMMAND = "{python} -m sglang.launch_server"


def _frozen_env(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    return MappingProxyType(dict(env or {}))


@dataclass(frozen=True)
class ServerSettings:
    """`ddtree: server:` — how the SGLang server on this host is launched."""

    model_path: str | None = None
    draft_model_path: str | None = None
    port: int = 30000
    bind_host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=_frozen_env)
    expected_load_s: float = 600.0
    command: str = DEFAULT_SERVER_COMMAND
    manager: Literal["process"] = "process"


@dataclass(frozen=True)
class DdtreeSettings:
    """Everything under the inventory's `ddtree:` key, group- and host-level merged."""

    python: str = "python3"
    gpu: str | None = None
    run_dir: str = "~/.ddtree-ops"
    known_hosts: str | None = None
    server: ServerSettings = field(default_factory=ServerSettings)


@dataclass(frozen=True)
class Host:
    """One resolved inventory host. `address` is None for an ssh_config alias or local host."""

    name: str
    connection: Literal["ssh", "local"] = "ssh"
    address: str | None = None
    port: int | None = None
    user: str | None = None
    key_file: str | None = None
    groups: tuple[str, ...] = ()
    ddtree: DdtreeSettings = field(default_factory=DdtreeSettings)
    source: str = ""

    @property
    def python(self) -> str:
        return self.ddtree.python
