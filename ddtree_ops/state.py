"""Local state that outlives one command: learned load times, eager fallbacks, tuned policies.

Why a file on the operator's machine and not on the GPU host: the facts are about how
the *toolkit* should act next time (how long to wait for this host+model, whether to
skip a CUDA-graph attempt that is known to crash, which tuned DDTREE policy a restart
launches with), and the operator's machine is the one place every command runs from. One JSON document, default
``~/.cache/ddtree-ops/state.json``, overridable with ``$DDTREE_OPS_STATE`` (tests point
it into a temp dir).

Writes are atomic (temp file + fsync + ``os.replace``) and serialized by a process-wide
lock plus an advisory ``flock`` on a side file, so parallel restarts of several hosts
(threads) and two CLI invocations at once never lose an update: every update is a
read-modify-write under the lock.

Every read validates the whole file (:func:`_check_records`): a record whose values are
garbage (a budget ``"abc"``, ``recorded_at: "x"``, a policy whose ``config`` is not a
policy, a load time of 1e308 s) is refused with one line naming the file and the record,
and how to fix it, before anything acts on it (ConfigError, exit 2). Commands that read
the file inside a fan-out call :meth:`StateStore.check` first, so that the refusal comes
before any host is touched. A record whose *fields* are not this version's (another
toolkit version wrote it) is skipped, as it always was.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ddtree_ops.errors import ConfigError
from ddtree_ops.fsutil import NOT_REGULAR, read_regular_text, write_atomic_local
from ddtree_ops.limits import (
    MAX_CONCURRENCY,
    MAX_DDTREE_TOPK,
    MAX_DFLASH_DRAFT_TOKENS,
    MAX_LOAD_S,
    is_int_in,
    is_seconds,
    policy_problem,
    tree_problem,
)

STATE_ENV = "DDTREE_OPS_STATE"
SCHEMA_VERSION = 1

_THREAD_LOCK = threading.RLock()


def default_state_path() -> Path:
    """``$DDTREE_OPS_STATE`` if set, else ``~/.cache/ddtree-ops/state.json``."""
    env = os.environ.get(STATE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "ddtree-ops" / "state.json"


@dataclass(frozen=True)
class FallbackKey:
    """What an eager fallback is remembered by: the same config on the same kind of host.

    ``host`` is the machine's inventory name, shared by its GPU slots (a learned load
    time, by contrast, is per slot: :meth:`StateStore.record_load_time` gets the slot's
    name, since slots may differ in GPU count). A record at a tree budget stands for
    every larger budget of the same machine, GPU arch, SGLang, algorithm and top-k
    (:meth:`StateStore.fallback_for`): capture crashes grow with the verify width (B300:
    budget > 8), and a budget below the first failing one keeps its graphs."""

    host: str
    gpu_arch: str
    sglang_version: str
    algorithm: str
    budget: int | None
    topk: int | None

    def as_str(self) -> str:
        return "|".join(
            [self.host, self.gpu_arch, self.sglang_version, self.algorithm, str(self.budget), str(self.topk)]
        )

    def covers(self, other: FallbackKey) -> bool:
        """Whether a fallback recorded at this key applies to a launch at ``other``: the
        same scope, and this budget at or below the other's (budget-less keys: equal)."""
        same = (self.host, self.gpu_arch, self.sglang_version, self.algorithm, self.topk) == (
            other.host, other.gpu_arch, other.sglang_version, other.algorithm, other.topk
        )
        if not same:
            return False
        if self.budget is None or other.budget is None:
            return self.budget == other.budget
        return self.budget <= other.budget

    def likely_covers(self, other: FallbackKey) -> bool:
        """Whether a fallback recorded at this key is a *likely* one for a launch at
        ``other``, at another top-k: everything else as :meth:`covers`. The crash is the
        verify width's (the budget), and the top-k only changes which tree the draft's
        candidates build, so a failure at one top-k is taken for the others rather than
        paid for with a failed launch at each; the record keeps its own top-k, so the
        caller can say it was assumed."""
        return self.topk != other.topk and replace(self, topk=other.topk).covers(other)


@dataclass(frozen=True)
class FallbackRecord:
    key: FallbackKey
    reason: str
    recorded_at: float


