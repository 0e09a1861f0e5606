"""Bundle manifests: everything invalid is refused at load time with file and key named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddtree_ops.errors import BundleError
from ddtree_ops.patching.bundle import load_bundle
from patching.conftest import BUNDLES

BASE = "87a7f5808ea12bec0fb4abb8ffc0d2082963a79b5de9ab435063e0dfa8ce8431"


def _bundle(tmp_path: Path, files_yaml: str, extra: str = "", sources: dict[str, str] | None = None) -> Path:
    d = tmp_path / "b"
    d.mkdir(exist_ok=True)
    for rel, text in ({"files/srt/x.py": "X = 1\n"} if sources is None else sources).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    (d / "patch.yaml").write_text(
        f'name: t\nversion: "1"\ntarget: {{package: sglang, versions: ["0.5.23"]}}\n{extra}files:\n{files_yaml}'
    )
    return d


def test_basic_bundle_loads_with_stable_identity() -> None:
    a = load_bundle(BUNDLES / "basic")
    b = load_bundle(BUNDLES / "basic" / "patch.yaml")
    assert a.identity == b.identity and len(a.identity) == 64
    assert [f.op for f in a.files] == ["add", "replace", "replace"]
    assert a.verify and a.versions == ("0.5.23",)


def test_identity_changes_with_content_path_and_manifest(tmp_path: Path) -> None:
    d = _bundle(tmp_path, "  - {op: add, path: srt/x.py}\n")
    first = load_bundle(d).identity
    (d / "files/srt/x.py").write_text("X = 2\n")
    second = load_bundle(d).identity
    (d / "patch.yaml").write_text((d / "patch.yaml").read_text().replace('version: "1"', 'version: "2"'))
    third = load_bundle(d).identity
    assert len({first, second, third}) == 3


@pytest.mark.parametrize(
    ("files_yaml", "needle"),
    [
        ("  - {op: add, path: ../x.py, source: files/srt/x.py}\n", "escapes the package directory"),
        ("  - {op: add, path: srt/../../x.py, source: files/srt/x.py}\n", "escapes the package directory"),
        ("  - {op: add, path: /etc/x.py, source: files/srt/x.py}\n", "is absolute"),
        ("  - {op: add, path: srt/x.py}\n  - {op: add, path: srt//x.py}\n", "duplicate path"),
        ("  - {op: add, path: srt/y.py}\n", "not found"),
        ("  - {op: add, path: srt/x.py, sha: abc}\n", "unknown key(s) 'sha'"),
        ("  - {op: replace, path: srt/x.py}\n", "base_sha256"),
        ("  - {op: replace, path: srt/x.py, base_sha256: ABC}\n", "base_sha256"),
        ("  - {op: add, path: srt/x.py, base_sha256: " + BASE + "}\n", "only meaningful"),
        ("  - {op: patch, path: srt/x.py}\n", "op must be"),
        ("  - {op: add, path: srt/x.py, source: /etc/passwd}\n", "relative to the bundle"),
        ("  - {op: add, path: srt/x.py, source: ../outside.py}\n", "outside the bundle directory"),
    ],
)
def test_bad_file_entries_are_refused(tmp_path: Path, files_yaml: str, needle: str) -> None:
    (tmp_path / "outside.py").write_text("Y = 1\n")
    d = _bundle(tmp_path, files_yaml)
    with pytest.raises(BundleError) as exc:
        load_bundle(d)
    assert needle in str(exc.value)
    assert "patch.yaml" in str(exc.value)


SITE = "site-packages/sglang_x-1.0.dist-info/METADATA"


@pytest.mark.parametrize(
    ("files_yaml", "needle"),
    [
        ("  - {op: add, root: site-packages, path: METADATA, source: files/srt/x.py}\n",
         "must be a file inside a '<name>-<version>.dist-info/' directory"),
        ("  - {op: add, root: site-packages, path: sglang_x/x.py, source: files/srt/x.py}\n",
         "must be a file inside a '<name>-<version>.dist-info/' directory"),
        ("  - {op: add, root: site-packages, path: sglang_x-1.0.dist-info, source: files/srt/x.py}\n",
         "must be a file inside a '<name>-<version>.dist-info/' directory"),
        ("  - {op: add, root: site-packages, path: sglang-0.5.23.dist-info/entry_points.txt,"
         " source: files/srt/x.py}\n",
         "inside sglang's own metadata directory"),
        ("  - {op: add, root: site-packages, path: SGLang-0.5.23.dist-info/RECORD, source: files/srt/x.py}\n",
         "inside sglang's own metadata directory"),
        ("  - {op: add, root: site-packages, path: sglang_x-1.0.dist-info/../../evil.py, source: files/srt/x.py}\n",
         "escapes the site-packages directory ('..')"),
        ("  - {op: add, root: site-packages, path: ../sglang_x-1.0.dist-info/METADATA, source: files/srt/x.py}\n",
         "escapes the site-packages directory ('..')"),
        ("  - {op: add, root: site-packages, path: /usr/lib/sglang_x-1.0.dist-info/METADATA,"
         " source: files/srt/x.py}\n",
         "is absolute; paths are relative to the site-packages directory"),
        ("  - {op: add, root: site-packages, path: 'sglang_x-1.0.dist-info\\METADATA', source: files/srt/x.py}\n",
         "contains a backslash"),
        ("  - {op: replace, root: site-packages, path: sglang_x-1.0.dist-info/METADATA, base_sha256: " + BASE + "}\n",
         "root: site-packages allows op 'add' only"),
        ("  - {op: add, root: purelib, path: sglang_x-1.0.dist-info/METADATA}\n",
         "root must be 'package' or 'site-packages'"),
        ("  - {op: add, root: site-packages, path: sglang_x-1.0.dist-info/METADATA}\n"
         "  - {op: add, root: site-packages, path: sglang_x-1.0.dist-info//METADATA}\n", "duplicate path"),
    ],
)
def test_bad_site_packages_entries_are_refused(tmp_path: Path, files_yaml: str, needle: str) -> None:
    d = _bundle(tmp_path, files_yaml, sources={"files/srt/x.py": "X = 1\n", SITE: "Name: sglang-x\n"})
    with pytest.raises(BundleError) as exc:
        load_bundle(d)
    assert needle in str(exc.value)
    assert "patch.yaml: files[" in str(exc.value) and "\n" not in str(exc.value)


def test_site_packages_entry_keys_and_default_source(tmp_path: Path) -> None:
    d = _bundle(tmp_path, "  - {op: add, root: site-packages, path: sglang_x-1.0.dist-info/METADATA}\n",
                sources={SITE: "Name: sglang-x\n"})
    (f,) = load_bundle(d).files
    assert (f.path, f.root, f.rel) == (
        "../sglang_x-1.0.dist-info/METADATA",
        "site-packages",
        "sglang_x-1.0.dist-info/METADATA",
    )
    assert f.source == str((d / SITE).resolve()) and f.content == b"Name: sglang-x\n"


def test_identity_changes_when_a_file_moves_between_roots(tmp_path: Path) -> None:
    """Same manifest bytes but for the root, same content: only the root differs."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sources = {"files/sglang_x-1.0.dist-info/METADATA": "Name: sglang-x\n"}
    src = "source: files/sglang_x-1.0.dist-info/METADATA"
    in_pkg = load_bundle(
        _bundle(
            tmp_path / "a",
            f"  - {{op: add, root: package, path: sglang_x-1.0.dist-info/METADATA, {src}}}\n",
            sources=sources,
        )
    )
    beside = load_bundle(
        _bundle(
            tmp_path / "b",
            f"  - {{op: add, root: site-packages, path: sglang_x-1.0.dist-info/METADATA, {src}}}\n",
            sources=sources,
        )
    )
    assert in_pkg.files[0].sha256 == beside.files[0].sha256
    assert in_pkg.files[0].path != beside.files[0].path
    assert in_pkg.identity != beside.identity
    # The root alone, with the manifest bytes held equal, changes it too (the key carries the root).
    from ddtree_ops.patching.bundle import compute_identity

    assert compute_identity(b"m", in_pkg.files) != compute_identity(b"m", beside.files)


