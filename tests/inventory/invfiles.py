"""Helpers the inventory tests share: write files, load them, catch the one-line error."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ddtree_ops.errors import InventoryError
from ddtree_ops.inventory import Inventory, load_inventory


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def load(*paths: Path) -> Inventory:
    return load_inventory(list(paths))


def error_line(*paths: Path) -> str:
    """The InventoryError loading ``paths`` raises; it must be one line."""
    with pytest.raises(InventoryError) as info:
        load(*paths)
    message = str(info.value)
    assert "\n" not in message
    return message
