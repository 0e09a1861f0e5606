"""Sweep files: the YAML a person writes to ask "which budget/top-k is fastest here?".

A sweep names its targets (inventory groups or hosts), the baselines to run under the
same workload, a grid of server and sampling parameters, optional ``exclude``/``include``
rules, the workload and how often to repeat each cell. Everything is validated at load
time and every complaint names the file and the key, so a typo fails before any server
is restarted. The result is a frozen :class:`SweepSpec`; expanding it into cells is the
pure job of :mod:`ddtree_ops.bench.plan`.

Example::

    name: demo
    targets: [local]
    baselines: [autoregressive, dflash]
    grid:
      algorithm: [ddtree]
      budget: [4, 8, 16]
      topk: [2, 4]
      temperature: [0.0, 0.6]
      concurrency: [1, 8]
    exclude:
      - {budget: 16, topk: 2}
    workload: {prompt_set: mixed, num_prompts: 32, max_new_tokens: 128, seed: 0}
    repeats: 1
    warmup: 2
    relaunch: never    # default: one DDTree launch, trees switched live; always: one per tree
    dflash_block: 16   # default: the DFlash drafter's block, the longest DFlash baseline chain
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ddtree_ops.errors import ConfigError, DdtreeOpsError, SweepError
from ddtree_ops.fsutil import read_named_text
from ddtree_ops.limits import MAX_CONCURRENCY, MAX_DDTREE_BUDGET, MAX_DDTREE_TOPK
from ddtree_ops.predict.decide import MAX_REPEATS as MAX_DECIDE_REPEATS
from ddtree_ops.predict.decide import MIN_REPEATS as MIN_DECIDE_REPEATS
from ddtree_ops.service.launch import parse_algorithm
from ddtree_ops.workload.datasets import DATASETS
from ddtree_ops.workload.draw import DatasetRef, Workload, build_workload
from ddtree_ops.workload.prompts import find_prompt_set
from ddtree_ops.yamlfile import safe_load_unique

BASELINES = ("autoregressive", "dflash")
# SGLang's DFLASH block when the draft model's config names none (speculative_hook.py
# _handle_dflash), and the block of the DFlash drafters the papers publish.
DEFAULT_DFLASH_BLOCK = 16

# Every grid axis with its default (a one-element list) and the validator of one value.
GRID_DEFAULTS: Mapping[str, tuple[Any, ...]] = {
    "algorithm": ("ddtree",),
    "budget": (16,),
    "topk": (4,),
    "temperature": (0.0,),
    "top_p": (1.0,),
    "top_k": (-1,),
    "concurrency": (1,),
}
# Axes that change the server; the others are request parameters. Of these only the
# algorithm needs a launch of its own: a DDTree server launched with runtime states
# switches budget and top-k live (``relaunch: never``, the default; see plan.py).
# CUDA-graph vs eager is not an axis: the lifecycle decides it (eager fallback, or a
# runtime state whose capture failed) and every row records it.
SERVER_AXES = ("algorithm", "budget", "topk")
SWITCHABLE_AXES = ("budget", "topk")
# ``never``: one DDTree launch per host for the whole budget x top-k grid, switched live;
# ``always``: one launch per (budget, top-k), the behaviour before runtime states.
RELAUNCH_MODES = ("never", "always")

_TOP_KEYS = {"name", "description", "targets", "baselines", "grid", "exclude", "include",
             "workload", "repeats", "warmup", "request_rate", "api", "request_timeout_s", "client",
             "relaunch", "dflash_block", "predict"}
_PREDICT_KEYS = ("top", "probe_tokens", "probe_waves", "trace_concurrency", "max_repeats")
_WORKLOAD_KEYS = {"prompt_files", "prompt_set", "dataset", "path", "datasets", "num_prompts", "max_new_tokens",
                  "ignore_eos", "seed"}
_DATASET_KEYS = ("name", "path")  # of one entry of workload.datasets
# Upper bounds of the integer axes: the CLI's own (``restart --budget`` refuses more than
# the plugin serves) and, for the load, what one client can keep open without running out
# of file descriptors or a server out of context. Anything larger is a typo, refused
# before a server is touched rather than discovered after a launch.
AXIS_MAX: Mapping[str, int] = {"budget": MAX_DDTREE_BUDGET, "topk": MAX_DDTREE_TOPK, "concurrency": MAX_CONCURRENCY}
#: The most cells a sweep may have (grid product, includes and baselines, counted from the
#: axes before any is expanded): each runs for seconds at least, so 100,000 is days of
#: GPU time per host, and planning a larger grid alone takes minutes (10^6 cells: two)
#: before a typo such as a 10^9-cell grid could be noticed. bench_configs/README.md says it.
MAX_CELLS = 100_000
MAX_NEW_TOKENS = 1 << 20  # the longest context any served model has
MAX_PROMPTS = 1_000_000
MAX_REPEATS = 1000
# The name becomes the ledger's file name (``<name>.jsonl``): a file name's 255 bytes, less room.
MAX_NAME_BYTES = 200
APIS = ("generate", "openai")
# Where the load is generated: this machine, or the GPU host next to its server
# (``bench.onhost``); None = host when the server binds loopback, else local.
CLIENTS = ("local", "host")


@dataclass(frozen=True)
class PredictSpec:
    """A predicted sweep (issue 43, sweep key ``predict:`` or ``bench --predict``): per host
    one trace run per sampling setting and the round-time probes, the whole DDTree grid
    predicted, then only the ``top`` fastest predicted cells per (temperature, concurrency)
    measured (plus the baselines). ``probe_tokens``/``probe_waves``: the length of a probe's
    requests and how many waves of ``concurrency`` requests it sends. ``trace_concurrency``:
    the requests a trace run keeps in flight (None: the grid's largest concurrency); what a
    tree accepts does not depend on it, and a traced request runs one round per token, so a
    larger batch makes the trace runs cheaper where the union's verify fits it.
    ``max_repeats``: the passes over a group's candidates after which a group not yet decided
    stays undecided (:mod:`ddtree_ops.predict.decide`; never fewer than the sweep's repeats)."""

    top: int = 3
    probe_tokens: int = 32
    probe_waves: int = 4
    trace_concurrency: int | None = None
    max_repeats: int = MAX_DECIDE_REPEATS


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep file. ``grid`` maps every axis in :data:`GRID_DEFAULTS` to a tuple."""

    name: str
    source: Path
    targets: tuple[str, ...]
    baselines: tuple[str, ...]
    grid: Mapping[str, tuple[Any, ...]]
    exclude: tuple[Mapping[str, tuple[Any, ...]], ...] = ()
    include: tuple[Mapping[str, Any], ...] = ()
    workload: Workload = field(default_factory=Workload)
    repeats: int = 1
    warmup: int = 1
    request_rate: float | None = None
    api: str = "generate"
    request_timeout_s: float = 600.0
    description: str = ""
    client: str | None = None
    relaunch: str = "never"
    # The DFlash drafter's trained block: the longest chain a DFlash baseline is run at
    # (a chain cannot verify more than the drafter drafts; plan.py's per-width baselines).
    dflash_block: int = DEFAULT_DFLASH_BLOCK
    # Predict the grid and measure only its best cells (None: measure every cell).
    predict: PredictSpec | None = None


def _parse_predict(path: Path, raw: Any) -> PredictSpec | None:
    if raw is None:
        return None
    if raw is True:
        return PredictSpec()
    if not isinstance(raw, Mapping):
        raise _fail(path, "predict", "must be a mapping such as {top: 3} (or true)")
    for key in raw:
        if key not in _PREDICT_KEYS:
            raise _fail(path, f"predict.{key}", f"unknown key{_suggest(str(key), _PREDICT_KEYS)}")
    return PredictSpec(
        top=_int(path, "predict.top", raw.get("top", 3), minimum=1, maximum=MAX_CELLS),
        probe_tokens=_int(path, "predict.probe_tokens", raw.get("probe_tokens", 32), minimum=2, maximum=MAX_NEW_TOKENS),
        probe_waves=_int(path, "predict.probe_waves", raw.get("probe_waves", 4), minimum=1, maximum=MAX_REPEATS),
        trace_concurrency=None if raw.get("trace_concurrency") is None else _int(
            path, "predict.trace_concurrency", raw["trace_concurrency"], minimum=1, maximum=MAX_CONCURRENCY),
        max_repeats=_int(path, "predict.max_repeats", raw.get("max_repeats", MAX_DECIDE_REPEATS),
                         minimum=MIN_DECIDE_REPEATS, maximum=MAX_REPEATS),
    )


def _fail(path: Path, key: str, msg: str) -> SweepError:
    return SweepError(f"{path}: {key}: {msg}")


def _suggest(key: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'repeats'?; expected one of ...)``: the closest valid name, as the
    inventory's unknown keys say it."""
    names = list(valid)
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}?; " if close else ""
    return f" ({hint}expected one of {', '.join(names)})"


def _check_value(path: Path, key: str, axis: str, value: Any) -> Any:
    """Validate one grid value; returns it normalised (ints as int, floats as float)."""
    where = f"{key}"
    if axis == "algorithm":
        return _algorithm(path, where, value)
    if axis in AXIS_MAX:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= AXIS_MAX[axis]:
            raise _fail(path, where, f"must be an integer from 1 to {AXIS_MAX[axis]}, got {value!r}")
        return value
    if axis == "top_k":
        if isinstance(value, bool) or not isinstance(value, int) or (value <= 0 and value != -1):
            raise _fail(path, where, f"must be a positive integer or -1 (disabled), got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, where, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise _fail(path, where, f"must be a finite number, got {value}")
    if axis == "temperature" and value < 0:
        raise _fail(path, where, f"must be >= 0, got {value}")
    if axis == "top_p" and not 0 < value <= 1:
        raise _fail(path, where, f"must be in (0, 1], got {value}")
    return value


# The sweep's names of the server's (and ledger's) AR, DFLASH and DDTREE.
_SWEEP_NAME = {"AR": "autoregressive", "DFLASH": "dflash", "DDTREE": "ddtree"}


def _algorithm(path: Path, key: str, value: Any) -> str:
    """The sweep's name of an algorithm given in either spelling (``AR`` is ``autoregressive``)."""
    try:
        return _SWEEP_NAME[parse_algorithm(value)]
    except ConfigError as exc:
        raise _fail(path, key, exc.message) from None


def _as_list(path: Path, key: str, raw: Any) -> list[Any]:
    if isinstance(raw, list):
        if not raw:
            raise _fail(path, key, "is an empty list")
        return raw
    if isinstance(raw, Mapping):
        raise _fail(path, key, "must be a value or a list of values")
    return [raw]


def _int(path: Path, key: str, raw: Any, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum or (maximum is not None and raw > maximum):
        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise _fail(path, key, f"must be an integer {bound}, got {raw!r}")
    return raw


def _positive_finite(path: Path, key: str, raw: Any, what: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw <= 0:
        raise _fail(path, key, f"must be a positive finite number{what}, got {raw!r}")
    return float(raw)


def _check_name(path: Path, raw: Any) -> str:
    """The sweep's name, which names its ledger file: printable, no path separator."""
    if not isinstance(raw, str) or not raw.strip():
        raise _fail(path, "name", "must be a non-empty name (it names the ledger file)")
    name = raw.strip()
    if "/" in name or not name.isprintable():
        raise _fail(path, "name", f"must have no '/' and no control characters (it names the ledger file), "
                                  f"got {name!r}")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise _fail(path, "name", f"is longer than {MAX_NAME_BYTES} bytes (it names the ledger file)")
    return name


def _parse_grid(path: Path, raw: Any) -> dict[str, tuple[Any, ...]]:
    if raw is None or (isinstance(raw, Mapping) and not raw):
        raise _fail(path, "grid", "is empty (give at least one axis, e.g. budget: [8, 16])")
    if not isinstance(raw, Mapping):
        raise _fail(path, "grid", "must be a mapping of axis -> list of values")
    grid: dict[str, tuple[Any, ...]] = {}
    for axis, values in raw.items():
        if axis not in GRID_DEFAULTS:
            raise _fail(path, f"grid.{axis}", f"unknown axis{_suggest(axis, GRID_DEFAULTS)}")
        items = _as_list(path, f"grid.{axis}", values)
        normalised = [_check_value(path, f"grid.{axis}", axis, v) for v in items]
        if len(set(normalised)) != len(normalised):
            raise _fail(path, f"grid.{axis}", "lists a value twice")
        grid[axis] = tuple(normalised)
    for axis, default in GRID_DEFAULTS.items():
        grid.setdefault(axis, default)
    return grid


def _check_cell_count(
    path: Path, grid: Mapping[str, tuple[Any, ...]], include: Sequence[Mapping[str, Any]], baselines: Sequence[str]
) -> None:
    """Refuse a sweep of more than :data:`MAX_CELLS` cells, counted from the axes (an upper
    bound: ``exclude`` rules are not applied, that would mean expanding the grid) in
    microseconds, before anything is expanded or planned."""
    cells = math.prod(len(values) for values in grid.values())
    # A baseline runs the sampling grid once per launch: DFlash once per DDTree budget at most.
    sampling = math.prod(len(grid[axis]) for axis in ("temperature", "top_p", "top_k", "concurrency"))
    widths = len(grid["budget"]) if "ddtree" in grid["algorithm"] else 1
    total = cells + len(include) + sum(sampling * (widths if b == "dflash" else 1) for b in set(baselines))
    if total > MAX_CELLS:
        sizes = " x ".join(f"{len(grid[axis])} {axis}" for axis in GRID_DEFAULTS if len(grid[axis]) > 1)
        raise _fail(path, "grid", f"{total:,} cells ({sizes}), more than the {MAX_CELLS:,} a sweep may have "
                                  "(counted before exclude, with includes and baselines); split it into several sweeps")


def _parse_rules(path: Path, key: str, raw: Any, *, single: bool) -> tuple[dict[str, Any], ...]:
    """``exclude`` rules match values (a rule value may be a list: any of); ``include`` entries
    are single extra cells."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _fail(path, key, "must be a list of mappings")
    rules: list[dict[str, Any]] = []
    for i, rule in enumerate(raw):
        where = f"{key}[{i}]"
        if not isinstance(rule, Mapping) or not rule:
            raise _fail(path, where, "must be a non-empty mapping of axis -> value")
        parsed: dict[str, Any] = {}
        for axis, value in rule.items():
            if axis not in GRID_DEFAULTS:
                raise _fail(path, f"{where}.{axis}", f"unknown axis{_suggest(axis, GRID_DEFAULTS)}")
            if single:
                if isinstance(value, (list, Mapping)):
                    raise _fail(path, f"{where}.{axis}", "an include entry takes one value per axis")
                parsed[axis] = _check_value(path, f"{where}.{axis}", axis, value)
            else:
                parsed[axis] = tuple(
                    _check_value(path, f"{where}.{axis}", axis, v) for v in _as_list(path, f"{where}.{axis}", value)
                )
        rules.append(parsed)
    return tuple(rules)


def _input_path(path: Path, key: str, raw: str) -> Path:
    """A file or folder the sweep file names, relative to the sweep file's folder. A path
    that cannot be looked at is refused here, naming the key: a symlink loop made pathlib
    raise RuntimeError while resolving it (Python 3.11), and is_file() calls it missing.
    One that does not exist is returned: the caller says what was missing."""
    p = Path(raw).expanduser()
    if not p.is_absolute():
        p = path.parent / p
        try:
            p = p.resolve()
        except RuntimeError:
            raise _fail(path, key, f"{p}: a symlink loop") from None
    try:
        p.stat()
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        why = "a symlink loop" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise _fail(path, key, f"{p}: {why}") from None
    return p


def _dataset_ref(path: Path, key: str, name: Any, where: Any) -> DatasetRef:
    if not isinstance(name, str) or name not in DATASETS:
        raise _fail(path, key, f"unknown data set {name!r} (known: {', '.join(DATASETS)})")
    if where is None:
        return DatasetRef(name)
    if not isinstance(where, str) or not where.strip():
        raise _fail(path, key.rsplit(".", 1)[0] + ".path", f"must be a file or folder path, got {where!r}")
    p = _input_path(path, key.rsplit(".", 1)[0] + ".path", where)
    if not p.exists():
        raise _fail(path, key.rsplit(".", 1)[0] + ".path", f"no such file or folder: {p}")
    return DatasetRef(name, p)


def _parse_datasets(path: Path, raw: Mapping[str, Any]) -> tuple[DatasetRef, ...]:
    """``dataset: gsm8k`` (+ ``path:``), or ``datasets: [{name, path}, ...]`` for a mix."""
    refs: list[DatasetRef] = []
    if "dataset" in raw:
        refs.append(_dataset_ref(path, "workload.dataset", raw["dataset"], raw.get("path")))
    elif "path" in raw:
        raise _fail(path, "workload.path", "names the file of a data set: give dataset: too")
    listed = raw.get("datasets", [])
    if not isinstance(listed, list):
        raise _fail(path, "workload.datasets", "must be a list of {name, path}")
    for i, item in enumerate(listed):
        key = f"workload.datasets[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if isinstance(item, Mapping):
            for k in item:
                if k not in _DATASET_KEYS:
                    raise _fail(path, f"{key}.{k}", f"unknown key{_suggest(str(k), _DATASET_KEYS)}")
        if not isinstance(item, Mapping) or "name" not in item:
            raise _fail(path, key, "must be a data set name or {name, path}")
        refs.append(_dataset_ref(path, f"{key}.name", item["name"], item.get("path")))
    if len(set(refs)) != len(refs):
        raise _fail(path, "workload.datasets", "names the same data set (and path) twice")
    return tuple(refs)


def _parse_workload(path: Path, raw: Any) -> Workload:
    if raw is None:
        raise _fail(path, "workload", "is missing (give prompt_files, prompt_set or dataset)")
    if not isinstance(raw, Mapping):
        raise _fail(path, "workload", "must be a mapping")
    for key in raw:
        if key not in _WORKLOAD_KEYS:
            raise _fail(path, f"workload.{key}", f"unknown key{_suggest(key, sorted(_WORKLOAD_KEYS))}")
    files_raw = raw.get("prompt_files", [])
    if isinstance(files_raw, str):
        files_raw = [files_raw]
    if not isinstance(files_raw, list) or not all(isinstance(f, str) for f in files_raw):
        raise _fail(path, "workload.prompt_files", "must be a path or a list of paths")
    files: list[Path] = []
    for f in files_raw:
        p = _input_path(path, "workload.prompt_files", f)
        if not p.is_file():
            raise _fail(path, "workload.prompt_files", f"prompt file not found: {p}")
        files.append(p)
    prompt_set = raw.get("prompt_set")
    if prompt_set is not None and not isinstance(prompt_set, str):
        raise _fail(path, "workload.prompt_set", f"must be a name, got {prompt_set!r}")
    datasets = _parse_datasets(path, raw)
    if not files and prompt_set is None and not datasets:
        raise _fail(path, "workload", "give prompt_files, prompt_set or dataset")
    if prompt_set is not None:
        try:
            find_prompt_set(prompt_set, search=(path.parent,))
        except SweepError as exc:
            raise _fail(path, "workload.prompt_set", exc.message) from None
    ignore_eos = raw.get("ignore_eos", True)
    if not isinstance(ignore_eos, bool):
        raise _fail(path, "workload.ignore_eos", f"must be true or false, got {ignore_eos!r}")
    return Workload(
        prompt_files=tuple(files),
        prompt_set=prompt_set,
        datasets=datasets,
        num_prompts=_int(path, "workload.num_prompts", raw.get("num_prompts", 32), minimum=1, maximum=MAX_PROMPTS),
        max_new_tokens=_int(path, "workload.max_new_tokens", raw.get("max_new_tokens", 128), minimum=1,
                            maximum=MAX_NEW_TOKENS),
        ignore_eos=ignore_eos,
        seed=_int(path, "workload.seed", raw.get("seed", 0), minimum=0),
    )


def parse_sweep(data: Any, path: Path) -> SweepSpec:
    """Validate an already-parsed YAML document; ``path`` anchors relative prompt files."""
    if not isinstance(data, Mapping):
        raise SweepError(f"{path}: the sweep file must be a YAML mapping")
    for key in data:
        if key not in _TOP_KEYS:
            raise _fail(path, str(key), f"unknown key{_suggest(str(key), sorted(_TOP_KEYS))}")
    name = _check_name(path, data.get("name"))
    targets_raw = data.get("targets")
    if isinstance(targets_raw, str):
        targets_raw = [targets_raw]
    if not isinstance(targets_raw, list) or not targets_raw or not all(isinstance(t, str) and t for t in targets_raw):
        raise _fail(path, "targets", "must be a non-empty list of inventory groups or hosts")
    baselines_raw = data.get("baselines", [])
    if isinstance(baselines_raw, str):
        baselines_raw = [baselines_raw]
    if not isinstance(baselines_raw, list):
        raise _fail(path, "baselines", "must be a list")
    baselines_raw = [_algorithm(path, "baselines", b) for b in baselines_raw]
    for b in baselines_raw:
        if b not in BASELINES:
            raise _fail(path, "baselines", f"unknown baseline {b!r} (expected any of {', '.join(BASELINES)})")
    rate = data.get("request_rate")
    if rate is not None:
        rate = _positive_finite(path, "request_rate", rate, " of requests/s (leave it out for a closed loop)")
    api = data.get("api", "generate")
    if api not in APIS:
        raise _fail(path, "api", f"must be one of {', '.join(APIS)}, got {api!r}")
    timeout = _positive_finite(path, "request_timeout_s", data.get("request_timeout_s", 600.0), " of seconds")
    client = data.get("client")
    if client is not None and client not in CLIENTS:
        raise _fail(path, "client", f"must be one of {', '.join(CLIENTS)}, got {client!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _fail(path, "description", "must be text")
    relaunch = data.get("relaunch", "never")
    if relaunch not in RELAUNCH_MODES:
        raise _fail(path, "relaunch", f"must be one of {', '.join(RELAUNCH_MODES)} (never: switch the DDTree tree "
                                      f"live on one launch; always: one launch per budget and top-k), got {relaunch!r}")
    grid = _parse_grid(path, data.get("grid"))
    exclude = _parse_rules(path, "exclude", data.get("exclude"), single=False)
    include = _parse_rules(path, "include", data.get("include"), single=True)
    _check_cell_count(path, grid, include, baselines_raw)
    return SweepSpec(
        name=name,
        source=path,
        targets=tuple(targets_raw),
        baselines=tuple(dict.fromkeys(baselines_raw)),
        grid=grid,
        exclude=exclude,
        include=include,
        workload=_parse_workload(path, data.get("workload")),
        repeats=_int(path, "repeats", data.get("repeats", 1), minimum=1, maximum=MAX_REPEATS),
        warmup=_int(path, "warmup", data.get("warmup", 1), minimum=0, maximum=MAX_REPEATS),
        request_rate=rate,
        api=api,
        request_timeout_s=timeout,
        description=description,
        client=client,
        relaunch=relaunch,
        dflash_block=_int(path, "dflash_block", data.get("dflash_block", DEFAULT_DFLASH_BLOCK), minimum=2,
                          maximum=MAX_DDTREE_BUDGET + 1),
        predict=_parse_predict(path, data.get("predict")),
    )


def load_sweep(path: Path) -> SweepSpec:
    """Read and validate a sweep file; every error is a :class:`SweepError` naming file and key.

    The prompt files are read and validated here too, line by line exactly as the run
    will read them, so ``bench --dry-run`` refuses a bad prompt line (file:line) instead
    of passing a sweep that fails once the first server is up.
    """
    path = Path(path)
    text = read_named_text(path, SweepError, what="sweep file", form="YAML")
    try:
        data = safe_load_unique(text, source=str(path), error=SweepError)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise SweepError(f"{path}{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    spec = parse_sweep(data, path)
    build_workload(spec.workload, search=(spec.source.parent,))
    return spec


def _canonical_rule(rule: Mapping[str, Any]) -> dict[str, Any]:
    return {axis: sorted(v) if isinstance(v, tuple) else v for axis, v in sorted(rule.items())}


def sweep_hash(spec: SweepSpec) -> str:
    """sha256 (hex) of what the sweep measures, stable across formatting and ordering.

    Hashed: the baselines, the grid (each axis's values sorted: ``[8, 4]`` asks for the
    same cells as ``[4, 8]``), the exclude/include rules, the workload (prompt files by
    name, not by where the checkout lies), repeats, warmup, request rate and API -- the
    parsed values, so ``0`` and ``0.0`` or a reflowed file give the same hash. Not hashed:
    the name, description and targets (running the same sweep on more hosts is the same
    sweep), the request timeout (a limit, not part of the measurement), the client
    (where the load is generated; each row records which measured it) and ``relaunch``
    (how the trees are set: the same cells either way, and each row records whether its
    tree was switched live, so one ledger may hold both for comparison). ``bench
    --resume`` refuses a ledger whose rows carry another sweep's hash.
    """
    wl = spec.workload
    content = {
        "baselines": sorted(spec.baselines),
        "grid": {axis: sorted(values) for axis, values in sorted(spec.grid.items())},
        "exclude": sorted((_canonical_rule(r) for r in spec.exclude), key=lambda r: json.dumps(r, sort_keys=True)),
        "include": sorted((_canonical_rule(r) for r in spec.include), key=lambda r: json.dumps(r, sort_keys=True)),
        "workload": {
            "prompt_files": [p.name for p in wl.prompt_files],
            "prompt_set": wl.prompt_set,
            # Only when set, so that the hashes of sweeps written before data sets stay.
            **({"datasets": [[d.name, d.path.name if d.path else None] for d in wl.datasets]} if wl.datasets else {}),
            "num_prompts": wl.num_prompts,
            "max_new_tokens": wl.max_new_tokens,
            "ignore_eos": wl.ignore_eos,
            "seed": wl.seed,
        },
        "repeats": spec.repeats,
        "warmup": spec.warmup,
        "request_rate": spec.request_rate,
        "api": spec.api,
        # Only when set, so that the hashes of sweeps written before it stay.
        **({"dflash_block": spec.dflash_block} if spec.dflash_block != DEFAULT_DFLASH_BLOCK else {}),
    }
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_targets(spec: SweepSpec, resolve: Callable[[str], Sequence[object]]) -> None:
    """Fail early, naming the file, if a target is not a group or host of the inventory.

    ``resolve`` is ``Inventory.resolve``; it raises a TargetError (or returns nothing) for
    unknown names.
    """
    for target in spec.targets:
        try:
            found = resolve(target)
        except DdtreeOpsError as exc:
            # The resolver's message names the target itself: said once, not nested in ours.
            raise _fail(spec.source, "targets", exc.message) from None
        if not found:
            raise _fail(spec.source, "targets", f"unknown target {target!r} (no such group or host)")
