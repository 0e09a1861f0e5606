"""SGLang service lifecycle: launch spec, process manager, readiness, eager fallback.

The public surface is :mod:`.lifecycle` (``restart`` with its ``RestartRequest``, ``stop``,
``service_status``) and :class:`.launch.RunConfig`; the rest are its parts.
"""

from __future__ import annotations

from ddtree_ops.service.launch import (
    LaunchSpec,
    RunConfig,
    build_launch_spec,
    eager_flags,
)
from ddtree_ops.service.lifecycle import (
    LaunchFacts,
    RestartRequest,
    RestartResult,
    ServiceStatus,
    restart,
    service_status,
    stop,
)
from ddtree_ops.service.logphases import Phase, PhaseEvent
from ddtree_ops.service.manager import StopResult
from ddtree_ops.service.readiness import DeadlinePolicy, WaitReason

__all__ = [
    "DeadlinePolicy",
    "LaunchFacts",
    "LaunchSpec",
    "Phase",
    "PhaseEvent",
    "RestartRequest",
    "RestartResult",
    "RunConfig",
    "ServiceStatus",
    "StopResult",
    "WaitReason",
    "build_launch_spec",
    "eager_flags",
    "restart",
    "service_status",
    "stop",
]
