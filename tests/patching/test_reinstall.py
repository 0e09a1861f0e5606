"""A host whose patched files were changed outside ddtree-ops (a pip reinstall, a hand edit).

The state record still names the bundle, but some of its files hold something else now.
Deploy must not silently re-apply over that: it refuses the host as ``changed-outside``
and says what to do; ``--force`` re-applies, ``rollback`` clears the record. The pure
planner is tested on its own, then a real local prefix, then the full scenario over the
SSH fleet with the host's real ``pip install --force-reinstall``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_json import json_data
from fleetlib import Fleet, find_wheel
from minisglang import upstream_bytes

from ddtree_ops.errors import DriftError, PatchError
from ddtree_ops.patching.bundle import Bundle, load_bundle
from ddtree_ops.patching.executor import RunOptions, deploy, rollback
from ddtree_ops.patching.gather import AppliedRecord
from ddtree_ops.patching.plan import changed_outside, plan_deploy, plan_rollback
from ddtree_ops.patching.status import host_status
from ddtree_ops.transport import open_transport
from ddtree_ops.transport.local import LocalTransport
from patching.conftest import BUNDLES, MiniHost
from patching.test_fleet import REAL_BUNDLE, _reset
from patching.test_plan import BASE, NEW, OTHER, _bundle, _rs

ADDED = "d" * 64


def _record(identity: str) -> dict[str, Any]:
    return {"name": "t", "identity": identity, "package_version": "0.5.23", "files": {
        "srt/a.py": {"original_sha256": BASE, "patched_sha256": NEW, "backup": "/p/.ddtree-ops/backups/x/srt/a.py"},
        "srt/b.py": {"original_sha256": None, "patched_sha256": ADDED, "backup": None}}}


# --- the pure planner ---------------------------------------------------------------


def test_reinstalled_host_is_refused_as_changed_outside_with_what_to_do() -> None:
    b = _bundle()
    # What a reinstall leaves: the replaced file is upstream again, the added file stays.
    rs = _rs({"srt/a.py": BASE, "srt/b.py": ADDED}, applied=_record(b.identity))
    p = plan_deploy(b, rs)
    assert p.outcome == "changed-outside" and p.actions == ()
    assert p.reason.startswith("h: changed outside ddtree-ops since t ")
    assert "1 file reverted to original" in p.reason and "sglang 0.5.23 is installed now" in p.reason
    assert "`ddtree-ops deploy h --force`" in p.reason and "`ddtree-ops rollback h`" in p.reason
    assert "\n" not in p.reason

    forced = plan_deploy(b, rs, force=True)
    assert forced.outcome == "apply"
    assert {a.path: a.kind for a in forced.actions} == {"srt/a.py": "replace", "srt/b.py": "patched"}
    assert forced.actions[0].backup_as_original  # what is there now is backed up first
    assert any("re-applying over changes made outside ddtree-ops" in n for n in forced.notes)


def test_unknown_content_and_upgrade_are_named_too() -> None:
    b = _bundle()
    rec = _record(b.identity) | {"package_version": "0.5.22"}
    p = plan_deploy(b, _rs({"srt/a.py": OTHER, "srt/b.py": None}, applied=rec))
    assert p.outcome == "changed-outside"
    assert "1 file reverted to original, 1 file drifted" in p.reason  # b.py removed = its original (absent)
    assert "t was applied on 0.5.22" in p.reason
    change = changed_outside(AppliedRecord.from_json(rec), {"srt/a.py": OTHER, "srt/b.py": None})
    assert change is not None and change.reverted == ("srt/b.py",) and change.drifted == ("srt/a.py",)


def test_behaviour_unchanged_where_the_record_matches_or_is_absent() -> None:
    b = _bundle()
    # All as applied: no-op, as before.
    assert plan_deploy(b, _rs({"srt/a.py": NEW, "srt/b.py": ADDED}, applied=_record(b.identity))).outcome == "noop"
    # Never patched, unknown content: the per-file conflict, as before.
    p = plan_deploy(b, _rs({"srt/a.py": OTHER, "srt/b.py": None}))
    assert p.outcome == "conflict" and "drifted" in p.reason
    # Never patched, upstream files: a fresh apply.
    assert plan_deploy(b, _rs({"srt/a.py": BASE, "srt/b.py": None})).outcome == "apply"
    # A leftover journal still comes first.
    assert plan_deploy(b, _rs({"srt/a.py": BASE, "srt/b.py": ADDED}, applied=_record(b.identity),
                              journal={"txn": "x"})).outcome == "recover"


def test_rollback_of_a_reinstalled_host_restores_what_it_can_and_says_so() -> None:
    rs = _rs({"srt/a.py": BASE, "srt/b.py": ADDED}, applied=_record("i"))
    p = plan_rollback(rs)
    assert p.outcome == "apply"
    assert {a.path: a.kind for a in p.actions} == {"srt/a.py": "patched", "srt/b.py": "delete"}
    assert any("1 file reverted to original (left as they are)" in n for n in p.notes)
    everything_back = plan_rollback(_rs({"srt/a.py": BASE, "srt/b.py": None}, applied=_record("i")))
    assert everything_back.outcome == "apply" and everything_back.changes == ()
    assert everything_back.summary() == "record cleared, files already original"


# --- a real local prefix ----------------------------------------------------------------


def test_rollback_on_changed_outside_local_host(mini: MiniHost) -> None:
    basic = load_bundle(BUNDLES / "basic")
    t = LocalTransport(mini.host.name)
    assert deploy(t, mini.host, basic).outcome == "applied"
    replaced = [f.path for f in basic.files if f.op == "replace"]
    for rel in replaced:  # what a reinstall does to the files the bundle replaced
        mini.file(rel).write_bytes(upstream_bytes(rel))
    st = host_status(t, mini.host, bundle=basic)
    assert st.outside_change is not None and st.outside_change.reverted == tuple(sorted(replaced))
    assert st.to_json()["changed_outside"]["summary"] == "2 files reverted to original"

    with pytest.raises(DriftError, match=r"mini: changed outside ddtree-ops .*2 files reverted to original.*--force"):
        deploy(t, mini.host, basic)
    assert mini.file("srt/speculative/ddtree_mini.py").exists()  # the refusal touched nothing

    out = rollback(t, mini.host)
    assert out.outcome == "rolled-back" and "1 delete" in out.message
    assert "2 files reverted to original (left as they are)" in out.message
    assert not mini.file("srt/speculative/ddtree_mini.py").exists()
    after = host_status(t, mini.host, bundle=basic)
    assert after.bundle_name is None and after.outside_change is None
    assert {f.state for f in after.files} == {"original"}
    assert deploy(t, mini.host, basic).outcome == "applied"  # a plain fresh deploy again


# --- the whole story over SSH, with the host's real pip ------------------------------------


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.fixture
def wide_cli(cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """The real CLI with a console wide enough that a table row is one line to search."""
    from ddtree_ops.cli import main

    monkeypatch.setattr(main.console, "width", 400)
    monkeypatch.setattr(main.err_console, "width", 400)
    return cli


# A bundle that replaces real SGLang 0.5.23 files (the DDTree bundle replaces none): the
# case a pip reinstall undoes.
REPLACING_BUNDLE = BUNDLES / "basic"


@pytest.fixture(params=[REPLACING_BUNDLE, REAL_BUNDLE], ids=["replacing", "plugin"])
def two_pristine_hosts(request: pytest.FixtureRequest, ssh_fleet: Fleet) -> Iterator[tuple[Any, Any, Bundle]]:
    """Two fleet hosts, upstream and unrecorded before and after (the fleet is shared)."""
    if not (request.param / "patch.yaml").exists():
        pytest.skip(f"{request.param} not present")
    bundle = load_bundle(request.param)
    pair = ssh_fleet.hosts[:2]
    for fh in pair:
        _reset(fh, bundle)
    try:
        yield pair[0], pair[1], bundle
    finally:
        inv = ssh_fleet.load()
        for fh in pair:
            try:  # the tool's own way back first; the reset below covers whatever it could not do
                with open_transport(inv.hosts[fh.name]) as t:
                    rollback(t, inv.hosts[fh.name], RunOptions(force=True, break_lock=True))
            except PatchError:
                pass
            _reset(fh, bundle)


@pytest.mark.fleet
@pytest.mark.slow
def test_pip_reinstall_on_one_host_named_refused_forced_rolled_back(
    ssh_fleet: Fleet, two_pristine_hosts: tuple[Any, Any, Bundle], wide_cli: Callable[..., Any]
) -> None:
    fa, fb, bundle = two_pristine_hosts
    if not any(f.op == "replace" for f in bundle.files):
        pytest.skip("a bundle that replaces nothing is untouched by a reinstall (next test)")
    bundle_dir = Path(bundle.origin)
    inv = str(ssh_fleet.inventory)
    both = f"{fa.name},{fb.name}"
    replaced = sorted(f.path for f in bundle.files if f.op == "replace")
    added = sorted(f.path for f in bundle.files if f.op == "add")

    def status() -> dict[str, Any]:
        res = wide_cli("-i", inv, "--json", "status", both, "--bundle", str(bundle_dir))
        assert res.exit_code == 0, res.stdout + res.stderr
        return {r["host"]: r for r in json_data(res.stdout)}

    first = wide_cli("-i", inv, "--json", "deploy", both, str(bundle_dir))
    assert first.exit_code == 0, first.stdout + first.stderr
    assert [r["outcome"] for r in json_data(first.stdout)] == ["applied", "applied"]
    st = status()
    for name in (fa.name, fb.name):
        assert st[name]["bundle"]["identity"] == bundle.identity and st[name]["changed_outside"] is None
        assert {f["state"] for f in st[name]["files"]} == {"patched"}

    # The host's own pip puts the upstream sglang back; it does not own the added files.
    host_a = ssh_fleet.load().hosts[fa.name]
    with open_transport(host_a) as t:
        t.run([host_a.python, "-m", "pip", "install", "--force-reinstall", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "-q", str(find_wheel())], timeout=600, check=True)
    reinstalled = {rel: _sha(fa.sglang_dir / rel) for rel in replaced}
    assert reinstalled == {f.path: f.base_sha256 for f in bundle.files if f.op == "replace"}

    st = status()
    assert st[fa.name]["changed_outside"] == {"reverted": replaced, "drifted": [],
                                             "summary": "2 files reverted to original"}
    assert st[fb.name]["changed_outside"] is None
    text = wide_cli("-i", inv, "status", both, "--bundle", str(bundle_dir))
    row_a = next(line for line in text.stdout.splitlines() if fa.name in line)
    row_b = next(line for line in text.stdout.splitlines() if fb.name in line)
    assert "changed outside ddtree-ops: 2 files reverted to original" in row_a
    assert "changed outside" not in row_b

    refused = wide_cli("-i", inv, "deploy", both, str(bundle_dir))
    assert refused.exit_code != 0
    row_a = next(line for line in refused.stdout.splitlines() if f"{fa.name}: changed outside" in line)
    for words in ("2 files reverted to original", "sglang 0.5.23 is installed now",
                  f"`ddtree-ops deploy {fa.name} --force`", f"`ddtree-ops rollback {fa.name}`"):
        assert words in row_a, (words, row_a)
    # The refusal is found before any host changes: the deploy is refused as a whole (fb not
    # reached), unless --max-fail lets one host out, and then fb goes on.
    assert "not reached" in next(line for line in refused.stdout.splitlines() if f" {fb.name} " in line)
    within = wide_cli("-i", inv, "deploy", both, str(bundle_dir), "--max-fail", "1")
    assert within.exit_code != 0
    assert "already applied" in next(line for line in within.stdout.splitlines() if f" {fb.name} " in line)
    assert {rel: _sha(fa.sglang_dir / rel) for rel in replaced} == reinstalled  # refused = untouched

    forced = wide_cli("-i", inv, "--json", "deploy", fa.name, str(bundle_dir), "--force")
    assert forced.exit_code == 0, forced.stdout + forced.stderr
    (row,) = json_data(forced.stdout)
    assert row["outcome"] == "applied" and "re-applying over changes made outside ddtree-ops" in row["message"]
    again = wide_cli("-i", inv, "--json", "deploy", both, str(bundle_dir))
    assert [r["outcome"] for r in json_data(again.stdout)] == ["noop", "noop"]
    st = status()
    assert all(st[n]["changed_outside"] is None and {f["state"] for f in st[n]["files"]} == {"patched"}
               for n in (fa.name, fb.name))

    back = wide_cli("-i", inv, "--json", "rollback", both)
    assert back.exit_code == 0, back.stdout + back.stderr
    assert [r["outcome"] for r in json_data(back.stdout)] == ["rolled-back", "rolled-back"]
    st = status()
    for fh in (fa, fb):
        assert st[fh.name]["bundle"] is None and {f["state"] for f in st[fh.name]["files"]} == {"original"}
        assert all(not (fh.sglang_dir / rel).exists() for rel in added)
        assert {rel: _sha(fh.sglang_dir / rel) for rel in replaced} == reinstalled


@pytest.mark.fleet
@pytest.mark.slow
def test_pip_reinstall_leaves_the_plugin_bundle_applied(
    ssh_fleet: Fleet, two_pristine_hosts: tuple[Any, Any, Bundle], wide_cli: Callable[..., Any]
) -> None:
    """The DDTree bundle only adds files (modules beside SGLang's and a dist-info of its
    own), so the host's pip reinstalling SGLang leaves it in place and working."""
    fa, _fb, bundle = two_pristine_hosts
    if any(f.op == "replace" for f in bundle.files):
        pytest.skip("a replacing bundle is undone by a reinstall (previous test)")
    inv = str(ssh_fleet.inventory)
    first = wide_cli("-i", inv, "--json", "deploy", fa.name, str(REAL_BUNDLE))
    assert first.exit_code == 0 and json_data(first.stdout)[0]["outcome"] == "applied", first.stdout + first.stderr
    host_a = ssh_fleet.load().hosts[fa.name]
    with open_transport(host_a) as t:
        t.run([host_a.python, "-m", "pip", "install", "--force-reinstall", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "-q", str(find_wheel())], timeout=600, check=True)
        plugins = t.run([host_a.python, "-c", "from importlib import metadata; "
                         "print([e.value for e in metadata.entry_points(group='sglang.srt.plugins')])"],
                        check=True).stdout
    assert "sglang.srt.speculative.ddtree_plugin:load" in plugins
    res = wide_cli("-i", inv, "--json", "status", fa.name, "--bundle", str(REAL_BUNDLE))
    (st,) = json_data(res.stdout)
    assert st["changed_outside"] is None and {f["state"] for f in st["files"]} == {"patched"}
    again = wide_cli("-i", inv, "--json", "deploy", fa.name, str(REAL_BUNDLE))
    assert json_data(again.stdout)[0]["outcome"] == "noop"
