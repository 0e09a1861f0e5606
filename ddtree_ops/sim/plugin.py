"""Where a simulated server finds DDTREE: the DDTree plugin deployed into its host's SGLang.

Real SGLang 0.5.23 knows DDTREE only through the plugin's entry point: group
``sglang.srt.plugins``, filtered by the ``SGLANG_PLUGINS`` whitelist
(``srt/plugins/__init__.py``, ``load_plugins_by_group``). Without it
``SpeculativeAlgorithm.from_string`` raises ``ValueError: Unknown speculative algorithm
name: DDTREE`` (``srt/speculative/spec_info.py``) while the server arguments are resolved
(``srt/arg_groups/speculative_hook.py``, ``handle_speculative_decoding``), before any port
opens. The simulator does the same, and runs the tree code of the files deployed there,
never the toolkit's own copy: a host that was never deployed to, or was rolled back,
cannot serve DDTREE, here as on a GPU host.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ddtree_ops.ddtree_core import load_module_file

PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "ddtree"


class PluginMissing(Exception):
    """DDTREE is not registered in this interpreter's SGLang (the reason, one sentence)."""


@dataclass(frozen=True)
class DeployedPlugin:
    """The DDTree plugin as deployed: its ``srt/speculative`` folder in site-packages."""

    speculative_dir: Path

    def reference(self) -> ModuleType:
        """The deployed per-request reference (trees, verification, sampler)."""
        return load_module_file(self.speculative_dir / "ddtree_reference.py", prefix="deployed")

    def trace(self) -> ModuleType | None:
        """The deployed tree trace (``ddtree_trace.py``); None where the deployed bundle
        predates it (a trace switch is then refused, as that plugin refuses the key)."""
        path = self.speculative_dir / "ddtree_trace.py"
        return load_module_file(path, prefix="deployed") if path.is_file() else None


def find_ddtree_plugin(environ: Mapping[str, str]) -> DeployedPlugin:
    """The plugin SGLang would load in this interpreter with ``environ``, or PluginMissing.

    Found as SGLang finds it (the entry point, then the whitelist), and located without
    importing ``sglang`` (its ``__init__`` pulls in half the package): the entry point's
    module path under the ``sglang`` package's folder.
    """
    allowed = {name.strip() for name in environ.get("SGLANG_PLUGINS", "").split(",") if name.strip()}
    points = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not points:
        raise PluginMissing(f"no {PLUGIN_NAME!r} entry point in {PLUGIN_GROUP} (the DDTree bundle is not deployed)")
    if allowed and PLUGIN_NAME not in allowed:
        raise PluginMissing(f"SGLANG_PLUGINS={','.join(sorted(allowed))} leaves out the {PLUGIN_NAME!r} plugin")
    module = points[0].module.split(".")
    spec = importlib.util.find_spec(module[0])
    if spec is None or not spec.submodule_search_locations:
        raise PluginMissing(f"the {PLUGIN_NAME!r} plugin's package {module[0]!r} is not installed")
    path = Path(next(iter(spec.submodule_search_locations)), *module[1:]).with_suffix(".py")
    if not path.is_file():
        raise PluginMissing(f"the {PLUGIN_NAME!r} plugin's module {path} is missing")
    return DeployedPlugin(path.parent)
