"""The import graph of ``ddtree_ops`` has no circles, and what is sent sits below how it is sent.

Layers import one way (design.md §3): a circle between modules means neither can be read,
tested or moved without the other, and it is usually hidden behind an import inside a
function. So every import statement counts here, at module level or inside a function,
``TYPE_CHECKING`` blocks too, and so does ``importlib.import_module("ddtree_ops....")`` with a
literal name. What a module names by a computed string (``cli.main._register`` imports
the command modules by ``f"ddtree_ops.cli.{name}"``) is not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Circles that existed when this test was written, each as its sorted module names: the
# test allows exactly these, so that none can grow and no new one can come. None today.
KNOWN_CIRCLES: frozenset[tuple[str, ...]] = frozenset()

# What is sent (prompts, data sets, the workload drawn from them) must not know how a sweep
# runs, renders or reports: these are the layers above it and beside it.
WORKLOAD_MUST_NOT_IMPORT = ("cli", "bench", "report", "rollout", "service", "patching", "transport", "inventory",
                            "sim", "selftest", "tuning")


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package folder ``root``."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, node: ast.AST, known: Mapping[str, Path]) -> Iterator[str]:
    """The package's own modules one import node names (a ``from`` import of a submodule
    names the submodule; of any other name, the module that holds it)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in known:  # ``import a.b.c`` of a non-module tail
                name = name.rpartition(".")[0]
            if name:
                yield name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                yield f"{base}.{alias.name}"
            elif base in known:
                yield base
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value in known
    ):
        yield str(node.args[0].value)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body."""
    known = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = {dep for node in ast.walk(tree) for dep in _imported(module, path, node, known)} - {module}
    return graph


def circles(graph: Mapping[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(tuple(sorted(component)))
    return found


def test_no_import_circle_among_the_packages_modules() -> None:
    found = circles(import_graph(REPO / "ddtree_ops"))
    assert found <= KNOWN_CIRCLES, f"new import circles: {sorted(found - KNOWN_CIRCLES)}"
    # A circle broken since: drop it from the list, so that it cannot come back unseen.
    assert found == KNOWN_CIRCLES, f"gone, remove from KNOWN_CIRCLES: {sorted(KNOWN_CIRCLES - found)}"


def test_the_workload_package_imports_nothing_above_it() -> None:
    graph = import_graph(REPO / "ddtree_ops")
    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(f"{package}.")

    workload = {m: deps for m, deps in graph.items() if within(m, "ddtree_ops.workload")}
    assert workload, "ddtree_ops.workload not found"
    above = [f"ddtree_ops.{name}" for name in WORKLOAD_MUST_NOT_IMPORT]
    wrong = {m: sorted(d for d in deps if any(within(d, a) for a in above)) for m, deps in workload.items()}
    assert not any(wrong.values()), {m: d for m, d in wrong.items() if d}


def test_the_walker_sees_a_circle_hidden_in_a_function_and_a_relative_import(tmp_path: Path) -> None:
    """The check above is only as good as its walker: a circle closed by an import inside a
    function, through a relative import, or by ``import_module``, is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import thing\n    return thing\n")
    (pkg / "c.py").write_text("import importlib\nthing = 1\ndef g():\n    importlib.import_module('pkg.a')\n")
    (pkg / "d.py").write_text("import pkg.c\n")  # into the circle, not part of it
    assert circles(import_graph(pkg)) == {("pkg.a", "pkg.c", "pkg.sub.b")}
    (pkg / "c.py").write_text("thing = 1\n")
    assert circles(import_graph(pkg)) == set()