@dataclass(frozen=True)
class LoadRecord:
    """How long a host took from launch to ready for one model, last time."""

    host: str
    model: str
    load_s: float
    recorded_at: float
    # The whole restart that ended ready: stopping the old server, the port wait, the load
    # and the smoke. What a sweep's schedule charges per launch; None until one completed.
    restart_s: float | None = None


@dataclass(frozen=True)
class StepRecord:
    """How long a host's sweep rows took per decode step of their workload, recently: the
    measured seconds of a row over its ``ceil(prompts / concurrency)`` waves x
    ``max_new_tokens`` (``bench.plan.cell_steps``), averaged over the last
    :data:`STEP_WINDOW` rows. What the dry run charges per run, like ``restart_s`` per
    launch, instead of a guess (speculation emits several tokens per step). A predicted
    sweep's trace runs are kept apart (``trace``: the key's ``|trace`` suffix): a traced
    request runs one round per token, over the grid's union, several times a run's step.
    Each row is also folded into its concurrency's record (``concurrency``; the key's
    ``|c<N>`` suffix) and its server configuration's there (``server``, ``ServerConfig.key``;
    ``|c<N>|<server>``): a step of a wider batch takes longer (a simulated B300: 16 ms at
    concurrency 2, 61 ms at 16), and so does a bigger tree's (3.5x from budget 6 to 96 at
    16), so one mean over the last rows charged every row of a grid the step of whichever
    rows ran last (a dry run 2.7x the measured grid; after a predicted run, which measures
    the fastest trees, half of it)."""

    host: str
    model: str
    s_per_step: float
    rows: int
    recorded_at: float
    concurrency: int | None = None
    server: str | None = None


# Rows a learned step time averages over (a running mean that forgets older sweeps).
STEP_WINDOW = 20


@dataclass(frozen=True)
class PolicyRecord:
    """A tuned DDTREE policy deployed on a machine (``ddtree-ops tune --deploy``): what every
    later DDTREE restart of the machine's servers launches with, like an eager fallback is
    honoured, until ``restart --no-policy`` or another tune replaces it.

    ``config`` is the file's exact text (its sha256 is ``sha256``): a restart checks the
    host's copy against it and the server's readback against its policy.
    """

    host: str  # the machine's inventory name, shared by its GPU slots
    path: str  # the file on the host
    sha256: str
    config: str
    machine_type: str  # the ledger's machine type it was tuned for
    temperature: float
    budget: int  # the launch state: the smallest batch size's tree
    topk: int
    recorded_at: float

    @property
    def document(self) -> dict[str, Any]:
        """The file's ``ddtree`` object (ConfigError when the record's text is not one)."""
        try:
            data = json.loads(self.config)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"policy record of {self.host}: not valid JSON (line {exc.lineno})") from exc
        tree = data.get("ddtree") if isinstance(data, dict) else None
        if not isinstance(tree, dict):
            raise ConfigError(f"policy record of {self.host}: no 'ddtree' object")
        return tree

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(int(b) for b in self.document.get("budgets") or ())

    @property
    def topk_max(self) -> int:
        return int(self.document.get("topk_max") or self.topk)

    @property
    def policy(self) -> dict[str, dict[str, int]]:
        """Batch size (decimal string) -> ``{"budget", "topk"}``, as the server reads it back."""
        policy = self.document.get("policy")
        return policy if isinstance(policy, dict) else {}


