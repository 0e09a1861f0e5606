"""The patch engine: bundles, one-round-trip gather, pure plans, journaled execution.

Public surface (everything else is internal):

    load_bundle(path) -> Bundle            validated manifest + files, with .identity
    bundle_identity(bundle_or_path) -> str sha256 over manifest and files
    load_overlay(dir, to) -> Overlay       a local working dir as an ad-hoc bundle
    deploy(transport, host, bundle, RunOptions()) -> HostOutcome
    rollback(transport, host, RunOptions()) -> HostOutcome
    host_status(transport, host, bundle=None) -> HostPatchStatus
"""

from __future__ import annotations

from ddtree_ops.patching.bundle import Bundle, FileOp, bundle_identity, load_bundle
from ddtree_ops.patching.executor import HostOutcome, RunOptions, deploy, rollback
from ddtree_ops.patching.overlay import Overlay, load_overlay
from ddtree_ops.patching.status import FileState, HostPatchStatus, host_status

__all__ = [
    "Bundle",
    "FileOp",
    "FileState",
    "HostOutcome",
    "HostPatchStatus",
    "Overlay",
    "RunOptions",
    "bundle_identity",
    "deploy",
    "host_status",
    "load_bundle",
    "load_overlay",
    "rollback",
]
