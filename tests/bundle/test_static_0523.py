"""Static checks of the ddtree_temperature bundle against the real SGLang 0.5.23 wheel.

The integration files cannot run here (they need CUDA, a model and all of SGLang's
dependencies), so these checks pin down everything that can be known without running
them: every ``from sglang... import name`` resolves to a definition in 0.5.23 or in the
bundle, every file byte-compiles, every ``replace`` base hash is the 0.5.23 file's hash,
the manifest ships every file under ``files/``, and the manifest's own ``verify``
commands pass on a package directory laid out the way a deploy leaves it.

The wheel is read in place (zipfile), never unpacked: only ``.py`` members are needed.
"""

from __future__ import annotations

import ast
import os
import py_compile
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddtree_ops.patching.bundle import Bundle, load_bundle

REPO = Path(__file__).resolve().parents[2]
BUNDLE_DIR = REPO / "patches" / "ddtree_temperature"
PACKAGE = "sglang"
NAMESPACE = ""  # module_file() of a namespace package: it exists but binds no names


def _wheel_path() -> Path | None:
    dirs = [Path(os.environ["DDTREE_OPS_WHEELS"])] if os.environ.get("DDTREE_OPS_WHEELS") else []
    dirs.append(REPO / ".cache" / "wheels")
    for d in dirs:
        found = sorted(d.glob("sglang-0.5.23-*.whl"))
        if found:
            return found[0]
    return None


@dataclass(frozen=True)
class SourceTree:
    """Python sources of the ``sglang`` package as a deploy would leave them:
    the wheel's files with the bundle's files laid over them."""

    files: dict[str, bytes]  # "srt/speculative/spec_info.py" -> bytes

    def module_file(self, dotted: str) -> str | None:
        """Package-relative file of ``sglang.a.b`` (module or package ``__init__``)."""
        parts = dotted.split(".")
        if parts[0] != PACKAGE:
            return None
        rel = "/".join(parts[1:])
        for cand in ((f"{rel}.py", f"{rel}/__init__.py") if rel else ("__init__.py",)):
            if cand in self.files:
                return cand
        if rel and any(f.startswith(rel + "/") for f in self.files):
            return NAMESPACE  # a directory without __init__.py (PEP 420 package)
        return None


@pytest.fixture(scope="session")
def wheel_sources() -> dict[str, bytes]:
    wheel = _wheel_path()
    if wheel is None:
        pytest.skip("SGLang 0.5.23 wheel not found (make venv downloads it to .cache/wheels)")
    out: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(f"{PACKAGE}/") and name.endswith(".py"):
                out[name[len(PACKAGE) + 1 :]] = zf.read(name)
    return out


@pytest.fixture(scope="session")
def bundle() -> Bundle:
    return load_bundle(BUNDLE_DIR)


@pytest.fixture(scope="session")
def deployed(wheel_sources: dict[str, bytes], bundle: Bundle) -> SourceTree:
    files = dict(wheel_sources)
    for f in bundle.files:
        files[f.path] = f.content
    return SourceTree(files)


# --------------------------------------------------------------------------- resolver


def _module_level_names(tree: ast.Module) -> tuple[set[str], list[str]]:
    """Names bound at module level (walking into if/try/with, not into defs), and the
    modules star-imported there."""
    names: set[str] = set()
    stars: list[str] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        if node.module and node.level == 0:
                            stars.append(node.module)
                    else:
                        names.add(alias.asname or alias.name)
            if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []) or [])
                for handler in getattr(node, "handlers", []) or []:
                    visit(handler.body)
            elif sys.version_info >= (3, 11) and isinstance(node, ast.TryStar):
                visit(node.body)

    visit(tree.body)
    return names, stars


