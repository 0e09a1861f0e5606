"""The bundled module stays deployable: torch + standard library at import time only,
and the loader hands out one cached module object."""

from __future__ import annotations

import ast
import subprocess
import sys
from types import ModuleType

from ddtree_ops.ddtree_core import DDTREE_UTILS_PATH, load_ddtree_utils


def test_top_level_imports_are_torch_and_stdlib_only() -> None:
    tree = ast.parse(DDTREE_UTILS_PATH.read_text())
    roots = set()
    for node in tree.body:  # module level only: lazy imports inside functions are allowed
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots, "the parser must have seen the imports"
    foreign = {r for r in roots if r != "torch" and r not in sys.stdlib_module_names}
    assert foreign == set()


def test_loads_in_a_fresh_interpreter_without_sglang_or_ddtree_ops() -> None:
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ddtree_utils', {str(DDTREE_UTILS_PATH)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['ddtree_utils'] = m\n"
        "spec.loader.exec_module(m)\n"
        "print(m.build_ddtree_tree_from_topk([[5, 6]], [[-0.1, -0.2]], 2).token_ids)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('sglang', 'ddtree_ops')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split("\n")[:2] == ["[-1, 5, 6]", "[]"]


def test_loader_is_cached(du: ModuleType) -> None:
    assert load_ddtree_utils() is du
    assert du.__file__ == str(DDTREE_UTILS_PATH)
