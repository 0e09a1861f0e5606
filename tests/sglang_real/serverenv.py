"""The environment of every test server of the real SGLang on CPU (stdlib only).

Kept out of ``setup_env.py`` on purpose: that script's own hash decides when the venv is
rebuilt, and how a server is started has nothing to do with how the venv is built.
"""

from __future__ import annotations

import os

try:  # imported as tests/sglang_real/serverenv.py by the tests, or beside setup_env.py
    from .setup_env import STUB_DIR, VENV
except ImportError:
    from setup_env import STUB_DIR, VENV  # type: ignore[no-redef]


# What the real-server lane sets to measure the DDTree bundle's coverage
# (tests/sglang_real/bundle_coverage.py). Passed on only to the processes that run the
# bundle under test: the servers of a prefix and the one-interpreter checks. The servers
# the CLI launches (pipeline, selftest --e2e) run the same code unmeasured: tracing costs
# them ~40 % of their start-up.
COVERAGE_VARS = ("DDTREE_COVERAGE_RC", "DDTREE_COVERAGE_DIR", "DDTREE_BUNDLE_FILES")


def coverage_env(*, now: bool = False) -> dict[str, str]:
    """The lane's coverage variables (empty outside the lane). ``now``: measure from the
    interpreter's start (a one-interpreter check); a server measures its scheduler from
    the DDTREE worker on (standins/.../coverage_startup.py)."""
    env = {k: os.environ[k] for k in COVERAGE_VARS if os.environ.get(k)}
    if env and now:
        env["DDTREE_COVERAGE_NOW"] = "1"
    return env


# The model architectures the tests serve (srt/models/<module>.py): Qwen3 targets and
# DFlash drafts. SGLang's registry imports every other model module at start-up unless
# SGLANG_DISABLED_MODEL_ARCHS names it (srt/models/registry.py import_model_classes).
SERVED_MODEL_MODULES = ("qwen3", "dflash")


def _unserved_model_modules() -> str:
    found = sorted(VENV.glob("lib/python*/site-packages/sglang/srt/models"))
    if not found:
        return ""
    names = {p.stem for p in found[-1].glob("*.py")} - {"__init__", "registry", *SERVED_MODEL_MODULES}
    return ",".join(sorted(names))


def server_env() -> dict[str, str]:
    """The environment the CPU server needs (also used by tests/sglang_real/server.py)."""
    ld = os.environ.get("LD_LIBRARY_PATH", "")
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_NATIVE_MOVE_KV_CACHE": "1",
        "LD_LIBRARY_PATH": str(STUB_DIR) + (":" + ld if ld else ""),
    }
    unserved = _unserved_model_modules()
    if unserved:  # start-up time only: the registry then imports what the tests serve
        env["SGLANG_DISABLED_MODEL_ARCHS"] = unserved
    return env


