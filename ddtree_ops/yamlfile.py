"""YAML loading that refuses a mapping key written twice.

PyYAML's ``safe_load`` keeps the last of two equal keys without a word, so a second
``port:`` under a host, or a sweep's ``repeats:`` written twice, would silently override
the first. Every config file (inventories, sweeps, bundle manifests) is read through
:func:`safe_load_unique`, which raises the caller's :class:`ConfigError` subclass naming
``file:line`` and the key instead.
"""

from __future__ import annotations

from typing import Any

import yaml

from ddtree_ops.errors import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key
        self.line = line
        self.first_line = first_line


class UniqueKeyLoader(yaml.SafeLoader):
    """A ``SafeLoader`` whose mappings refuse a key that is already there (``<<`` merges keep
    YAML's meaning: an explicit key may override a merged one)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable: SafeLoader's own error says so below
                    continue
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise _DuplicateKey(key, line, first)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)  # type: ignore[arg-type]


def safe_load_unique(
    text: str | bytes,
    *,
    source: str,
    error: type[ConfigError] = ConfigError,
    loader: type[UniqueKeyLoader] = UniqueKeyLoader,
) -> Any:
    """``yaml.safe_load`` that raises ``error("FILE:LINE: duplicate key 'K' (first at line N)")``.

    Other YAML errors propagate unchanged, for the caller to word as it already does.
    ``loader`` may be a subclass adding tags (the inventory's ``!vault`` / ``!unsafe``).
    """
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506  # a SafeLoader subclass
    except _DuplicateKey as exc:
        raise error(f"{source}:{exc.line}: duplicate key {exc.key!r} (first at line {exc.first_line})") from None
    except RecursionError:
        # PyYAML composes and constructs recursively: a hostile or generated file nested a
        # few thousand levels deep exhausts the stack. No config of ours nests past ten.
        raise error(f"{source}: nested too deeply to be a config file") from None
