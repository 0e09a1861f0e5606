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


# The most values a document may stand for once its aliases are expanded. PyYAML keeps an
# alias as a reference to one object, so a few lines of anchors referring to anchors
# (``&a [x, x]``, ``&b [*a, *a]``, ... thirty deep) load small, and then every walk over
# them as a tree (merging layers, checking keys, printing an error) takes 2**30 steps:
# counted on the composed nodes, once per node, before anything is built from them.
MAX_EXPANDED_VALUES = 1_000_000


class _TooLarge(yaml.YAMLError):
    pass


class _SelfReference(yaml.YAMLError):
    def __init__(self, line: int) -> None:
        super().__init__("an alias inside its own anchor")
        self.line = line


def expanded_size(node: yaml.Node, memo: dict[int, int] | None = None, inside: set[int] | None = None) -> int:
    """How many values ``node`` stands for with every alias expanded (each distinct node is
    counted once and its count reused); _TooLarge past :data:`MAX_EXPANDED_VALUES`,
    _SelfReference for a node that contains itself."""
    memo = {} if memo is None else memo
    inside = set() if inside is None else inside
    key = id(node)
    if key in memo:
        return memo[key]
    if key in inside:
        raise _SelfReference(node.start_mark.line + 1)
    inside.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(expanded_size(child, memo, inside) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(expanded_size(k, memo, inside) + expanded_size(v, memo, inside) for k, v in node.value)
    inside.discard(key)
    if total > MAX_EXPANDED_VALUES:
        raise _TooLarge()
    memo[key] = total
    return total


class UniqueKeyLoader(yaml.SafeLoader):
    """A ``SafeLoader`` whose mappings refuse a key that is already there (``<<`` merges keep
    YAML's meaning: an explicit key may override a merged one), and whose documents may not
    expand past :data:`MAX_EXPANDED_VALUES` values through their aliases."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        expanded_size(node)
        return self.construct_document(node)

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
    except _TooLarge:
        raise error(f"{source}: its YAML aliases expand to more than {MAX_EXPANDED_VALUES:,} values (anchors "
                    f"referring to anchors); no config of ours needs that many") from None
    except _SelfReference as exc:
        raise error(f"{source}:{exc.line}: a YAML alias refers to the anchor that contains it") from None
    except RecursionError:
        # PyYAML composes and constructs recursively: a hostile or generated file nested a
        # few thousand levels deep exhausts the stack. No config of ours nests past ten.
        raise error(f"{source}: nested too deeply to be a config file") from None
