"""SGLang startup log line -> phase. Pure: a tracker fed with lines and clock readings.

The patterns are SGLang 0.5.23's own messages (``model_runner.py`` "Load weight
begin./end.", ``kv_cache_configurator.py`` "Memory pool end.", ``cuda_graph_setup.py``
"Capture <name> CUDA graph begin./end.", ``decode_cuda_graph_runner.py`` "Capture cuda
graph failed:", ``scheduler.py`` "Scheduler hit an exception:", ``engine.py`` "Received
sigquit from a child process.", ``http_server.py`` "The server is fired up and ready to
roll!"). Matching is by substring so that the ``[time TP0]`` prefixes SGLang adds per
rank do not matter.

Phases are "where the server is now"; a phase may recur (target then draft weights)
and its durations add up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

STARTING = "starting"
LOADING_WEIGHTS = "loading_weights"
KV_CACHE = "allocating_kv_cache"
CAPTURING = "capturing_cuda_graphs"
WARMUP = "warmup"
READY = "ready"
PHASES: tuple[str, ...] = (STARTING, LOADING_WEIGHTS, KV_CACHE, CAPTURING, WARMUP, READY)

# Events that are not phases but decide what the wait loop does.
CAPTURE_FAILED = "capture_failed"
CRASHED = "crashed"
PORT_IN_USE = "port_in_use"

_PHASE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Load weight begin\."), LOADING_WEIGHTS),
    (re.compile(r"Load weight end\."), KV_CACHE),
    (re.compile(r"KV Cache is allocated\.|Memory pool end\."), WARMUP),
    (re.compile(r"Capture .*CUDA graph begin\."), CAPTURING),
    (re.compile(r"Capture .*CUDA graph end\."), WARMUP),
    (re.compile(r"The server is fired up and ready to roll!"), READY),
)
_EVENT_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Capture cuda graph failed", re.IGNORECASE), CAPTURE_FAILED),
    (re.compile(r"Scheduler hit an exception:|Received sigquit from a child process"), CRASHED),
    (re.compile(r"Port is already in use"), PORT_IN_USE),
)
# SGLang's logging format: "[2026-05-01 12:00:00] ..." or "[2026-05-01 12:00:00 TP0] ...";
# fractional seconds accepted where a launcher configures them.
_TIMESTAMP = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:[.,]\d+)?)")


def classify(line: str) -> tuple[str | None, str | None]:
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
    phase: str
    elapsed_s: float
    line: str = ""
    attempt: int = 1
    note: str = ""


@dataclass
class PhaseTracker:
    """Follows one launch's log. Feed it lines as they arrive with the elapsed time."""

    host: str
    attempt: int = 1
    phase: str = STARTING
    entered_at: float = 0.0
    durations: dict[str, float] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)
    ready_line_ts: float | None = None

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
                if phase == READY:
                    self.ready_line_ts = line_timestamp(line)
                changes.append(PhaseEvent(self.host, phase, elapsed_s, line, self.attempt))
        return changes

    def _close(self, now: float) -> None:
        spent = max(0.0, now - self.entered_at)
        self.durations[self.phase] = self.durations.get(self.phase, 0.0) + spent

    def finish(self, elapsed_s: float) -> dict[str, float]:
        """Durations per phase up to ``elapsed_s`` (the current phase counted so far)."""
        out = dict(self.durations)
        if self.phase != READY:
            out[self.phase] = out.get(self.phase, 0.0) + max(0.0, elapsed_s - self.entered_at)
        return out

    def has(self, event: str) -> bool:
        return any(e == event for e, _ in self.events)

    def first_line(self, event: str) -> str | None:
        return next((line for e, line in self.events if e == event), None)
