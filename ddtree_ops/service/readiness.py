"""Readiness: probes that never raise, one wait loop that decides, a load-aware deadline.

Why the probe runs on the host (the agent's ``poll``) rather than through an SSH tunnel:
the server usually binds the host's loopback, the identity proof needs the host's
``/proc`` anyway (which process holds the listening socket), and one ``poll`` then costs
one round trip for everything (pid alive, new log lines, health, server_info, socket
owner) with no tunnel lifecycle to manage or leak on Ctrl-C.

A 200 proves readiness only together with identity: ``/server_info.launch_command``
equals what we launched, the listening socket belongs to the session we started (where
``/proc`` can tell), and a numeric ``startup_time`` is not older than our launch. Any
other 200 — the old process draining, a stray server on the port — is "stale".

For DDTREE our own process must also serve the tree we asked for: the flags are
SGLang's generic fields (``--speculative-num-draft-tokens`` = budget + 1,
``--speculative-eagle-topk``), which a host still running an older DDTree bundle
accepts and overrides with its own defaults, so the tree ``/server_info`` resolved is
compared with the run's budget and top-k ("misconfigured" when they differ).
"""

from __future__ import annotations

import shlex
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ddtree_ops.service.launch import LaunchSpec

# Clock skew tolerated between our launch record and a numeric startup_time.
_STARTUP_SKEW_S = 5.0


@dataclass(frozen=True)
class DeadlinePolicy:
    """Deadline = max(floor, base x factor); base = learned load time, else expected_load_s.

    The deadline is where a load that still shows progress starts being watched, not where
    it is given up: a server whose log keeps moving (weight shards, the KV pool, graph
    capture batch by batch) is waited for past it, up to ``cap_factor`` x the deadline; one
    whose log has been silent for the stall window (``stall_floor_s``, or ``stall_factor``
    x base when longer: a big model's silent steps are longer too) is given up at once,
    before the deadline too. A model that loads in 6 minutes where 2 were expected is then
    waited for, and a hung one fails in minutes instead of at the deadline.
    """

    factor: float = 2.0
    floor_s: float = 60.0
    stall_floor_s: float = 120.0
    stall_factor: float = 0.5
    cap_factor: float = 4.0

    def _base(self, expected_load_s: float, learned_load_s: float | None) -> tuple[float, str]:
        if learned_load_s is not None and learned_load_s > 0:
            return learned_load_s, "learned"
        return expected_load_s, "inventory"

    def deadline(self, expected_load_s: float, learned_load_s: float | None) -> tuple[float, str]:
        """(seconds, source) where source is 'learned' or 'inventory'."""
        window = self.window(expected_load_s, learned_load_s)
        return window.deadline_s, window.source

    def window(self, expected_load_s: float, learned_load_s: float | None) -> LoadWindow:
        """The whole wait of a launch: deadline, stall window and hard cap."""
        base, source = self._base(expected_load_s, learned_load_s)
        deadline_s = max(self.floor_s, base * self.factor)
        return LoadWindow(deadline_s, source, max(self.stall_floor_s, base * self.stall_factor),
                          deadline_s * self.cap_factor)


@dataclass(frozen=True)
class LoadWindow:
    """How long one launch is waited for. ``stall_s`` None: a fixed deadline (the operator's
    ``--timeout``), never extended and no stall check."""

    deadline_s: float
    source: str
    stall_s: float | None = None
    cap_s: float | None = None

    @classmethod
    def fixed(cls, seconds: float) -> LoadWindow:
        return cls(seconds, "timeout")

    @property
    def longest_s(self) -> float:
        """The longest this wait can last (a lock held through it must outlive it)."""
        return self.cap_s if self.stall_s is not None and self.cap_s is not None else self.deadline_s


@dataclass(frozen=True)
class Verdict:
    """What one poll says: ready, or why not (``stale`` marks a 200 from someone else)."""

    ok: bool
    detail: str
    stale: bool = False
    misconfigured: bool = False  # our process, serving another configuration


