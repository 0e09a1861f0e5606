"""YAML aliases cannot take the controller's memory or time (issue 54).

PyYAML keeps an alias as a reference, so thirty lines of anchors that refer to anchors load
small; every later walk over them as a tree (merging layers, checking keys, an error's
repr) then takes 2**30 steps. Every config file is read through ``safe_load_unique``, which
counts a document's values with its aliases expanded before building anything from it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ddtree_ops.errors import ConfigError
from ddtree_ops.yamlfile import MAX_EXPANDED_VALUES, safe_load_unique


def _fan_out(depth: int, tail: str) -> str:
    lines = ["a0: &a0 [x, x]"] + [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n" + tail.replace("LAST", f"*a{depth - 1}") + "\n"


@pytest.mark.parametrize("tail", [
    "all: {hosts: {h1: {ddtree: {python: LAST}}}}",  # an inventory's own key
    "grid: {budget: LAST}",  # a sweep
    "files: LAST",  # a bundle manifest
])
def test_an_alias_fan_out_is_refused_before_it_is_walked(tail: str) -> None:
    started = time.process_time()
    with pytest.raises(ConfigError, match=r"^f\.yaml: its YAML aliases expand to more than 1,000,000 values"):
        safe_load_unique(_fan_out(30, tail), source="f.yaml")
    assert time.process_time() - started < 1.0  # this process's CPU: a busy machine does not stretch it


def test_the_cli_refuses_an_inventory_bomb_in_one_line(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    inv = tmp_path / "inv.yaml"
    inv.write_text(_fan_out(30, "all: {hosts: {h1: {ddtree: {python: LAST}}}}"))
    started = time.process_time()
    result = cli("-i", str(inv), "hosts")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {inv}: its YAML aliases expand to more than 1,000,000 values "
                                     "(anchors referring to anchors); no config of ours needs that many")
    assert time.process_time() - started < 2.0


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^f\.yaml:2: a YAML alias refers to the anchor that contains it"):
        safe_load_unique("all:\n  hosts: &h {x: *h}\n", source="f.yaml")


def test_ordinary_anchors_aliases_and_merges_still_load() -> None:
    doc = safe_load_unique(
        "base: &b {port: 1, env: {A: '1'}}\nh1: {<<: *b, port: 2}\nh2: *b\nlist: &l [1, 2]\nboth: [*l, *l]\n",
        source="f.yaml")
    assert doc["h1"] == {"port": 2, "env": {"A": "1"}} and doc["h2"] is doc["base"]
    assert doc["both"] == [[1, 2], [1, 2]]
    # Under the bound a fan-out loads (17 levels: ~590,000 values with every anchor and the
    # alias counted): the bound is on values, not on how the file writes them.
    top = safe_load_unique(_fan_out(17, "top: LAST"), source="f.yaml")["top"]
    for _ in range(16):
        top = top[0]
    assert top == ["x", "x"]
    assert MAX_EXPANDED_VALUES == 1_000_000
