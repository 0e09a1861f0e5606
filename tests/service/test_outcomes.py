"""The service's enums (pure): the strings they carry, their rendering, and that
``lifecycle.restart`` handles every way a wait can end."""

from __future__ import annotations

import json
import re
from enum import StrEnum
from pathlib import Path

import pytest
from rich.text import Text
from simhosts import sim_host

from ddtree_ops.errors import (
    Interrupted,
    PortBusy,
    ReadinessTimeout,
    ServerCrashed,
    ServiceError,
)
from ddtree_ops.probe import GpuInfo, HostFacts
from ddtree_ops.service import lifecycle
from ddtree_ops.service.fallback import fallback_key
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.lifecycle import LaunchFacts
from ddtree_ops.service.logphases import STARTUP_PHASES, LogEvent, Phase
from ddtree_ops.service.readiness import WaitOutcome, WaitReason


def test_values_are_the_strings_json_the_ledger_and_messages_carry() -> None:
    assert [p.value for p in Phase] == [
        "lock_taken_over", "stopping", "waiting_for_port", "starting", "loading_weights",
        "allocating_kv_cache", "capturing_cuda_graphs", "warmup", "smoke", "fallback_eager", "ready",
    ]
    assert [e.value for e in LogEvent] == ["capture_failed", "crashed", "port_in_use"]
    assert [r.value for r in WaitReason] == [
        "ready", "capture_failed", "port_in_use", "died", "misconfigured", "unreachable", "cancelled", "timeout",
        "stalled",
    ]
    assert [p.value for p in STARTUP_PHASES] == [
        "starting", "loading_weights", "allocating_kv_cache", "capturing_cuda_graphs", "warmup", "ready",
    ]
    durations = {Phase.LOADING_WEIGHTS: 1.5, Phase.READY: 0.0}
    assert json.dumps(durations) == '{"loading_weights": 1.5, "ready": 0.0}'
    assert f"stuck in phase {Phase.KV_CACHE}" == "stuck in phase allocating_kv_cache"
    assert type(str(Phase.WARMUP)) is str and Phase("warmup") is Phase.WARMUP


@pytest.mark.parametrize("enum", [Phase, LogEvent, WaitReason])
def test_docstrings_name_exactly_the_members(enum: type[StrEnum]) -> None:
    prose = re.sub(r":\w+:`[^`]*`|``[^`]*``", "", enum.__doc__ or "")  # references are not member names
    named = set(re.findall(r"\b[A-Z][A-Z_]{2,}\b", prose)) - {"CUDA"}
    assert named == set(enum.__members__)


def test_every_phase_renders_its_label_in_its_style() -> None:
    for phase in Phase:
        assert phase.label and phase.style
        assert Text.from_markup(phase.markup).plain == phase.label
    assert Phase.LOADING_WEIGHTS.label == "loading weights"


def test_failed_reasons_are_all_but_ready_and_cancelled() -> None:
    assert WaitReason.failed_reasons() == set(WaitReason) - {WaitReason.READY, WaitReason.CANCELLED}
    assert [r for r in WaitReason if not r.failed] == [WaitReason.READY, WaitReason.CANCELLED]


EXPECTED_ERRORS = {
    WaitReason.CAPTURE_FAILED: (ServerCrashed, "always", (
        "CUDA-graph capture failed: boom (CUDA graphs forced on); log tail: a | b"
    )),
    WaitReason.DIED: (ServerCrashed, "never", "server exited during loading_weights after 3.2s; log tail: a | b"),
    WaitReason.MISCONFIGURED: (ServiceError, "always", "the server resolved another tree; stopped it"),
    WaitReason.PORT_IN_USE: (PortBusy, "always", "server reports its port is already in use; log tail: a | b"),
    WaitReason.CANCELLED: (Interrupted, "unless-kept", (
        "wait cancelled during loading_weights after 3.2s; server stopped (pid 42; --keep-on-failure keeps it)"
    )),
    WaitReason.UNREACHABLE: (ServiceError, "never", (
        "lost contact while waiting for readiness (the server resolved another tree); server pid 42 state unknown"
    )),
    WaitReason.TIMEOUT: (ReadinessTimeout, "unless-kept", (
        "not ready after 60s (learned deadline), stuck in phase loading_weights "
        "(the server resolved another tree); server stopped (pid 42; --keep-on-failure keeps it); log tail: a | b"
    )),
    WaitReason.STALLED: (ReadinessTimeout, "unless-kept", (
        "gave up after 3s in phase loading_weights: the server's log stopped moving "
        "(the server resolved another tree); server stopped (pid 42; --keep-on-failure keeps it); log tail: a | b"
    )),
}


def test_restart_handles_every_way_a_wait_ends() -> None:
    # READY returns the result; every other reason has an error (and says whether our
    # process is stopped first). A new WaitReason member fails here until it is handled.
    assert set(lifecycle._FAILURES) == set(WaitReason) - {WaitReason.READY}
    assert set(EXPECTED_ERRORS) == set(lifecycle._FAILURES)
    for reason, (kind, stops, message) in EXPECTED_ERRORS.items():
        ended = lifecycle._Ended(
            host="h", pid=42, phase=Phase.LOADING_WEIGHTS,
            outcome=WaitOutcome(reason, 3.25, "the server resolved another tree", 7),
            tail="a | b", capture_failure="CUDA-graph capture failed: boom", deadline_s=60.0, deadline_source="learned",
        )
        failure = lifecycle._FAILURES[reason]
        error = failure.error(ended)
        assert type(error) is kind and error.host == "h", reason
        assert error.message == message, reason
        assert failure.stop_server == stops, reason
    # Kept on request, the message says so and how to stop it.
    kept = lifecycle._Ended(
        host="h", pid=42, phase=Phase.LOADING_WEIGHTS, outcome=WaitOutcome(WaitReason.TIMEOUT, 3.25, "slow", 7),
        tail="a", capture_failure="", deadline_s=60.0, deadline_source="learned", stopped=False,
    )
    assert "server left running (pid 42, --keep-on-failure) — `ddtree-ops stop h` stops it" in (
        lifecycle._FAILURES[WaitReason.TIMEOUT].error(kept).message
    )


def test_launch_facts_from_the_probe_and_the_fallback_key(tmp_path: Path) -> None:
    gpu = GpuInfo(name="NVIDIA B300", driver_version="580", memory_total="x", compute_cap="10.3")
    unread = GpuInfo(name="?", driver_version="", memory_total="", compute_cap="")
    facts = LaunchFacts.from_probe(HostFacts(host="h", sglang_version="0.5.23", gpus=(unread, gpu)))
    assert facts == LaunchFacts("0.5.23", "sm_103")
    assert LaunchFacts.from_probe(HostFacts(host="h")) == LaunchFacts()

    host = sim_host(tmp_path, gpu="b300")
    run = RunConfig("DDTREE", budget=16, topk=4)
    assert fallback_key(host, run, arch=facts.gpu_arch, sglang_version=facts.sglang_version).gpu_arch == "sm_103"
    # Without a probed arch the inventory's gpu keys the record, and an unknown version says so.
    key = fallback_key(host, run, arch=None, sglang_version=None)
    assert (key.gpu_arch, key.sglang_version) == (host.ddtree.gpu, "unknown")