def test_package_identity_is_unchanged_by_the_key_format() -> None:
    """Keys of package files are their plain paths, so identities (in ledgers, on hosts) stay what they were."""
    from ddtree_ops.patching.bundle import compute_identity

    b = load_bundle(BUNDLES / "basic")
    assert all(f.path == f.rel and f.root == "package" for f in b.files)
    assert b.identity == compute_identity((BUNDLES / "basic" / "patch.yaml").read_bytes(), b.files)


def test_symlinked_source_leading_out_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.py"
    secret.write_text("S = 1\n")
    d = _bundle(tmp_path, "  - {op: add, path: srt/x.py}\n", sources={})
    (d / "files/srt").mkdir(parents=True)
    os.symlink(secret, d / "files/srt/x.py")
    with pytest.raises(BundleError, match="outside the bundle directory"):
        load_bundle(d)


def test_unknown_top_level_and_target_keys(tmp_path: Path) -> None:
    d = _bundle(tmp_path, "  - {op: add, path: srt/x.py}\n", extra="verifyy: []\n")
    with pytest.raises(BundleError, match="unknown key.*verifyy"):
        load_bundle(d)
    (d / "patch.yaml").write_text(
        'name: t\nversion: "1"\ntarget: {package: sglang, version: ["0.5.23"]}\nfiles:\n  - {op: add, path: srt/x.py}\n'
    )
    with pytest.raises(BundleError, match="target: unknown key.*'version'"):
        load_bundle(d)


def test_verify_must_be_argv_lists(tmp_path: Path) -> None:
    d = _bundle(tmp_path, "  - {op: add, path: srt/x.py}\n", extra='verify: ["-c import x"]\n')
    with pytest.raises(BundleError, match=r"verify\[0\]"):
        load_bundle(d)


def test_real_ddtree_temperature_bundle_loads() -> None:
    path = Path(__file__).resolve().parents[2] / "patches" / "ddtree_temperature"
    if not (path / "patch.yaml").exists():
        pytest.skip("patches/ddtree_temperature not present")
    b = load_bundle(path)
    assert b.name == "ddtree_temperature" and "0.5.23" in b.versions
    # An SGLang plugin: new modules plus its own dist-info, no SGLang file replaced.
    assert {f.op for f in b.files} == {"add"}
    assert {f.root for f in b.files} == {"package", "site-packages"}


def test_bundle_identity_of_path_and_of_loaded_bundle_agree() -> None:
    from ddtree_ops.patching import bundle_identity

    assert bundle_identity(BUNDLES / "basic") == bundle_identity(load_bundle(BUNDLES / "basic"))
    assert bundle_identity(BUNDLES / "basic") != bundle_identity(BUNDLES / "v2")
