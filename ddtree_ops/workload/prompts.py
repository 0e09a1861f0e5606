"""Prompt files and named prompt sets, read into :class:`~ddtree_ops.workload.prompt.Prompt`.

Prompt file schema (documented in ``bench_configs/prompts/README.md``):

* **JSONL** (``*.jsonl``): one JSON object per line; blank lines are skipped.
* **JSON** (``*.json``): a list of the same objects, or ``{"prompts": [...]}``.

Each object has ``prompt`` (non-empty string) *or* ``messages`` (a non-empty list of
``{"role": "system"|"user"|"assistant", "content": str}``), and optionally ``id`` (string)
and ``category`` (string, e.g. ``code``/``math``/``chat``). Any other key is an error:
a typo such as ``promt`` should not silently send empty prompts. Errors name the file and
the line (JSONL) or the index (JSON).

A *named set* is ``<dir>/prompts/<name>.jsonl`` next to the sweep file or in the
project's ``bench_configs/prompts``; the name ``mixed`` means every ``*.jsonl`` there.
Published benchmark data sets (GSM8K, HumanEval, MT-Bench...) are read by
:mod:`.datasets`, in their own layouts, into the same prompts; :mod:`.draw` draws a
sweep's workload from both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddtree_ops.errors import SweepError
from ddtree_ops.shipped import PROJECT_PROMPTS
from ddtree_ops.workload.jsontext import json_value
from ddtree_ops.workload.prompt import Prompt

_KEYS = {"prompt", "messages", "id", "category"}
_ROLES = {"system", "user", "assistant"}


def _parse_item(item: Any, where: str) -> Prompt:
    if not isinstance(item, dict):
        raise SweepError(f"{where}: expected a JSON object, got {type(item).__name__}")
    unknown = sorted(set(item) - _KEYS)
    if unknown:
        raise SweepError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(sorted(_KEYS))})")
    for key in ("id", "category"):
        if key in item and not isinstance(item[key], (str, int)):
            raise SweepError(f"{where}: {key} must be a string")
    has_prompt, has_messages = "prompt" in item, "messages" in item
    if has_prompt == has_messages:
        raise SweepError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if has_prompt:
        text = item["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise SweepError(f"{where}: prompt must be a non-empty string")
        return Prompt(text=text, id=str(item.get("id", "")), category=str(item.get("category", "")))
    msgs = item["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise SweepError(f"{where}: messages must be a non-empty list")
    parsed: list[tuple[str, str]] = []
    for j, m in enumerate(msgs):
        if (
            not isinstance(m, dict)
            or set(m) != {"role", "content"}
            or m["role"] not in _ROLES
            or not isinstance(m["content"], str)
        ):
            raise SweepError(f"{where}: messages[{j}] must be {{role: system|user|assistant, content: str}}")
        parsed.append((m["role"], m["content"]))
    # Display and hash only: /generate gets the served model's rendering (Prompt).
    text = "\n".join(f"{role}: {content}" for role, content in parsed) + "\nassistant:"
    return Prompt(text=text, id=str(item.get("id", "")), category=str(item.get("category", "")), messages=tuple(parsed))


def load_prompt_file(path: Path) -> tuple[Prompt, ...]:
    """Load a JSONL or JSON prompt file; errors name the file and line (or index)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SweepError(f"{path}: prompt file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SweepError(f"{path}: cannot read prompt file: {exc}") from None
    prompts: list[Prompt] = []
    if path.suffix == ".json":
        try:
            data = json_value(text)
        except json.JSONDecodeError as exc:
            raise SweepError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        if isinstance(data, dict) and set(data) == {"prompts"}:
            data = data["prompts"]
        if not isinstance(data, list):
            raise SweepError(f"{path}: expected a list of prompt objects or {{\"prompts\": [...]}}")
        prompts = [_parse_item(item, f"{path}[{i}]") for i, item in enumerate(data)]
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                item = json_value(line)
            except json.JSONDecodeError as exc:
                raise SweepError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
            prompts.append(_parse_item(item, f"{path}:{lineno}"))
    if not prompts:
        raise SweepError(f"{path}: holds no prompts")
    return tuple(prompts)


def _search_dirs(search: Iterable[Path]) -> list[Path]:
    dirs = [Path(d) / "prompts" for d in search]
    dirs.append(PROJECT_PROMPTS)
    return list(dict.fromkeys(dirs))


def find_prompt_set(name: str, *, search: Iterable[Path] = ()) -> tuple[Path, ...]:
    """Files of a named set: ``<dir>/prompts/<name>.jsonl``, or all of them for ``mixed``."""
    dirs = _search_dirs(search)
    for d in dirs:
        if name == "mixed":
            files = tuple(sorted(d.glob("*.jsonl")))
            if files:
                return files
        else:
            candidate = d / f"{name}.jsonl"
            if candidate.is_file():
                return (candidate,)
    known = sorted({p.stem for d in dirs for p in d.glob("*.jsonl")} | {"mixed"})
    raise SweepError(f"unknown prompt set {name!r} (known: {', '.join(known)})")