def judge(poll: dict[str, Any], spec: LaunchSpec, started_at: float) -> Verdict:
    """Pure decision over one agent poll answer. Never raises on odd input."""
    health = poll.get("health")
    if not poll.get("port_open"):
        return Verdict(False, "port closed")
    if health != 200:
        return Verdict(False, f"/health_generate: {health}")
    info = poll.get("server_info") or {}
    if not isinstance(info, dict) or info.get("status") != 200:
        return Verdict(False, f"/server_info unavailable: {info.get('error') if isinstance(info, dict) else info}")
    if not launch_command_matches(info.get("launch_command"), spec.server_args):
        return Verdict(False, "stale: /server_info launch_command is not what we launched", stale=True)
    if poll.get("listener_ours") is False:
        return Verdict(False, "stale: the listening socket belongs to another process", stale=True)
    startup = info.get("startup_time")
    if isinstance(startup, (int, float)) and not isinstance(startup, bool) and startup < started_at - _STARTUP_SKEW_S:
        return Verdict(False, "stale: startup_time predates our launch", stale=True)
    wrong = tree_mismatch(info, spec)
    if wrong is not None:
        return Verdict(False, wrong, misconfigured=True)
    return Verdict(True, "ready")


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def served_tree(info: Mapping[str, Any]) -> tuple[int | None, int | None] | None:
    """``(budget, topk)`` of the DDTREE tree a ``/server_info`` says it serves, each None
    where it does not say; None when it reports no tree at all.

    Read from the DDTree plugin's ``ddtree`` object; without it from SGLang's generic
    fields (budget = ``speculative_num_draft_tokens`` - 1, top-k =
    ``speculative_eagle_topk``) of a DDTREE server, except that the DDTree bundles from
    before the plugin report their own ``speculative_ddtree_budget`` /
    ``speculative_ddtree_topk``: they overwrite the generic fields from those (top-k 1,
    window budget + 1) whatever the flags said, so for them those two are the truth.
    """
    tree = info.get("ddtree")
    if isinstance(tree, Mapping):
        return _int_or_none(tree.get("budget")), _int_or_none(tree.get("topk"))
    if info.get("speculative_algorithm") != "DDTREE":
        return None
    legacy = _int_or_none(info.get("speculative_ddtree_budget")), _int_or_none(info.get("speculative_ddtree_topk"))
    if legacy != (None, None):
        return legacy
    num_draft = _int_or_none(info.get("speculative_num_draft_tokens"))
    return (num_draft - 1 if num_draft is not None else None), _int_or_none(info.get("speculative_eagle_topk"))


def served_cuda_graph(info: Mapping[str, Any]) -> bool | None:
    """Whether the server answering ``info`` decodes with CUDA graphs, as it resolved it;
    None where it does not say.

    What was launched is only a request: SGLang turns graphs off by itself where the
    device has none (CPU) or the configuration forbids them. The DDTree plugin says
    whether its verify step replays a captured graph; SGLang >= 0.5.23 reports the
    resolved ``cuda_graph_config.decode.backend`` (its ``cuda_graph_backend_decode`` is
    the raw flag, None unless given, so it is not read).
    """
    tree = info.get("ddtree")
    if isinstance(tree, Mapping) and isinstance(tree.get("verify_cuda_graph_captured"), bool):
        return tree["verify_cuda_graph_captured"]
    config = info.get("cuda_graph_config")
    decode = config.get("decode") if isinstance(config, Mapping) else None
    backend = decode.get("backend") if isinstance(decode, Mapping) else None
    if isinstance(backend, str) and backend:
        return backend != "disabled"
    return None


def tree_mismatch(info: Mapping[str, Any], spec: LaunchSpec) -> str | None:
    """Why the DDTREE server answering ``info`` is not serving ``spec``'s tree, or None
    (also None for other algorithms and for a server that does not report its tree)."""
    run = spec.run
    if run.algorithm != "DDTREE":
        return None
    served = served_tree(info)
    if served is None:
        return None
    wanted = (run.budget, run.topk)
    if all(got is None or got == want for got, want in zip(served, wanted, strict=True)):
        return None
    shown = " ".join(
        f"{name}={'?' if got is None else got}" for name, got in zip(("budget", "topk"), served, strict=True)
    )
    return (
        f"the server resolved DDTREE {shown}, not the budget={run.budget} topk={run.topk} we launched "
        "(an older DDTree bundle on the host? `ddtree-ops status`, then `ddtree-ops deploy`)"
    )


def policy_mismatch(info: Mapping[str, Any], policy: Mapping[str, Mapping[str, int]]) -> str | None:
    """Why the server answering ``info`` (``/server_info``) does not follow the per-batch-size
    ``policy`` it was launched with, or None when it does.

    The DDTree plugin reports its live state in ``internal_states[0].ddtree`` (the server
    contract of runtime states): ``mode`` must be ``"policy"`` (not ``"pinned"`` at the
    launch state, nor ``"fixed"``: a bundle that ignored the file) and ``policy`` the file's
    own, batch size for batch size.
    """
    states = info.get("internal_states")
    first = states[0] if isinstance(states, list) and states else None
    live = first.get("ddtree") if isinstance(first, Mapping) else None
    if not isinstance(live, Mapping):
        return "/server_info has no internal_states[0].ddtree (a DDTree bundle without runtime states?)"
    if live.get("mode") != "policy":
        return f"internal_states[0].ddtree.mode is {live.get('mode')!r}, not 'policy'"
    served = live.get("policy")
    wanted = {str(bs): {"budget": e["budget"], "topk": e["topk"]} for bs, e in policy.items()}
    if not isinstance(served, Mapping) or {str(k): v for k, v in served.items()} != wanted:
        return f"internal_states[0].ddtree.policy is {served!r}, not the file's {wanted!r}"
    return None


