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
Published benchmark data sets (GSM8K, HumanEval, MT-Bench...) are read by
:mod:`.datasets`, in their own layouts, into the same :class:`Prompt`.

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
from ddtree_ops.shipped import PROJECT_PROMPTS

_KEYS = {"prompt", "messages", "id", "category"}
_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True)
class Prompt:
    """One prompt: a completion prompt (``text``, sent as is) or a chat prompt
    (``messages``), which is only ever sent through the served model's chat template: as
    messages on the OpenAI chat route, or, for ``/generate``, as the ``input_ids`` that
    the server's ``/v1/tokenize`` renders them to (``input_ids``, filled per launch by the
    runner). A chat prompt's ``text`` is a plain transcript, kept for the workload hash
    and for display, never sent.

    ``dataset`` and ``category`` say where it came from (``gsm8k``; MATH-500's subject);
    ``followups`` are the later turns of a multi-turn question (chat only): the load
    client sends each once the model has answered the turn before it."""

    text: str
    id: str = ""
    category: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    dataset: str = ""
    followups: tuple[str, ...] = ()
    input_ids: tuple[int, ...] = ()

    @property
    def chat(self) -> bool:
        return bool(self.messages)

    @property
    def group(self) -> str:
        """The row breakdown's key: ``dataset/category``, or whichever of them is set."""
        return "/".join(part for part in (self.dataset, self.category) if part) or "-"


@dataclass(frozen=True)
class WorkloadPrompts:
    """The prompts of one sweep, in send order, and the hash that identifies the workload."""

    prompts: tuple[Prompt, ...]
    max_new_tokens: int
    ignore_eos: bool
    workload_hash: str
    name: str  # its sources, ``+``-joined: the ledger's workload_name

    @property
    def prompt_format(self) -> str:
        """How the prompts reach the model (the ledger's ``workload_prompt_format``):
        ``chat-template`` (through the served model's chat template), ``text`` (plain
        completion text), or both joined by ``+``."""
        kinds = {"chat-template" if p.chat else "text" for p in self.prompts}
        return "+".join(k for k in ("chat-template", "text") if k in kinds)


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


def _draw(pool: Sequence[Prompt], count: int, rng: random.Random) -> list[Prompt]:
    """``count`` prompts of ``pool``, shuffled, cycling (re-shuffled) when it holds fewer."""
    chosen: list[Prompt] = []
    while len(chosen) < count:
        order = list(pool)
        rng.shuffle(order)
        chosen.extend(order[: count - len(chosen)])
    return chosen


def workload_pools(workload: Workload, *, search: Sequence[Path] = ()) -> list[tuple[str, tuple[Prompt, ...]]]:
    """The workload's sources, each (name, prompts): the prompt files and named set as one
    pool, then each data set (:mod:`.datasets`) as its own."""
    files = list(workload.prompt_files)
    if workload.prompt_set is not None:
        files.extend(find_prompt_set(workload.prompt_set, search=search))
    pools: list[tuple[str, tuple[Prompt, ...]]] = []
    own: list[Prompt] = []
    for f in dict.fromkeys(files):
        own.extend(load_prompt_file(f))
    if own:
        pools.append((workload.prompt_set or "+".join(p.stem for p in workload.prompt_files), tuple(own)))
    if workload.datasets:
        # Here, not at the top: datasets.py builds Prompts, and pyarrow is only for data sets.
        from ddtree_ops.bench.datasets import load_dataset

        for ref in workload.datasets:
            pools.append((ref.name, load_dataset(ref.name, ref.path).prompts))
    return pools


def build_workload(workload: Workload, *, search: Sequence[Path] = ()) -> WorkloadPrompts:
    """Draw ``num_prompts`` prompts with the workload's seed and hash what will be sent.

    One source: drawn from it (cycling, re-shuffled, when it holds fewer). Several (the
    project's files and data sets, or a mix of data sets): an equal share from each, so
    that 80 MT-Bench questions are not drowned by 90k ShareGPT conversations, the shares
    then shuffled together so that the sets interleave in send order."""
    pools = workload_pools(workload, search=search)
    if not pools:
        raise SweepError("the workload names no prompt files")
    rng = random.Random(workload.seed)
    if len(pools) == 1:
        chosen = _draw(pools[0][1], workload.num_prompts, rng)
    else:
        share, extra = divmod(workload.num_prompts, len(pools))
        chosen = [p for i, (_, pool) in enumerate(pools) for p in _draw(pool, share + (i < extra), rng)]
        rng.shuffle(chosen)
    digest = hashlib.sha256(
        json.dumps(
            {
                # Follow-up turns only where there are some: the hashes of single-turn
                # workloads stay what their ledgers hold.
                "prompts": [[p.text, list(map(list, p.messages)), *([list(p.followups)] if p.followups else [])]
                            for p in chosen],
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
        name="+".join(name for name, _ in pools),
    )