def resolves(tree: SourceTree, module: str, name: str, _seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``from module import name`` finds something in ``tree``."""
    mfile = tree.module_file(module)
    if mfile is None:
        return False
    if tree.module_file(f"{module}.{name}") is not None:
        return True  # a submodule
    if mfile == NAMESPACE:
        return False
    names, stars = _module_level_names(ast.parse(tree.files[mfile]))
    if name in names:
        return True
    return any(resolves(tree, star, name, _seen | {module}) for star in stars if star not in _seen)


@dataclass(frozen=True)
class ImportRef:
    file: str
    line: int
    module: str
    name: str | None  # None for `import sglang.x.y`


def sglang_imports(source: bytes, file: str) -> Iterator[ImportRef]:
    """Every absolute import of ``sglang...`` anywhere in the file (module level,
    inside functions, under TYPE_CHECKING)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == PACKAGE or node.module.startswith(PACKAGE + "."):
                for alias in node.names:
                    yield ImportRef(file, node.lineno, node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    yield ImportRef(file, node.lineno, alias.name, None)


def unresolved_imports(tree: SourceTree, source: bytes, file: str) -> list[str]:
    bad: list[str] = []
    for ref in sglang_imports(source, file):
        if ref.name is None:
            ok = tree.module_file(ref.module) is not None
        elif ref.name == "*":
            ok = tree.module_file(ref.module) is not None
        else:
            ok = resolves(tree, ref.module, ref.name)
        if not ok:
            what = ref.module if ref.name is None else f"{ref.module}.{ref.name}"
            bad.append(f"{ref.file}:{ref.line}: {what}")
    return bad


# --------------------------------------------------------------------------- tests


def _bundle_python_files(bundle: Bundle) -> list[tuple[str, bytes]]:
    return [(f.path, f.content) for f in bundle.files if f.path.endswith(".py")]


def test_every_sglang_import_resolves_in_0523(deployed: SourceTree, bundle: Bundle) -> None:
    checked = 0
    bad: list[str] = []
    for path, content in _bundle_python_files(bundle):
        refs = list(sglang_imports(content, path))
        checked += len(refs)
        bad += unresolved_imports(deployed, content, path)
    assert not bad, "imports that do not resolve in SGLang 0.5.23 + bundle:\n" + "\n".join(bad)
    # The integration files import dozens of SGLang names; a checker that found none
    # would be checking nothing.
    assert checked >= 30


def test_resolver_rejects_names_that_do_not_exist(deployed: SourceTree) -> None:
    src = (
        b"from sglang.srt.speculative.spec_info import SpeculativeAlgorithm, NoSuchThing\n"
        b"from sglang.srt.no_such_module import x\n"
        b"import sglang.srt.speculative.no_such_file\n"
        b"def f():\n    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV3\n"
    )
    bad = unresolved_imports(deployed, src, "probe.py")
    assert bad == [
        "probe.py:1: sglang.srt.speculative.spec_info.NoSuchThing",
        "probe.py:2: sglang.srt.no_such_module.x",
        "probe.py:3: sglang.srt.speculative.no_such_file",
        "probe.py:5: sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV3",
    ]


def test_resolver_follows_reexports_submodules_and_conditionals(deployed: SourceTree) -> None:
    # verify_sampling binds the kernel inside try/except; server_args re-exports A;
    # ddtree_utils is a bundle-added submodule of sglang.srt.speculative.
    src = (
        b"from sglang.kernels.ops.speculative.verify_sampling import tree_speculative_sampling_target_only\n"
        b"from sglang.srt.server_args import A\n"
        b"from sglang.srt.speculative import ddtree_utils\n"
    )
    assert unresolved_imports(deployed, src, "probe.py") == []


def test_every_bundle_file_byte_compiles(bundle: Bundle, tmp_path: Path) -> None:
    for i, (path, content) in enumerate(_bundle_python_files(bundle)):
        src = tmp_path / f"{i}.py"
        src.write_bytes(content)
        py_compile.compile(str(src), cfile=str(tmp_path / f"{i}.pyc"), dfile=path, doraise=True)


def test_bundle_replaces_no_sglang_file(bundle: Bundle, wheel_sources: dict[str, bytes]) -> None:
    # The plugin install is additive: a pip reinstall or upgrade of SGLang never
    # meets a file of ours in its way, and ours never shadow one of its.
    assert {f.op for f in bundle.files} == {"add"}
    for f in bundle.files:
        assert f.path not in wheel_sources, f"{f.path} exists in 0.5.23"


def test_manifest_lists_every_shipped_file(bundle: Bundle) -> None:
    on_disk = {
        p.relative_to(BUNDLE_DIR / "files").as_posix()
        for p in (BUNDLE_DIR / "files").rglob("*")
        if p.is_file() and not any(part.startswith((".", "__pycache__")) for part in p.parts)
    } | {
        "../" + p.relative_to(BUNDLE_DIR / "site-packages").as_posix()
        for p in (BUNDLE_DIR / "site-packages").rglob("*")
        if p.is_file()
    }
    assert on_disk == {f.path for f in bundle.files}


def _module_ast(tree: SourceTree, dotted: str) -> ast.Module:
    rel = tree.module_file(dotted)
    assert rel, f"{dotted}: not a module of SGLang 0.5.23 + bundle"
    return ast.parse(tree.files[rel])


def _class_methods(module: ast.Module, name: str) -> set[str]:
    cls = next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    assert cls is not None, f"class {name} not found"
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_entry_point_loads_the_plugin(bundle: Bundle, deployed: SourceTree) -> None:
    entry = bundle.file("../sglang_ddtree-0.2.0.dist-info/entry_points.txt").content.decode()
    assert entry.split() == ["[sglang.srt.plugins]", "ddtree", "=", "sglang.srt.speculative.ddtree_plugin:load"]
    module = _module_ast(deployed, "sglang.srt.speculative.ddtree_plugin")
    assert any(isinstance(n, ast.FunctionDef) and n.name == "load" for n in module.body)
    # SGLang discovers plugins through this group name (srt/plugins/__init__.py).
    plugins = deployed.files["srt/plugins/__init__.py"].decode()
    assert '"sglang.srt.plugins"' in plugins


def test_every_hook_target_exists_in_0523(deployed: SourceTree) -> None:
    """HookRegistry resolves "module.Class.method" / "module.function" at apply time and
    only logs a failure; a target that drifted would silently drop the hook."""
    module = _module_ast(deployed, "sglang.srt.speculative.ddtree_plugin")
    hooks = next(
        n.value for n in module.body
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "HOOKS" for t in n.targets)
    )
    targets = [elt.elts[0].value for elt in hooks.elts]
    assert len(targets) >= 6
    for target in targets:
        parts = target.split(".")
        for split in range(len(parts) - 1, 0, -1):
            mod = ".".join(parts[:split])
            if deployed.module_file(mod):
                break
        else:
            raise AssertionError(f"{target}: no module of it exists in 0.5.23")
        rest = parts[split:]
        tree = _module_ast(deployed, mod)
        if len(rest) == 1:
            names, _ = _module_level_names(tree)
            assert rest[0] in names, target
        else:
            assert len(rest) == 2, target
            assert rest[1] in _class_methods(tree, rest[0]), target


def test_spec_class_answers_every_predicate_the_scheduler_calls(deployed: SourceTree) -> None:
    """SGLang checks at registration that a spec class has every is_*/supports_* of the
    enum; the scheduler also calls need_topk, carries_draft_hidden_states and
    create_future_map on any algorithm, which CustomSpecAlgo lacks in 0.5.23."""
    enum_methods = _class_methods(_module_ast(deployed, "sglang.srt.speculative.spec_info"), "SpeculativeAlgorithm")
    custom = _class_methods(_module_ast(deployed, "sglang.srt.speculative.spec_registry"), "CustomSpecAlgo")
    ours = _class_methods(_module_ast(deployed, "sglang.srt.speculative.ddtree_registration"), "DDTreeSpecAlgo")
    predicates = {m for m in enum_methods if m.startswith(("is_", "supports_"))}
    assert predicates <= custom | ours
    assert {"need_topk", "carries_draft_hidden_states", "create_future_map"} <= ours
    assert {"need_topk", "carries_draft_hidden_states", "create_future_map"} - custom, (
        "0.5.23's CustomSpecAlgo grew these; the overrides may be dropped"
    )
    # Its own identity: DFlash-family member, not DFLASH itself.
    assert {"is_ddtree", "is_dflash", "is_dflash_family"} <= ours


def test_shipped_files_name_no_deployment_tool(bundle: Bundle) -> None:
    for f in bundle.files:
        text = f.content.decode().lower()
        assert "ddtree-ops" not in text and "ddtree_ops" not in text, f.path


def test_manifest_verify_commands_pass_on_a_deployed_layout(
    bundle: Bundle, deployed: SourceTree, tmp_path: Path
) -> None:
    # Only the files the verify commands read are materialised; sglang itself is
    # located with find_spec and never imported, exactly as on a test host.
    pkg = tmp_path / "site" / PACKAGE
    for f in bundle.files:
        dest = pkg / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.content)
    (pkg / "__init__.py").write_bytes(deployed.files["__init__.py"])
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    assert bundle.verify, "the manifest should carry verify commands"
    for argv in bundle.verify:
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    # And they fail where the bundle is absent.
    for f in bundle.files:
        (pkg / f.path).unlink()
    failed = [
        subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120).returncode
        for argv in bundle.verify
    ]
    assert all(rc != 0 for rc in failed)
