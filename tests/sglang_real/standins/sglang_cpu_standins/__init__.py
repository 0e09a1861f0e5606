"""TEST-ONLY SGLang 0.5.23 plugin: stand-ins that let the real server serve DFLASH on CPU.

SGLang loads this in every process (entry point group ``sglang.srt.plugins``,
``srt/plugins/__init__.py`` ``load_plugins``) and applies the hooks registered here through
``HookRegistry`` before any model code runs. Nothing here changes what a model computes: each
stand-in only removes a GPU-only assumption (a device check, a CUDA stream API, a Triton-only
kernel) or supplies the plain-PyTorch path the CPU attention backend lacks. It is installed
only into the test venv that ``tests/sglang_real/setup_env.py`` builds; never deploy it.

See :mod:`sglang_cpu_standins.hooks` for each stand-in and the SGLang code it works around.
"""

from __future__ import annotations


def register() -> None:
    """Entry point: register every stand-in (idempotent per process)."""
    from . import hooks

    hooks.register_all()
