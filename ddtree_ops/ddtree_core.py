"""Access to the ONE copy of the DDTree algorithm, the file shipped in the patch bundle.

``patches/ddtree_temperature/files/srt/speculative/ddtree_utils.py`` is deployed into
SGLang's site-packages, so it cannot live inside this package as well: a second copy
would drift. It is loaded here by file path, so the tests and the simulated server run
the exact bytes that get deployed.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ddtree_ops.errors import BundleError

REPO_ROOT = Path(__file__).resolve().parent.parent
DDTREE_UTILS_PATH = (
    REPO_ROOT / "patches" / "ddtree_temperature" / "files" / "srt" / "speculative" / "ddtree_utils.py"
)
# A private name: it must never shadow SGLang's own module if both end up in one process.
MODULE_NAME = "ddtree_ops._bundled_ddtree_utils"


@functools.cache
def load_ddtree_utils() -> ModuleType:
    """Import the bundled ``ddtree_utils.py`` by path (once per process) and return it."""
    if not DDTREE_UTILS_PATH.is_file():
        raise BundleError(f"{DDTREE_UTILS_PATH}: DDTree core module not found (is this a source checkout?)")
    spec = importlib.util.spec_from_file_location(MODULE_NAME, DDTREE_UTILS_PATH)
    if spec is None or spec.loader is None:
        raise BundleError(f"{DDTREE_UTILS_PATH}: cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve their module through sys.modules while the class is created.
    sys.modules[MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(MODULE_NAME, None)
        raise
    return module
