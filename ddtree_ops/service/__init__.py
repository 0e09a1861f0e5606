"""SGLang service lifecycle: launch spec, process manager, readiness, eager fallback.

The public surface is :mod:`.lifecycle` (``restart``, ``stop``, ``service_status``) and
:class:`.launch.RunConfig`; the rest are its parts.
"""

from __future__ import annotations

from ddtree_ops.service.launch import LaunchSpec, RunConfig, build_launch_spec, eager_flags
from ddtree_ops.service.lifecycle import RestartResult, ServiceStatus, restart, service_status, stop
from ddtree_ops.service.logphases import PhaseEvent
from ddtree_ops.service.manager import StopResult
from ddtree_ops.service.readiness import DeadlinePolicy

__all__ = [
    "DeadlinePolicy",
    "LaunchSpec",
    "PhaseEvent",
    "RestartResult",
    "RunConfig",
    "ServiceStatus",
    "StopResult",
    "build_launch_spec",
    "eager_flags",
    "restart",
    "service_status",
    "stop",
]
