"""Real simulator processes on free loopback ports (``python -m ddtree_ops.sim``), run by
an interpreter whose SGLang has the DDTree bundle deployed (``minisglang.deployed_python``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from minisglang import deployed_python
from testports import free_port

# Fast but not instant: a 1 s simulated step takes 20 ms of real time.
FAST_ENV = {"SIM_LOAD_S": "2", "SIM_TIME_SCALE": "0.02", "SIM_WARMUP_S": "1", "SIM_SEED": "7"}


class SimProcess:
    """One simulator subprocess with its log file; always killed at the end."""

    def __init__(
        self, tmp: Path, flags: Sequence[str], env: dict[str, str], port: int | None = None, python: str | None = None
    ) -> None:
        self.port = port or free_port()
        self.log_path = tmp / f"sim-{self.port}.log"
        full_env = {**os.environ, **FAST_ENV, **env}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [python or deployed_python(), "-m", "ddtree_ops.sim", "--model-path", "sim-model",
             "--port", str(self.port), *flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> int | None:
        """Status of /health, or None while the port is closed."""
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"simulator exited {self.proc.returncode}:\n{self.log()}")
            if self.health() == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"simulator not ready in {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def sim_factory(tmp_path: Path) -> Iterator[object]:
    procs: list[SimProcess] = []

    def start(
        *flags: str, env: dict[str, str] | None = None, port: int | None = None, python: str | None = None
    ) -> SimProcess:
        p = SimProcess(tmp_path, flags, env or {}, port, python)
        procs.append(p)
        return p

    try:
        yield start
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def ddtree_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    """One warm DDTREE server shared by the HTTP API tests of a module."""
    p = SimProcess(
        tmp_path_factory.mktemp("sim"),
        ["--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "17", "--speculative-eagle-topk", "4"],
        {"SIM_GPU": "h200", "SIM_LOAD_S": "0.5"},
    )
    try:
        p.wait_ready()
        yield p
    finally:
        p.stop()
