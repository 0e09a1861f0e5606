"""``Transport.run(on_line=...)``: stdout lines arrive while the command still runs, on both
transports (the on-host benchmark client streams its per-request records this way)."""

from __future__ import annotations

import time

import pytest

from ddtree_ops.errors import CommandTimeout
from ddtree_ops.transport.base import Script

# Prints a line, then waits until the controller has seen it (a file the callback
# creates), so the test proves the line arrived before the command ended.
_WAIT_FOR_ACK = """
import os, sys, time
sys.stdout.write("first\\n"); sys.stdout.flush()
deadline = time.time() + 10
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.01)
sys.stdout.write("seen=%s\\n" % os.path.exists(sys.argv[1]))
sys.stdout.write("tail without newline")
"""


def test_lines_stream_before_the_command_ends(any_transport) -> None:  # type: ignore[no-untyped-def]
    case = any_transport
    ack = f"{case.scratch}/ack"
    lines: list[str] = []

    def on_line(line: str) -> None:
        lines.append(line)
        if line == "first":
            case.transport.write_atomic(ack, b"")  # a second channel while the first runs

    big = "x" * 300_000  # more than a pipe holds: stdin is written while stdout is read
    script = Script(argv=(case.python, "-c", "import sys; exec(sys.stdin.read().split('\\0')[0])", ack),
                    source=_WAIT_FOR_ACK + "\0", extra_stdin=big)
    result = case.transport.run(script, timeout=30, on_line=on_line)
    assert result.ok, result.stderr
    assert lines == ["first", "seen=True", "tail without newline"]
    assert result.stdout == "first\nseen=True\ntail without newline"


def test_streaming_command_is_ended_at_its_timeout(any_transport) -> None:  # type: ignore[no-untyped-def]
    case = any_transport
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(CommandTimeout) as info:
        case.transport.run([case.python, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                           timeout=1.5, on_line=lines.append)
    assert time.monotonic() - started < 10
    assert lines == ["up"]
    assert "process group" in str(info.value)


def test_a_failing_callback_ends_the_command(any_transport) -> None:  # type: ignore[no-untyped-def]
    case = any_transport

    def on_line(line: str) -> None:
        raise RuntimeError(f"bad line {line}")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="bad line up"):
        case.transport.run([case.python, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                           timeout=30, on_line=on_line)
    assert time.monotonic() - started < 10