class StateStore:
    """The local JSON state file. Cheap to construct; every call re-reads the file."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_state_path()

    # -- reading -------------------------------------------------------------

    def check(self) -> None:
        """Read and validate the whole file now (ConfigError naming the bad record): for a
        command that reads it later inside a fan-out, where a bad record would fail every
        host one by one after the work began, instead of once before any host is touched."""
        self._load()

    def _load(self) -> dict[str, Any]:
        try:
            text = read_regular_text(self.path)
        except FileNotFoundError:
            return _empty()
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{self.path}: state file is not UTF-8 text (byte {exc.start}); delete it to start afresh"
            ) from None
        except OSError as exc:
            if exc.strerror == NOT_REGULAR:  # a FIFO would block every command that reads it
                raise ConfigError(f"{self.path}: the state file is not a regular file; remove it (or point "
                                  f"${STATE_ENV} at a file)") from None
            raise ConfigError(f"{self.path}: cannot read state file: {exc.strerror or exc}") from exc
        if not text.strip():
            return _empty()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{self.path}: state file is not valid JSON (line {exc.lineno}); delete it to start afresh"
            ) from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{self.path}: state file must hold a JSON object")
        data.setdefault("load_times", {})
        data.setdefault("fallbacks", {})
        data.setdefault("policies", {})
        data.setdefault("step_times", {})
        for key in ("load_times", "fallbacks", "policies", "step_times"):
            if not isinstance(data[key], dict):
                raise ConfigError(f"{self.path}: key '{key}' must be an object")
        _check_records(self.path, data)
        return data

    def learned_load_s(self, host: str, model: str) -> float | None:
        entry = self._load()["load_times"].get(_load_key(host, model))
        value = entry.get("load_s") if isinstance(entry, dict) else None
        return float(value) if is_seconds(value) else None

    def learned_restart_s(self, host: str, model: str) -> float | None:
        entry = self._load()["load_times"].get(_load_key(host, model))
        value = entry.get("restart_s") if isinstance(entry, dict) else None
        return float(value) if is_seconds(value) else None

    def learned_step_s(self, host: str, model: str, *, trace: bool = False,
                       concurrency: int | None = None, server: str | None = None) -> float | None:
        """Seconds per decode step of a sweep row on ``host`` (:class:`StepRecord`; ``trace``:
        of a predicted sweep's trace run; ``concurrency``: of the rows at that concurrency
        alone, and ``server``: of that server configuration's there), or None."""
        entry = self._load()["step_times"].get(_step_key(host, model, trace, concurrency, server))
        value = entry.get("s_per_step") if isinstance(entry, dict) else None
        return float(value) if is_seconds(value) else None

    def learned_steps(self, host: str, model: str) -> dict[tuple[int, str | None], float]:
        """Every step time learned on ``host`` per concurrency, and per (concurrency, server
        configuration): ``{(concurrency, None or ServerConfig.key): seconds}``."""
        prefix = _step_key(host, model, False) + "|c"
        out: dict[tuple[int, str | None], float] = {}
        for key, entry in self._load()["step_times"].items():
            if not (key.startswith(prefix) and _own_fields(entry, StepRecord)):
                continue
            c, server, value = entry["concurrency"], entry.get("server"), entry["s_per_step"]
            if isinstance(c, int) and is_seconds(value) and key == _step_key(host, model, False, c, server):
                out[(c, server)] = float(value)
        return out

    def record_step_time(self, host: str, model: str, s_per_step: float, *, trace: bool = False,
                         concurrency: int | None = None, server: str | None = None) -> None:
        """Fold one measured row (``trace``: one trace run) into the host's running mean, into
        its ``concurrency``'s where given, and into its ``server`` configuration's at that
        concurrency where both are (a time outside (0, a day] is not remembered, as for
        load times)."""
        if not is_seconds(s_per_step):
            return
        keys: list[tuple[int | None, str | None]] = [(None, None)]
        if concurrency is not None:
            keys.append((concurrency, None))
            if server is not None:
                keys.append((concurrency, server))

        def fold(data: dict[str, Any]) -> None:
            for c, srv in keys:
                key = _step_key(host, model, trace, c, srv)
                old = data["step_times"].get(key)
                mean, rows = float(s_per_step), 1
                if isinstance(old, dict) and is_seconds(old.get("s_per_step")) and isinstance(old.get("rows"), int):
                    rows = min(old["rows"] + 1, STEP_WINDOW)
                    mean = old["s_per_step"] + (s_per_step - old["s_per_step"]) / rows
                data["step_times"][key] = asdict(StepRecord(host, model, mean, rows, time.time(), c, srv))

        self._update(fold)

    def fallback_for(self, key: FallbackKey) -> FallbackRecord | None:
        """The record that sends a launch at ``key`` eager: the one at the smallest budget
        that covers it (see :meth:`FallbackKey.covers`), or None."""
        covering = [r for r in self.fallbacks() if r.key.covers(key)]
        return min(covering, key=lambda r: -1 if r.key.budget is None else r.key.budget, default=None)

    def likely_fallback_for(self, key: FallbackKey) -> FallbackRecord | None:
        """The record at another top-k that likely sends a launch at ``key`` eager (see
        :meth:`FallbackKey.likely_covers`): the smallest budget, then the nearest top-k; None
        when none does. Consulted only where :meth:`fallback_for` finds nothing."""
        likely = [r for r in self.fallbacks() if r.key.likely_covers(key)]

        def rank(r: FallbackRecord) -> tuple[int, int]:
            return (-1 if r.key.budget is None else r.key.budget, abs((r.key.topk or 0) - (key.topk or 0)))

        return min(likely, key=rank, default=None)

    def fallbacks(self) -> list[FallbackRecord]:
        out: list[FallbackRecord] = []
        for entry in self._load()["fallbacks"].values():
            if not isinstance(entry, dict) or not isinstance(entry.get("key"), dict):
                continue
            try:
                key = FallbackKey(**entry["key"])
            except TypeError:
                continue
            out.append(
                FallbackRecord(
                    key=key, reason=str(entry.get("reason", "")), recorded_at=float(entry.get("recorded_at", 0))
                )
            )
        return out

    def policy_for(self, host: str) -> PolicyRecord | None:
        """The tuned policy deployed on machine ``host`` (an inventory name), or None."""
        entry = self._load()["policies"].get(host)
        if not isinstance(entry, dict):
            return None
        try:
            return PolicyRecord(**entry)
        except TypeError:
            return None  # a record of another toolkit version: not trusted, never half-read

    # -- writing -------------------------------------------------------------

    def record_load_time(self, host: str, model: str, load_s: float, *, restart_s: float | None = None) -> None:
        """Remember a load (and a whole restart) that ended ready. A time outside
        (0, :data:`~ddtree_ops.limits.MAX_LOAD_S`] is not one anybody measured (a clock that
        jumped): it is not remembered, the last good one stays, rather than a value every
        later read refuses."""
        if not is_seconds(load_s) or (restart_s is not None and not is_seconds(restart_s)):
            return
        rec = LoadRecord(host=host, model=model, load_s=float(load_s), recorded_at=time.time(),
                         restart_s=float(restart_s) if restart_s is not None else None)
        self._update(lambda data: data["load_times"].__setitem__(_load_key(host, model), asdict(rec)))

    def record_fallback(self, key: FallbackKey, reason: str) -> None:
        entry = {"key": asdict(key), "reason": reason, "recorded_at": time.time()}
        self._update(lambda data: data["fallbacks"].__setitem__(key.as_str(), entry))

    def clear_fallback(self, key: FallbackKey) -> bool:
        """Forget the fallbacks a CUDA-graph launch at ``key`` just disproved: every record
        that covers it (its budget and the ones below). True if one was there."""
        removed: list[bool] = []

        def drop(data: dict[str, Any]) -> None:
            for name, entry in list(data["fallbacks"].items()):
                try:
                    recorded = FallbackKey(**entry["key"])
                except (TypeError, KeyError):
                    continue
                if recorded.covers(key):
                    del data["fallbacks"][name]
                    removed.append(True)

        self._update(drop)
        return bool(removed)

    def record_policy(self, record: PolicyRecord) -> None:
        self._update(lambda data: data["policies"].__setitem__(record.host, asdict(record)))

    def forget_policy(self, host: str) -> bool:
        """Forget machine ``host``'s tuned policy; True if one was recorded."""
        removed: list[bool] = []

        def drop(data: dict[str, Any]) -> None:
            if data["policies"].pop(host, None) is not None:
                removed.append(True)

        self._update(drop)
        return bool(removed)

    def _update(self, change: Callable[[dict[str, Any]], None]) -> None:
        with self._locked():
            data = self._load()
            change(data)
            data["version"] = SCHEMA_VERSION
            self._write(data)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with _THREAD_LOCK:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                lock_fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
            except OSError as exc:
                raise ConfigError(f"{self.path}: cannot create state directory: {exc.strerror or exc}") from exc
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
                yield
            finally:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                os.close(lock_fd)

    def _write(self, data: dict[str, Any]) -> None:
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        try:
            write_atomic_local(self.path, text.encode())
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot write state file: {exc.strerror or exc}") from exc


_FIX = "remove that record from the state file (or delete the file) and run again"


def _own_fields(record: Any, cls: type) -> bool:
    """Whether ``record`` is a record of this version's ``cls`` (exactly its fields); one
    of another toolkit version is skipped by the readers, never checked or half-read."""
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    return isinstance(record, dict) and required <= set(record) <= names


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) else f"{value!r} is not text"


