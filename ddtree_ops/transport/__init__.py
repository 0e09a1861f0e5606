"""Transports: how ddtree-ops reaches a host (SSH via paramiko, or local)."""

from __future__ import annotations

from ddtree_ops.transport.base import CommandResult, Script, Transport

__all__ = ["CommandResult", "Script", "Transport"]
