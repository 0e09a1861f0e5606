"""Log line -> phase mapping, on SGLang 0.5.23's exact message texts."""

from __future__ import annotations

from datetime import datetime

from ddtree_ops.service.logphases import (
    LogEvent,
    Phase,
    PhaseTracker,
    classify,
    line_timestamp,
)

STARTUP = [
    "[2026-05-01 12:00:00] server_args=ServerArgs(model_path='x')",
    "[2026-05-01 12:00:01 TP0] Load weight begin. avail mem=78.00 GB",
    "[2026-05-01 12:00:05 TP0] Load weight end. elapsed=4.01 s, type=Qwen3ForCausalLM, avail mem=60.00 GB",
    "[2026-05-01 12:00:06 TP0] Memory pool end. avail mem=10.00 GB",
    "[2026-05-01 12:00:06 TP0] Capture target verify CUDA graph begin. This can take up to several minutes.",
    "[2026-05-01 12:00:09 TP0] Capture target verify CUDA graph end. Time elapsed: 3.0 s.",
    "[2026-05-01 12:00:10] The server is fired up and ready to roll!",
]


def test_each_sglang_line_maps_to_its_phase() -> None:
    assert [classify(line)[0] for line in STARTUP] == [
        None, Phase.LOADING_WEIGHTS, Phase.KV_CACHE, Phase.WARMUP, Phase.CAPTURING, Phase.WARMUP, Phase.READY
    ]
    assert (
        classify("[t TP0] Capture cuda graph failed: CUDA error: an illegal memory access")[1]
        == LogEvent.CAPTURE_FAILED
    )
    assert classify("[t] Scheduler hit an exception: Traceback")[1] == LogEvent.CRASHED
    assert (
        classify("[t] Received sigquit from a child process. It usually means the child failed.")[1] == LogEvent.CRASHED
    )
    assert classify("Port is already in use. dist_init_port=1")[1] == LogEvent.PORT_IN_USE
    assert classify("KV Cache is allocated. #tokens: 1000")[0] == Phase.WARMUP


def test_tracker_durations_add_up_and_record_ready_timestamp() -> None:
    tracker = PhaseTracker("h")
    changes = []
    for i, line in enumerate(STARTUP):
        changes += tracker.feed([line], float(i))
    assert [c.phase for c in changes] == [
        Phase.LOADING_WEIGHTS, Phase.KV_CACHE, Phase.WARMUP, Phase.CAPTURING, Phase.WARMUP, Phase.READY
    ]
    durations = tracker.finish(99.0)
    assert durations["starting"] == 1.0
    assert durations[Phase.LOADING_WEIGHTS] == 1.0
    assert durations[Phase.CAPTURING] == 1.0
    assert durations[Phase.WARMUP] == 2.0  # before and after capture
    assert sum(durations.values()) == 6.0  # launch (0) to the ready line (6)
    assert tracker.ready_line_ts == datetime(2026, 5, 1, 12, 0, 10).timestamp()


def test_line_timestamp_variants() -> None:
    assert line_timestamp("no prefix") is None
    assert line_timestamp("[2026-05-01 12:00:00.250 TP3] x") == datetime(2026, 5, 1, 12, 0, 0, 250000).timestamp()