def _opt_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _time(value: Any) -> str | None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
    return None if ok else f"{value!r} is not a time (seconds since the epoch)"


def _opt_int(low: int, high: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = value is None or is_int_in(value, low, high)
        return None if ok else f"{value!r} is not an integer in {low}..{high} or null"
    return check


def _seconds(value: Any) -> str | None:
    return None if is_seconds(value) else f"{value!r} is not a number of seconds in (0, {MAX_LOAD_S:g}]"


def _opt_seconds(value: Any) -> str | None:
    return None if value is None else _seconds(value)


def _temperature(value: Any) -> str | None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
    return None if ok else f"{value!r} is not a temperature (a number >= 0)"


def _policy_text(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"{value!r} is not the policy file's text"
    try:
        document = json.loads(value)
    except ValueError:
        return "is not the policy file's text (not JSON)"
    problem = policy_problem(document)
    return f"is not a policy the server loads ({problem})" if problem else None


# Each record's fields and the check of its value (None: fine; else why not).
_LOAD_CHECKS: Mapping[str, Callable[[Any], str | None]] = {
    "host": _text, "model": _text, "load_s": _seconds, "recorded_at": _time, "restart_s": _opt_seconds,
}
_STEP_CHECKS: Mapping[str, Callable[[Any], str | None]] = {
    "host": _text, "model": _text, "s_per_step": _seconds, "rows": _opt_int(1, STEP_WINDOW), "recorded_at": _time,
    "concurrency": _opt_int(1, MAX_CONCURRENCY), "server": _opt_text,
}
_KEY_CHECKS: Mapping[str, Callable[[Any], str | None]] = {
    "host": _text, "gpu_arch": _text, "sglang_version": _text, "algorithm": _text,
    "budget": _opt_int(1, MAX_DFLASH_DRAFT_TOKENS), "topk": _opt_int(1, MAX_DDTREE_TOPK),
}
_POLICY_CHECKS: Mapping[str, Callable[[Any], str | None]] = {
    "host": _text, "path": _text, "sha256": _text, "config": _policy_text, "machine_type": _text,
    "temperature": _temperature, "budget": lambda v: tree_problem(v, 1), "topk": lambda v: tree_problem(1, v),
    "recorded_at": _time,
}


def _check_records(path: Path, data: Mapping[str, Any]) -> None:
    """ConfigError naming the file, the record and its key, for the first record of this
    version whose value is garbage (see the module docstring)."""

    def refuse(where: str, problem: str) -> ConfigError:
        return ConfigError(f"{path}: {where}: {problem}; {_FIX}")

    def check(where: str, record: Mapping[str, Any], checks: Mapping[str, Callable[[Any], str | None]]) -> None:
        for name, value in record.items():
            rule = checks.get(name)
            if rule is not None and (problem := rule(value)):
                raise refuse(f"{where}.{name}", problem)

    for name, entry in data["load_times"].items():
        if _own_fields(entry, LoadRecord):
            check(f"load_times[{name!r}]", entry, _LOAD_CHECKS)
    for name, entry in data["step_times"].items():
        if _own_fields(entry, StepRecord):
            check(f"step_times[{name!r}]", entry, _STEP_CHECKS)
    for name, entry in data["fallbacks"].items():
        where = f"fallbacks[{name!r}]"
        if not isinstance(entry, dict) or not _own_fields(entry.get("key"), FallbackKey):
            continue
        check(f"{where}.key", entry["key"], _KEY_CHECKS)
        check(where, entry, {"reason": _text, "recorded_at": _time})
    for name, entry in data["policies"].items():
        if _own_fields(entry, PolicyRecord):
            check(f"policies[{name!r}]", entry, _POLICY_CHECKS)


def _empty() -> dict[str, Any]:
    return {"version": SCHEMA_VERSION, "load_times": {}, "fallbacks": {}, "policies": {}, "step_times": {}}


def _load_key(host: str, model: str) -> str:
    return f"{host}|{model}"


def _step_key(host: str, model: str, trace: bool, concurrency: int | None = None, server: str | None = None) -> str:
    key = _load_key(host, model) + ("|trace" if trace else "")
    if concurrency:
        key += f"|c{concurrency}" + (f"|{server}" if server else "")
    return key
