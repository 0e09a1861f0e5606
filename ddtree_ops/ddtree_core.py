"""Access to the ONE copy of the DDTree algorithm, the files shipped in the patch bundle.

``patches/ddtree_temperature/files/srt/speculative/`` holds the reference
(``ddtree_reference.py``: per-request trees, encodings, verification, the target
distribution and the pure-torch sampler) and the device-resident round the server
runs (``ddtree_utils.py``). They are deployed into SGLang's site-packages, so they
cannot live inside this package as well: a second copy would drift. Each is loaded
here by file path (both depend on torch alone), so the tests and the simulated server
run the exact bytes that get deployed.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ddtree_ops.errors import BundleError
from ddtree_ops.shipped import DEFAULT_BUNDLE

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLE_SPECULATIVE_DIR = DEFAULT_BUNDLE / "files" / "srt" / "speculative"
DDTREE_REFERENCE_PATH = BUNDLE_SPECULATIVE_DIR / "ddtree_reference.py"
DDTREE_UTILS_PATH = BUNDLE_SPECULATIVE_DIR / "ddtree_utils.py"
DDTREE_RUNTIME_PATH = BUNDLE_SPECULATIVE_DIR / "ddtree_runtime.py"
DDTREE_TRACE_PATH = BUNDLE_SPECULATIVE_DIR / "ddtree_trace.py"


def load_module_file(path: Path, *, prefix: str = "bundled") -> ModuleType:
    """The Python file ``path`` as a fresh module (``prefix``: whose copy it is, in its name)."""
    # A private name: it must never shadow SGLang's own module if both end up in one process.
    name = f"ddtree_ops._{prefix}_{path.stem}"
    if not path.is_file():
        raise BundleError(f"{path}: DDTree core module not found (is this a source checkout?)")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BundleError(f"{path}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve their module through sys.modules while the class is created.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@functools.cache
def load_ddtree_reference() -> ModuleType:
    """The bundled ``ddtree_reference.py`` (once per process): the per-request reference."""
    return load_module_file(DDTREE_REFERENCE_PATH)


@functools.cache
def load_ddtree_utils() -> ModuleType:
    """The bundled ``ddtree_utils.py`` (once per process): the device-resident round."""
    return load_module_file(DDTREE_UTILS_PATH)


@functools.cache
def load_ddtree_runtime() -> ModuleType:
    """The bundled ``ddtree_runtime.py`` (once per process): the runtime tree states'
    config, policy routing and switch validation, pure Python."""
    return load_module_file(DDTREE_RUNTIME_PATH)


@functools.cache
def load_ddtree_trace() -> ModuleType:
    """The bundled ``ddtree_trace.py`` (once per process): the tree trace's union tree,
    trace switch validation and round records (torch only)."""
    return load_module_file(DDTREE_TRACE_PATH)
