"""Prompt files and named prompt sets, turned into the exact list of requests a cell sends.

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

The workload is drawn deterministically from the seed, and its hash (prompts,
max_new_tokens, ignore_eos) goes on every ledger row so ``--resume`` and reports only
compare runs that sent the same thing.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_ops.bench.sweep import Workload
from ddtree_ops.errors import SweepError

PROJECT_PROMPTS = Path(__file__).resolve().parents[2] / "bench_configs" / "prompts"
_KEYS = {"prompt", "messages", "id", "category"}
_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True)
class Prompt:
    """One prompt. ``text`` is what ``/generate`` gets; ``messages`` (if the file gave them)
    is what the OpenAI chat route gets."""

    text: str
    id: str = ""
    category: str = ""
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class WorkloadPrompts:
    """The prompts of one sweep, in send order, and the hash that identifies the workload."""

    prompts: tuple[Prompt, ...]
    max_new_tokens: int
    ignore_eos: bool
    workload_hash: str


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
    # /generate takes raw text; without the model's chat template a plain transcript is the
    # most neutral rendering (the OpenAI chat mode sends the messages themselves).
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
            data = json.loads(text)
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
                item = json.loads(line)
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


def build_workload(workload: Workload, *, search: Sequence[Path] = ()) -> WorkloadPrompts:
    """Draw ``num_prompts`` prompts with the workload's seed (cycling, re-shuffled, when the
    files hold fewer) and hash what will be sent."""
    files = list(workload.prompt_files)
    if workload.prompt_set is not None:
        files.extend(find_prompt_set(workload.prompt_set, search=search))
    pool: list[Prompt] = []
    for f in dict.fromkeys(files):
        pool.extend(load_prompt_file(f))
    if not pool:
        raise SweepError("the workload names no prompt files")
    rng = random.Random(workload.seed)
    chosen: list[Prompt] = []
    while len(chosen) < workload.num_prompts:
        order = list(pool)
        rng.shuffle(order)
        chosen.extend(order[: workload.num_prompts - len(chosen)])
    digest = hashlib.sha256(
        json.dumps(
            {
                "prompts": [[p.text, list(map(list, p.messages))] for p in chosen],
                "max_new_tokens": workload.max_new_tokens,
                "ignore_eos": workload.ignore_eos,
            },
            sort_keys=True,
            ensure_ascii=False,
        ).encode()
    ).hexdigest()
    return WorkloadPrompts(
        prompts=tuple(chosen),
        max_new_tokens=workload.max_new_tokens,
        ignore_eos=workload.ignore_eos,
        workload_hash=digest[:16],
    )
