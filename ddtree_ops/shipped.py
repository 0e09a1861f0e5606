"""Where the files ddtree-ops ships beside its code are: the patch bundle (``patches/``)
and the sweeps and prompt sets (``bench_configs/``).

In a checkout (and an editable install) they are the checkout's own directories, which the
Makefile, the tests and the docs use. A wheel carries them inside the package, as
``ddtree_ops._shipped.patches`` and ``ddtree_ops._shipped.bench_configs``
(``pyproject.toml``), so that an installed ``ddtree-ops deploy HOST`` finds its bundle
whatever the working directory. Nothing here depends on the working directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def shipped_dir(name: str) -> Path:
    """``patches`` or ``bench_configs``: the installed copy when the package carries one,
    else the checkout's directory."""
    try:
        spec = importlib.util.find_spec(f"ddtree_ops._shipped.{name}")
    except ModuleNotFoundError:  # a checkout or an editable install: no _shipped package
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return REPO_ROOT / name


#: The DDTree temperature bundle ``deploy``, ``status`` and ``selftest`` use by default.
DEFAULT_BUNDLE = shipped_dir("patches") / "ddtree_temperature"
#: The project's prompt sets (``prompt_set: mixed`` and the named ones).
PROJECT_PROMPTS = shipped_dir("bench_configs") / "prompts"