def launch_command_matches(reported: object, server_args: tuple[str, ...]) -> bool:
    """Does ``/server_info.launch_command`` describe the flags we launched?

    SGLang 0.5.23 reports ``" ".join(sys.argv[1:])`` of ``launch_server``; a wrapper may
    report the whole command line shell-quoted. Both are accepted when they end with
    exactly our flags; a different flag anywhere is a mismatch.
    """
    if not isinstance(reported, str):
        return False
    plain, quoted = " ".join(server_args), shlex.join(server_args)
    return reported in (plain, quoted) or reported.endswith((" " + plain, " " + quoted))


class WaitReason(StrEnum):
    """What one poll of a wait decided (``step``'s answer), and how the wait ended
    (``WaitOutcome.reason``).

    Decided by a step: READY (what the wait waits for holds: our server provably serves,
    or the port is free), CAPTURE_FAILED (CUDA-graph capture failed), PORT_IN_USE (SGLang
    reports its port taken), DIED (the process exited), MISCONFIGURED (our process serves
    another configuration), UNREACHABLE (a failed probe; it ends the wait only after
    ``failure_threshold`` in a row). Decided by the loop: CANCELLED (``cancel`` was set),
    TIMEOUT (the deadline passed, and the load no longer progressed or reached its cap),
    STALLED (the log was silent for the stall window).
    """

    READY = "ready"
    CAPTURE_FAILED = "capture_failed"
    PORT_IN_USE = "port_in_use"
    DIED = "died"
    MISCONFIGURED = "misconfigured"
    UNREACHABLE = "unreachable"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    STALLED = "stalled"

    @classmethod
    def failed_reasons(cls) -> frozenset[WaitReason]:
        """The ends that are failures: all but READY and an operator's CANCELLED."""
        return frozenset(cls) - {cls.READY, cls.CANCELLED}

    @property
    def failed(self) -> bool:
        return self in self.failed_reasons()


@dataclass(frozen=True)
class WaitOutcome:
    """How a wait ended (one of :class:`WaitReason`), when, and the last poll's detail."""

    reason: WaitReason
    elapsed_s: float
    detail: str
    polls: int


def wait_loop(
    step: Callable[[float], tuple[WaitReason | None, str]],
    *,
    deadline_s: float,
    interval_s: float = 0.5,
    initial_delay_s: float = 0.0,
    failure_threshold: int = 5,
    cancel: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    progressed_at: Callable[[], float] | None = None,
    stall_s: float | None = None,
    cap_s: float | None = None,
) -> WaitOutcome:
    """The one loop. ``step(elapsed)`` returns (decision, detail): decision None = keep
    waiting, UNREACHABLE = a failed probe (counted against ``failure_threshold``
    consecutive failures), any other reason ends the wait with it.

    With ``progressed_at`` (the elapsed time of the last sign of progress) and ``stall_s``,
    the wait follows the work: STALLED once nothing has progressed for ``stall_s``, and
    past ``deadline_s`` it goes on while progress is recent, until ``cap_s``."""
    start = clock()
    polls = 0
    failures = 0
    detail = "not polled yet"
    if initial_delay_s > 0 and _sleep(initial_delay_s, cancel):
        return WaitOutcome(WaitReason.CANCELLED, clock() - start, detail, polls)
    while True:
        elapsed = clock() - start
        if cancel is not None and cancel.is_set():
            return WaitOutcome(WaitReason.CANCELLED, elapsed, detail, polls)
        polls += 1
        decision, detail = step(elapsed)
        if decision == WaitReason.UNREACHABLE:
            failures += 1
            if failures >= failure_threshold:
                return WaitOutcome(WaitReason.UNREACHABLE, clock() - start, detail, polls)
        elif decision is not None:
            return WaitOutcome(WaitReason(decision), clock() - start, detail, polls)
        else:
            failures = 0
        now = clock() - start
        if progressed_at is not None and stall_s is not None:
            quiet = now - progressed_at()
            if quiet >= stall_s:
                return WaitOutcome(WaitReason.STALLED, now, f"no progress for {quiet:.0f}s; {detail}", polls)
            following = cap_s is None or now < cap_s
        else:
            following = False
        if now >= deadline_s and not following:
            return WaitOutcome(WaitReason.TIMEOUT, now, detail, polls)
        if _sleep(interval_s, cancel):
            return WaitOutcome(WaitReason.CANCELLED, clock() - start, detail, polls)


def _sleep(seconds: float, cancel: threading.Event | None) -> bool:
    """Sleep; True if cancelled meanwhile."""
    if cancel is None:
        time.sleep(seconds)
        return False
    return cancel.wait(seconds)
