"""ddtree-ops: deploy, restart, benchmark and report SGLang DDTree speculative decoding."""

from __future__ import annotations

__version__ = "0.1.0"
