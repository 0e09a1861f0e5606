"""Files beside the package (``root: site-packages``): a bundle that is also a plugin distribution.

The ``plugin`` test bundle adds one module to the package and a ``.dist-info`` of its own
beside it, whose ``entry_points.txt`` registers the module in SGLang's plugin group. All
on real local prefixes: the host's own interpreter must list the entry point after a
deploy, and after a rollback nothing of the distribution may be left, not even its empty
directory (importlib.metadata would still list that). Cut connections and killed
processes are covered by test_executor's fault tests, which run this bundle too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ddtree_ops.errors import DriftError
from ddtree_ops.patching.bundle import Bundle, load_bundle
from ddtree_ops.patching.executor import RunOptions, deploy, rollback
from ddtree_ops.patching.remote import run_step
from ddtree_ops.patching.status import host_status
from ddtree_ops.transport.base import RoundTripCounter
from patching.conftest import BUNDLES, MiniHost, entry_points_on_host
from patching.test_executor import _assert_clean, _assert_converged, _t

DIST_INFO = "sglang_ddtree_mini-0.1.0.dist-info"
MODULE = "srt/speculative/ddtree_plugin_mini.py"


@pytest.fixture
def plugin() -> Bundle:
    return load_bundle(BUNDLES / "plugin")


def _site(mini: MiniHost) -> Path:
    return mini.pkg.parent


def test_deploy_registers_the_entry_point_and_rollback_removes_the_distribution(mini: MiniHost, plugin: Bundle) -> None:
    assert entry_points_on_host(mini.host.python, load=True) == {}
    c = RoundTripCounter()
    out = deploy(_t(mini, c), mini.host, plugin)
    assert out.outcome == "applied" and c.total == 3  # the bundle's verify command found the entry point too
    assert {a.path: a.kind for a in out.plan.actions} == {
        MODULE: "add", f"../{DIST_INFO}/METADATA": "add", f"../{DIST_INFO}/entry_points.txt": "add"}
    assert _assert_converged(mini, plugin) == "patched"
    # What SGLang's plugin loader does with the host's interpreter: find it, import it, call it.
    assert entry_points_on_host(mini.host.python, load=True) == {
        "ddtree_mini": ["sglang.srt.speculative.ddtree_plugin_mini:register", "ddtree_mini registered"]}
    assert (_site(mini) / DIST_INFO / "METADATA").read_bytes() == plugin.file(f"../{DIST_INFO}/METADATA").content
    state = json.loads((mini.state_dir / "state.json").read_text())
    assert sorted(state["files"]) == sorted(f.path for f in plugin.files)
    assert state["created_dirs"] == [f"../{DIST_INFO}"]  # so that a later rollback removes it again
    assert deploy(_t(mini), mini.host, plugin).outcome == "noop"

    out = rollback(_t(mini), mini.host)
    assert out.outcome == "rolled-back" and out.plan.summary() == "3 delete"
    assert _assert_converged(mini, plugin) == "original"
    assert not (mini.state_dir / "state.json").exists()
    assert not list(mini.state_dir.rglob("backups/*"))
    assert rollback(_t(mini), mini.host).outcome == "noop"


def test_next_version_moves_the_dist_info_and_removes_the_old_one(
    mini: MiniHost, plugin: Bundle, tmp_path: Path
) -> None:
    """The distribution's version is in its directory name: v2 deletes v1's files and its emptied directory."""
    deploy(_t(mini), mini.host, plugin)
    d = tmp_path / "v2"
    shutil.copytree(BUNDLES / "plugin", d)
    new_dir = "sglang_ddtree_mini-0.2.0.dist-info"
    (d / "site-packages" / DIST_INFO).rename(d / "site-packages" / new_dir)
    meta = d / "site-packages" / new_dir / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.1.0", "Version: 0.2.0"))
    (d / "patch.yaml").write_text((d / "patch.yaml").read_text().replace(DIST_INFO, new_dir).replace('"1.0"', '"2.0"'))
    v2 = load_bundle(d)
    out = deploy(_t(mini), mini.host, v2)
    assert {a.path: a.kind for a in out.plan.changes} == {
        f"../{DIST_INFO}/METADATA": "delete", f"../{DIST_INFO}/entry_points.txt": "delete",
        f"../{new_dir}/METADATA": "add", f"../{new_dir}/entry_points.txt": "add"}
    assert not (_site(mini) / DIST_INFO).exists()
    assert json.loads((mini.state_dir / "state.json").read_text())["created_dirs"] == [f"../{new_dir}"]
    assert list(entry_points_on_host(mini.host.python, load=True)) == ["ddtree_mini"]
    rollback(_t(mini), mini.host)
    assert not (_site(mini) / new_dir).exists() and entry_points_on_host(mini.host.python, load=True) == {}


def test_new_package_directories_are_removed_on_rollback_too(mini: MiniHost, tmp_path: Path) -> None:
    """A module in a new subpackage: its directory (and the __pycache__ the byte-compile made) goes with it."""
    d = tmp_path / "b"
    (d / "files/srt/speculative/ddtree_sub").mkdir(parents=True)
    (d / "files/srt/speculative/ddtree_sub/__init__.py").write_text("X = 1\n")
    (d / "patch.yaml").write_text('name: sub\nversion: "1"\ntarget: {package: sglang, versions: ["0.5.23"]}\n'
                                  "files:\n  - {op: add, path: srt/speculative/ddtree_sub/__init__.py}\n")
    deploy(_t(mini), mini.host, load_bundle(d))
    assert (mini.pkg / "srt/speculative/ddtree_sub/__pycache__").is_dir()
    rollback(_t(mini), mini.host)
    assert not (mini.pkg / "srt/speculative/ddtree_sub").exists()
    assert (mini.pkg / "srt/speculative").is_dir()  # only what ddtree-ops created


def _deploy_with_old_format_record(mini: MiniHost) -> Bundle:
    """``basic`` applied, its state record as the code before site-packages files wrote it:
    package keys only, no ``created_dirs``."""
    basic = load_bundle(BUNDLES / "basic")
    deploy(_t(mini), mini.host, basic)
    spath = mini.state_dir / "state.json"
    state = json.loads(spath.read_text())
    assert state.pop("created_dirs") == []
    spath.write_text(json.dumps(state))
    return basic


def test_old_format_record_rolls_back(mini: MiniHost) -> None:
    basic = _deploy_with_old_format_record(mini)
    assert deploy(_t(mini), mini.host, basic).outcome == "noop"
    assert rollback(_t(mini), mini.host).outcome == "rolled-back"
    assert _assert_converged(mini, basic) == "original"


def test_old_format_record_then_plugin_bundle(mini: MiniHost, plugin: Bundle) -> None:
    """The next bundle is the plugin (--replace): basic's files go back, the plugin's come in, in one transaction."""
    upstream = {
        rel: mini.file(rel).read_bytes()
        for rel in ("srt/speculative/dflash_info.py", "srt/speculative/dflash_worker_v2.py")
    }
    basic = _deploy_with_old_format_record(mini)
    out = deploy(_t(mini), mini.host, plugin, RunOptions(replace=True))
    assert {a.path: a.kind for a in out.plan.changes} == {
        **{f.path: ("restore" if f.op == "replace" else "delete") for f in basic.files},
        **{f.path: "add" for f in plugin.files}}
    assert {rel: mini.file(rel).read_bytes() for rel in upstream} == upstream
    assert _assert_converged(mini, plugin) == "patched"
    rollback(_t(mini), mini.host)
    assert _assert_converged(mini, plugin) == "original"


# --- what the host refuses -----------------------------------------------------------------


def _no_dist_info_written(where: Path) -> None:
    assert not list(where.glob("*ddtree_mini*"))


def test_package_outside_site_packages_is_refused(mini: MiniHost, plugin: Bundle, tmp_path: Path) -> None:
    """A legacy editable install: the package lives in a source tree a .pth puts on sys.path."""
    src = tmp_path / "checkout"
    src.mkdir()
    shutil.move(str(mini.pkg), str(src / "sglang"))
    (_site(mini) / "sglang-src.pth").write_text(f"{src}\n")
    with pytest.raises(
        DriftError, match=r"not a site-packages or dist-packages directory.*refusing to write beside it"
    ):
        deploy(_t(mini), mini.host, plugin, RunOptions(force=True))
    _no_dist_info_written(src)
    _no_dist_info_written(_site(mini))
    assert not (src / "sglang" / MODULE).exists()  # the whole host was refused, package file included
    # A bundle without site-packages files still deploys there, as before.
    assert deploy(_t(mini), mini.host, load_bundle(BUNDLES / "basic")).outcome == "applied"


def test_symlinked_package_is_refused(mini: MiniHost, plugin: Bundle, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "site-packages"
    elsewhere.mkdir(parents=True)
    shutil.move(str(mini.pkg), str(elsewhere / "sglang"))
    os.symlink(elsewhere / "sglang", mini.pkg)
    with pytest.raises(DriftError, match="not a plain directory in its site-packages"):
        deploy(_t(mini), mini.host, plugin)
    _no_dist_info_written(elsewhere)
    _no_dist_info_written(_site(mini))


def test_symlinked_dist_info_leading_out_is_refused(mini: MiniHost, plugin: Bundle, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, _site(mini) / DIST_INFO)
    with pytest.raises(DriftError, match="resolves outside its dist-info directory"):
        deploy(_t(mini), mini.host, plugin, RunOptions(force=True))
    assert list(outside.iterdir()) == []


def test_another_installations_file_is_never_overwritten_even_forced(mini: MiniHost, plugin: Bundle) -> None:
    """The same distribution really pip-installed: its files are not ours to replace."""
    pip_dir = _site(mini) / DIST_INFO
    pip_dir.mkdir()
    (pip_dir / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-ddtree-mini\nVersion: 0.1.0\n")
    for force in (False, True):
        with pytest.raises(DriftError, match="was not put there by ddtree-ops; it belongs to another installation"):
            deploy(_t(mini), mini.host, plugin, RunOptions(force=force))
    assert sorted(p.name for p in pip_dir.iterdir()) == ["METADATA"]
    assert not mini.file(MODULE).exists()


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        ("../sglang-0.5.23.dist-info/METADATA", "own metadata directory"),
        ("../SGLang-0.5.23.dist-info/RECORD", "own metadata directory"),
        ("../../evil-1.0.dist-info/METADATA", "not inside a <name>-<version>.dist-info directory"),
        ("../evil-1.0.dist-info/../../x.py", "not inside a <name>-<version>.dist-info directory"),
        ("../evil.py", "not inside a <name>-<version>.dist-info directory"),
        ("srt/../../evil-1.0.dist-info/METADATA", "not a plain path inside the package directory"),
    ],
)
def test_agent_refuses_bad_keys_itself(mini: MiniHost, key: str, needle: str) -> None:
    """Defence in depth: a payload the controller would never send is refused on the host too."""
    from ddtree_ops.patching.executor import controller_identity

    with pytest.raises(DriftError, match=needle):
        run_step(_t(mini), mini.host.python, "prepare", {
            "package": "sglang", "txn": "t1", "holder": {"txn": "t1", **controller_identity()},
            "files": [{"path": key, "expect_sha": None, "new_sha": "1" * 64, "content_b64": ""}],
            "new_state": None,
        })
    _assert_clean(mini)
    assert sorted(p.name for p in _site(mini).iterdir() if p.name.endswith(".dist-info")) == ["sglang-0.5.23.dist-info"]


def test_status_classifies_files_beside_the_package(mini: MiniHost, plugin: Bundle) -> None:
    st = host_status(_t(mini), mini.host, bundle=plugin)
    assert {f.path: f.state for f in st.files} == {f.path: "original" for f in plugin.files}
    deploy(_t(mini), mini.host, plugin)
    (_site(mini) / DIST_INFO / "entry_points.txt").write_text("[sglang.srt.plugins]\n")  # hand-edited
    st = host_status(_t(mini), mini.host, bundle=plugin)
    assert st.outside_change is not None and st.outside_change.drifted == (f"../{DIST_INFO}/entry_points.txt",)
    # Ours (recorded), so --force may re-apply over it; its original is still "absent".
    assert deploy(_t(mini), mini.host, plugin, RunOptions(force=True)).outcome == "applied"
    assert _assert_converged(mini, plugin) == "patched"
    rollback(_t(mini), mini.host)
    assert _assert_converged(mini, plugin) == "original"
    assert not list(mini.state_dir.rglob("backups/*"))


def test_forced_rollback_over_an_edit_keeps_the_edited_copy(mini: MiniHost, plugin: Bundle) -> None:
    """The drifted copy is kept under the reserved backup name (controller and host agree on it)."""
    deploy(_t(mini), mini.host, plugin)
    edited = "[sglang.srt.plugins]\nsomething = else:here\n"
    (_site(mini) / DIST_INFO / "entry_points.txt").write_text(edited)
    with pytest.raises(DriftError, match="entry_points.txt: drifted.*--force"):
        rollback(_t(mini), mini.host)
    out = rollback(_t(mini), mini.host, RunOptions(force=True))
    assert out.outcome == "rolled-back"
    kept = list(mini.state_dir.glob(f"backups/*/.ddtree-site-packages/{DIST_INFO}/entry_points.txt"))
    assert [p.read_text() for p in kept] == [edited]
    assert _assert_converged(mini, plugin) == "original"


def _metadata_version_on_host(python: str) -> str | None:
    got = subprocess.run([python, "-c", "import importlib.metadata as m\ntry: print(m.version('sglang'))\n"
                          "except m.PackageNotFoundError: print('')"], capture_output=True, text=True, check=True)
    return got.stdout.strip() or None


@pytest.mark.parametrize("layout", ["plain", "header-differs", "two-dist-infos", "egg-info", "other-name", "none"])
def test_the_gathered_version_is_the_one_importlib_metadata_gives_on_the_host(mini: MiniHost, layout: str) -> None:
    """The gather reads ``Version:`` from the one plain dist-info beside the package (not
    importing importlib.metadata: 30 ms of every gather's CPU) and asks importlib.metadata
    in any other layout; either way the answer is the host interpreter's own."""
    site = _site(mini)
    own = site / "sglang-0.5.23.dist-info"
    if layout == "header-differs":  # the folder's name is not what counts, the METADATA is
        own.rename(site / "sglang-0.5.22.dist-info")
    elif layout == "two-dist-infos":  # a stale one left beside: importlib.metadata decides
        shutil.copytree(own, site / "SGLang-0.5.20.dist-info")
        meta = site / "SGLang-0.5.20.dist-info" / "METADATA"
        meta.write_text(meta.read_text().replace("Version: 0.5.23", "Version: 0.5.20", 1))
    elif layout == "egg-info":
        egg = site / "sglang-0.5.21-py3.11.egg-info"
        shutil.rmtree(own)
        egg.mkdir()
        (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.21\n")
    elif layout == "other-name":  # a folder named sglang-* whose METADATA names another project
        meta = own / "METADATA"
        meta.write_text(meta.read_text().replace("Name: sglang", "Name: sglang-fork", 1))
    elif layout == "none":
        shutil.rmtree(own)
    got = run_step(_t(mini), mini.host.python, "gather", {"package": "sglang", "paths": []})["version"]
    assert got == _metadata_version_on_host(mini.host.python)
    assert got == {"plain": "0.5.23", "header-differs": "0.5.23", "egg-info": "0.5.21", "none": None}.get(layout, got)
