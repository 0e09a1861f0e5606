"""The bundled modules stay deployable and say what the server uses: torch + standard
library at import time only, each loads on its own, the loader hands out one cached
module object, and ``ddtree_utils.__all__`` is exactly what the worker calls there."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ddtree_ops.ddtree_core import (
    BUNDLE_SPECULATIVE_DIR,
    DDTREE_REFERENCE_PATH,
    DDTREE_UTILS_PATH,
    load_ddtree_reference,
    load_ddtree_utils,
)

WORKER = BUNDLE_SPECULATIVE_DIR / "ddtree_worker_v2.py"
MODULES = pytest.mark.parametrize("path", [DDTREE_REFERENCE_PATH, DDTREE_UTILS_PATH], ids=lambda p: p.stem)


@MODULES
def test_top_level_imports_are_torch_and_stdlib_only(path: Path) -> None:
    tree = ast.parse(path.read_text())
    roots = set()
    for node in tree.body:  # module level only: lazy imports inside functions are allowed
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots, "the parser must have seen the imports"
    foreign = {r for r in roots if r != "torch" and r not in sys.stdlib_module_names}
    assert foreign == set()


@pytest.mark.parametrize(
    ("path", "probe"),
    [
        (DDTREE_REFERENCE_PATH, "m.build_ddtree_tree_from_topk([[5, 6]], [[-0.1, -0.2]], 2).token_ids"),
        (
            DDTREE_UTILS_PATH,
            "m.build_tree_batch(torch.tensor([[[5, 6]]]), torch.tensor([[[-0.1, -0.2]]]), 2,"
            " torch.tensor([0])).tokens[0].tolist()",
        ),
    ],
    ids=["ddtree_reference", "ddtree_utils"],
)
def test_loads_alone_in_a_fresh_interpreter_without_sglang_or_ddtree_ops(path: Path, probe: str) -> None:
    code = (
        "import importlib.util, sys, torch\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['m'] = m\n"
        "spec.loader.exec_module(m)\n"
        f"print({probe})\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('sglang', 'ddtree_ops')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split("\n")[1] == "[]"
    assert out.stdout.split("\n")[0] in ("[-1, 5, 6]", "[0, 5, 6]")


def _worker_uses(module: str) -> set[str]:
    """Every ``<module>.<name>`` the worker reads (attribute access on the imported module)."""
    tree = ast.parse(WORKER.read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == module
    }


def test_the_device_modules_all_is_exactly_what_the_worker_calls(du: ModuleType) -> None:
    used = _worker_uses("ddtree_utils")
    assert used, "the parser must have seen the worker's calls"
    assert sorted(du.__all__) == sorted(used)
    assert all(hasattr(du, name) for name in du.__all__)


def test_what_the_worker_takes_from_the_reference_is_public_there(ref: ModuleType) -> None:
    used = _worker_uses("ddtree_reference")
    # the per-request builder: the trace's union tree (trace mode only, ddtree_trace)
    assert used == {"target_probs_from_logits", "min_p_renorm_probs", "reference_tree_speculative_sampling",
                    "build_ddtree_tree_from_topk"}
    assert used <= set(ref.__all__)
    assert all(hasattr(ref, name) for name in ref.__all__)


def test_loaders_are_cached(ref: ModuleType, du: ModuleType) -> None:
    assert load_ddtree_reference() is ref and load_ddtree_utils() is du
    assert ref.__file__ == str(DDTREE_REFERENCE_PATH)
    assert du.__file__ == str(DDTREE_UTILS_PATH)
