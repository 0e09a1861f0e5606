"""SGLang startup log line -> phase. Pure: a tracker fed with lines and clock readings.

The patterns are SGLang 0.5.23's own messages (``model_runner.py`` "Load weight
begin./end.", ``kv_cache_configurator.py`` "Memory pool end.", ``cuda_graph_setup.py``
"Capture <name> CUDA graph begin./end.", ``decode_cuda_graph_runner.py`` "Capture cuda
graph failed:", ``scheduler.py`` "Scheduler hit an exception:", ``engine.py`` "Received
sigquit from a child process.", ``http_server.py`` "The server is fired up and ready to
roll!"; the DDTree bundle logs its runtime states' captures in SGLang's words, "Capture
DDTREE budget 16 target verify CUDA graph begin./end."). Matching is by substring so
that the ``[time TP0]`` prefixes SGLang adds per rank do not matter.

Phases are "where the server is now"; a phase may recur (target then draft weights)
and its durations add up. :class:`Phase` also names the restart's own steps, so that
every ``PhaseEvent`` carries one of its members; how a phase is shown (label, colour)
lives with it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Self


class Phase(StrEnum):
    """Where one host's restart is: ``PhaseEvent.phase``, and the keys of
    ``RestartResult.phase_durations`` (the ledger's ``readiness_s``).

    The values are what ``--json``, the ledger and error messages say. The restart's own
    steps: LOCK_TAKEN_OVER (a dead holder's restart lock was taken over), STOPPING (the
    old server), WAITING_FOR_PORT (held by a process we did not launch), STARTING (the
    launch), SMOKE (the server answers; a few real decodes prove it, ``smoke.py``),
    FALLBACK_EAGER (capture or the first decode failed, relaunching without CUDA graphs). Read from
    SGLang's log (with STARTING, :data:`STARTUP_PHASES`): LOADING_WEIGHTS, KV_CACHE,
    CAPTURING, WARMUP, READY.
    """

    label: str  # what a person reads on the live board
    style: str  # rich style of that label

    def __new__(cls, value: str, label: str, style: str) -> Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member.label = label
        member.style = style
        return member

    LOCK_TAKEN_OVER = "lock_taken_over", "lock taken over", "yellow"
    STOPPING = "stopping", "stopping", "dim"
    WAITING_FOR_PORT = "waiting_for_port", "waiting for port", "yellow"
    STARTING = "starting", "starting", "cyan"
    LOADING_WEIGHTS = "loading_weights", "loading weights", "cyan"
    KV_CACHE = "allocating_kv_cache", "allocating KV cache", "cyan"
    CAPTURING = "capturing_cuda_graphs", "capturing CUDA graphs", "cyan"
    WARMUP = "warmup", "warming up", "cyan"
    SMOKE = "smoke", "speculative smoke", "cyan"
    FALLBACK_EAGER = "fallback_eager", "eager fallback", "bold yellow"
    READY = "ready", "ready", "bold green"

    @property
    def markup(self) -> str:
        """The label in rich markup."""
        return f"[{self.style}]{self.label}[/]"


STARTUP_PHASES: tuple[Phase, ...] = (
    Phase.STARTING, Phase.LOADING_WEIGHTS, Phase.KV_CACHE, Phase.CAPTURING, Phase.WARMUP, Phase.READY
)


class LogEvent(StrEnum):
    """Log lines that are not phases but decide what the readiness wait does.

    All three end a launch: CAPTURE_FAILED (eager fallback), CRASHED (a child failed; the
    parent is seen gone at the next poll), PORT_IN_USE (SGLang's own port check failed).
    """

    CAPTURE_FAILED = "capture_failed"
    CRASHED = "crashed"
    PORT_IN_USE = "port_in_use"


_PHASE_PATTERNS: tuple[tuple[re.Pattern[str], Phase], ...] = (
    (re.compile(r"Load weight begin\."), Phase.LOADING_WEIGHTS),
    (re.compile(r"Load weight end\."), Phase.KV_CACHE),
    (re.compile(r"KV Cache is allocated\.|Memory pool end\."), Phase.WARMUP),
    (re.compile(r"Capture .*CUDA graph begin\."), Phase.CAPTURING),
    (re.compile(r"Capture .*CUDA graph end\."), Phase.WARMUP),
    (re.compile(r"The server is fired up and ready to roll!"), Phase.READY),
)
_EVENT_PATTERNS: tuple[tuple[re.Pattern[str], LogEvent], ...] = (
    (re.compile(r"Capture cuda graph failed", re.IGNORECASE), LogEvent.CAPTURE_FAILED),
    (re.compile(r"Scheduler hit an exception:|Received sigquit from a child process"), LogEvent.CRASHED),
    (re.compile(r"Port is already in use"), LogEvent.PORT_IN_USE),
)
# SGLang's logging format: "[2026-05-01 12:00:00] ..." or "[2026-05-01 12:00:00 TP0] ...";
# fractional seconds accepted where a launcher configures them.
_TIMESTAMP = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:[.,]\d+)?)")


def classify(line: str) -> tuple[Phase | None, LogEvent | None]:
    """(phase, event) a single log line announces; either may be None."""
    phase = next((p for rx, p in _PHASE_PATTERNS if rx.search(line)), None)
    event = next((e for rx, e in _EVENT_PATTERNS if rx.search(line)), None)
    return phase, event


def line_timestamp(line: str) -> float | None:
    """Epoch seconds of a line's ``[YYYY-MM-DD HH:MM:SS(.fff)]`` prefix (local time), if any."""
    match = _TIMESTAMP.match(line)
    if not match:
        return None
    text = match.group(1).replace(",", ".")
    fmt = "%Y-%m-%d %H:%M:%S.%f" if "." in text else "%Y-%m-%d %H:%M:%S"
    try:
        return datetime.strptime(text, fmt).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class PhaseEvent:
    """Reported through ``on_phase``: host entered ``phase`` at ``elapsed_s`` since launch."""

    host: str
    phase: Phase
    elapsed_s: float
    line: str = ""
    attempt: int = 1
    note: str = ""


@dataclass
class PhaseTracker:
    """Follows one launch's log. Feed it lines as they arrive with the elapsed time."""

    host: str
    attempt: int = 1
    phase: Phase = Phase.STARTING
    entered_at: float = 0.0
    durations: dict[Phase, float] = field(default_factory=dict)
    events: list[tuple[LogEvent, str]] = field(default_factory=list)
    ready_line_ts: float | None = None
    # The line that entered the current phase: for CAPTURING, which graph was being captured
    # (SGLang's "Capture <name> CUDA graph begin.", the DDTree bundle's "Capture DDTREE budget
    # 16 target verify CUDA graph begin."), so a death there is blamed on it.
    phase_line: str = ""

    def feed(self, lines: Iterable[str], elapsed_s: float) -> list[PhaseEvent]:
        """Advance over ``lines`` (all observed at ``elapsed_s``); return phase changes."""
        changes: list[PhaseEvent] = []
        for raw in lines:
            line = raw.rstrip("\n")
            phase, event = classify(line)
            if event is not None:
                self.events.append((event, line))
            if phase is not None and phase != self.phase:
                self._close(elapsed_s)
                self.phase = phase
                self.entered_at = elapsed_s
                self.phase_line = line
                if phase is Phase.READY:
                    self.ready_line_ts = line_timestamp(line)
                changes.append(PhaseEvent(self.host, phase, elapsed_s, line, self.attempt))
        return changes

    def _close(self, now: float) -> None:
        spent = max(0.0, now - self.entered_at)
        self.durations[self.phase] = self.durations.get(self.phase, 0.0) + spent

    def finish(self, elapsed_s: float) -> dict[Phase, float]:
        """Durations per phase up to ``elapsed_s`` (the current phase counted so far)."""
        out = dict(self.durations)
        if self.phase is not Phase.READY:
            out[self.phase] = out.get(self.phase, 0.0) + max(0.0, elapsed_s - self.entered_at)
        return out

    def has(self, event: LogEvent) -> bool:
        return any(e == event for e, _ in self.events)

    def first_line(self, event: LogEvent) -> str | None:
        return next((line for e, line in self.events if e == event), None)
