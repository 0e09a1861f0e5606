"""Start, query and stop the real SGLang 0.5.23 server on CPU (the venv setup_env.py builds).

Importable from the project's own venv: stdlib + httpx only. Typical use::

    with SglangServer(target_dir, log_dir, extra_args=["--speculative-algorithm", "DFLASH",
                      "--speculative-draft-model-path", str(draft_dir)]) as srv:
        outs = srv.generate([[5, 6, 7], [8, 9]], max_new_tokens=24)
        outs[0].output_ids, outs[0].meta_info["spec_verify_ct"]

The server runs in its own session (process group), so :meth:`SglangServer.stop` ends the
launcher and every scheduler/detokenizer process it spawned (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from testports import free_port

from .serverenv import COVERAGE_VARS, coverage_env, server_env
from .setup_env import CACHE, venv_python

READY_LINE = "The server is fired up and ready to roll!"

# What every test server gets (see tests/sglang_real/README.md for why each is there).
BASE_ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--skip-tokenizer-init",
    # The config says float32, but "auto" would downcast float32 checkpoints to float16
    # (model_config.py _get_and_verify_dtype) -- for model weights and the KV cache alike.
    "--dtype", "float32",
    # Without a cap the KV pool is sized from the machine's RAM (tens of seconds to allocate).
    "--max-total-tokens", "8192",
    # An idle scheduler otherwise busy-polls one whole core (measured: ~90% of a core).
    "--sleep-on-idle",
)




class ServerError(RuntimeError):
    """The server did not come up, died, or answered with an error."""


@dataclass
class Output:
    output_ids: list[int]
    meta_info: dict[str, Any]


def is_built() -> bool:
    """Whether setup_env.py has built the venv (its stamp is written last)."""
    return venv_python().exists() and (CACHE / "stamp.json").exists()


class SglangServer:
    """One ``python -m sglang.launch_server`` subprocess; see the module docstring."""

    def __init__(
        self,
        model_path: Path | str,
        log_dir: Path | str,
        *,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
        name: str = "sglang",
        python: Path | str | None = None,
    ) -> None:
        self.model_path = Path(model_path).resolve()
        # Another interpreter than the shared venv's: a prefix (see prefix.py) that a test
        # deployed a bundle into.
        self.python = Path(python) if python is not None else venv_python()
        self.log_dir = Path(log_dir).resolve()
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.port = port or free_port()
        self.name = name
        self.log_path = self.log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._client: httpx.Client | None = None
        self._stopping: tuple[subprocess.Popen, set[str]] | None = None
        self._shm: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--host", "127.0.0.1", "--port", str(self.port),
            *BASE_ARGS, *self.extra_args,
        ]

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "<no log>"

    def start(self, timeout: float = 300.0) -> SglangServer:
        """Launch and wait for the ready line; raise :class:`ServerError` with the log tail."""
        if self.proc is not None:
            raise ServerError(f"{self.name}: already started")
        if not venv_python().exists():
            raise ServerError(f"{venv_python()} missing: run `python3 tests/sglang_real/setup_env.py`")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(server_env())
        # Its own HOME (and so ~/.cache, ~/.triton, ...) in the log dir: the server reads and
        # writes nothing of the caller's; and no hub lookups, the models are local dirs.
        home = self.log_dir / f"{self.name}-home"
        home.mkdir(parents=True, exist_ok=True)
        env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)  # the caller's (e.g. pytest's) paths must not leak in
        for key in COVERAGE_VARS:
            env.pop(key, None)
        if self.python != venv_python():
            # A prefix holds the DDTree bundle: its scheduler is measured.
            env.update(coverage_env())
        # Two cores on the CI machines: one intra-op thread keeps the spawned processes from
        # fighting over them (and makes float reductions independent of thread scheduling).
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.extra_env)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {' '.join(self.command)}\n".encode())
            log.flush()
            offset = log.tell()
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True, cwd=self.log_dir,  # not the caller's cwd: no stray imports
            )
        deadline = t0 + timeout
        while True:
            # Noted while it starts: a server that dies early cannot be asked at stop().
            self._shm |= _shm_files(_session_pids(self.proc.pid))
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            if READY_LINE in text:
                break
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise ServerError(f"{self.name} exited with {rc} before it was ready; log tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"{self.name} not ready after {timeout:.0f}s; log tail:\n{self.log_tail()}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - t0
        with open(self.log_path, "ab") as log:  # a lane's starts, counted and timed from its logs
            log.write(f"=== ready in {self.startup_s:.1f} s\n".encode())
        self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(300.0, connect=10.0))
        return self

    def _check_alive(self) -> None:
        if self.proc is None or self._client is None:
            raise ServerError(f"{self.name}: not started")
        if self.proc.poll() is not None:
            raise ServerError(f"{self.name} died (rc {self.proc.returncode}); log tail:\n{self.log_tail()}")

    def generate(
        self,
        input_ids: list[list[int]],
        *,
        max_new_tokens: int = 24,
        temperature: float = 0.0,
        ignore_eos: bool = True,
        top_logprobs: int = 0,
        **sampling: Any,
    ) -> list[Output]:
        """POST /generate for a batch of token-id prompts; one :class:`Output` per prompt.

        ``top_logprobs=k`` asks for the log-probs of the chosen and the top-k tokens of every
        generated position (``meta_info["output_token_logprobs"]`` / ``["output_top_logprobs"]``).
        """
        params = {"temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos, **sampling}
        return self.generate_each(input_ids, [params] * len(input_ids), top_logprobs=top_logprobs)

    def generate_each(
        self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *, top_logprobs: int = 0
    ) -> list[Output]:
        """One /generate call with its own sampling parameters per prompt (a seed each, say)."""
        self._check_alive()
        if len(sampling_params) != len(input_ids):
            raise ValueError(f"{len(input_ids)} prompts, {len(sampling_params)} sampling parameter sets")
        body: dict[str, Any] = {
            "input_ids": [list(map(int, ids)) for ids in input_ids],
            "sampling_params": [dict(p) for p in sampling_params],
        }
        if top_logprobs:
            body.update(return_logprob=True, top_logprobs_num=int(top_logprobs))
        try:
            resp = self._client.post("/generate", json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"{self.name}: /generate failed: {e!r}; log tail:\n{self.log_tail()}") from e
        if resp.status_code != 200:
            raise ServerError(f"{self.name}: /generate -> {resp.status_code} {resp.text[:2000]}")
        data = resp.json()
        if isinstance(data, dict):
            data = [data]
        return [Output(list(d["output_ids"]), dict(d["meta_info"])) for d in data]

    def server_info(self) -> dict[str, Any]:
        self._check_alive()
        resp = self._client.get("/server_info")
        resp.raise_for_status()
        return resp.json()

    def flush_cache(self) -> None:
        self._check_alive()
        self._client.post("/flush_cache").raise_for_status()

    def stop(self, grace: float = 15.0) -> None:
        """Stop the server: SIGTERM to the launcher, SIGKILL to its whole group after ``grace``.

        The launcher's SIGTERM path shuts uvicorn down and ends its children itself (~6 s);
        SIGTERM to the whole group would instead look like a crashed scheduler to it (SIGQUIT
        handling, a 5 s "let GPU activity settle" sleep, leaked semaphores). The 16 KB
        ``/dev/shm/sglang_loads_*.shm`` file SGLang never unlinks is removed afterwards.
        """
        self.signal_stop()
        self.wait_stopped(grace)

    def signal_stop(self) -> None:
        """First half of :meth:`stop` (lets a pool stop several servers at once)."""
        if self.proc is not None and self._stopping is None:
            _save_coverage(self.proc.pid)
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is None or self._stopping is not None:
            return
        self._stopping = (self.proc, self._shm | _shm_files(_session_pids(self.proc.pid)))
        self._shm = set()
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def wait_stopped(self, grace: float = 15.0) -> None:
        """Second half of :meth:`stop`."""
        if self._stopping is None:
            return
        proc, shm = self._stopping
        sid = proc.pid  # start_new_session: session and group id are the launcher's pid
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap the launcher so that it does not count as alive
            if not _session_pids(sid):
                break
            time.sleep(0.2)
        try:
            os.killpg(sid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        for path in shm:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._stopping = None
        self.proc = None

    def __enter__(self) -> SglangServer:  # noqa: PYI034  (typing.Self needs 3.11)
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _save_coverage(sid: int, timeout: float = 30.0) -> None:
    """Have every measured scheduler of session ``sid`` save its coverage before SGLang
    ends it with SIGKILL (standins/.../coverage_startup.py: SIGUSR2, then it touches
    ``pids/<pid>.saved``)."""
    data_dir = os.environ.get("DDTREE_COVERAGE_DIR")
    if not os.environ.get("DDTREE_COVERAGE_RC") or not data_dir:
        return
    pids_dir = Path(data_dir) / "pids"
    waiting: dict[int, str | None] = {}
    for pid in _session_pids(sid):
        marker = pids_dir / str(pid)
        try:
            if marker.read_text() != _start_time(pid):
                continue  # a reused pid: not the process that announced itself
        except (FileNotFoundError, ProcessLookupError):
            continue
        saved = pids_dir / f"{pid}.saved"
        waiting[pid] = saved.read_text() if saved.exists() else None
        os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for pid, before in list(waiting.items()):
            saved = pids_dir / f"{pid}.saved"
            if (saved.read_text() if saved.exists() else None) != before or not Path(f"/proc/{pid}").exists():
                del waiting[pid]
        time.sleep(0.1)
    if waiting:
        raise ServerError(f"schedulers {sorted(waiting)} did not save their coverage within {timeout:.0f} s")


def _start_time(pid: int) -> str:
    """As coverage_startup.process_start_time (the stand-ins do not import in this venv)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        # after "pid (comm)": state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _shm_files(pids: list[int]) -> set[str]:
    """The ``/dev/shm/sglang_loads_*`` files these processes have mapped or open."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                    if path.startswith("/dev/shm/sglang_loads_"):
                        found.add(path.removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/shm/sglang_loads_"):
                    found.add(target.removesuffix(" (deleted)"))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


class ServerPool:
    """Servers shared by a test session: each configuration starts once, on first use.

    At most ``max_alive`` run at a time (the least recently used one is stopped first; it
    restarts if asked for again), which bounds memory (~3 GB per CPU server: launcher,
    scheduler and detokenizer each import torch) on small CI machines.
    """

    def __init__(self, log_dir: Path | str, max_alive: int = 2) -> None:
        self.log_dir = Path(log_dir).resolve()
        self.max_alive = max_alive
        self._servers: dict[str, SglangServer] = {}
        self._order: list[str] = []

    def get(self, name: str, model_path: Path | str, extra_args: list[str] | tuple[str, ...] = (),
            env: dict[str, str] | None = None, timeout: float = 300.0,
            python: Path | str | None = None) -> SglangServer:
        srv = self._servers.get(name)
        if srv is not None and (list(extra_args) != srv.extra_args or Path(model_path).resolve() != srv.model_path):
            raise ValueError(f"server {name!r} already exists with another configuration")
        if srv is None or srv.proc is None:
            while len([n for n in self._order if self._servers[n].proc is not None]) >= self.max_alive:
                oldest = next(n for n in self._order if self._servers[n].proc is not None)
                self._servers[oldest].stop()
            srv = srv or SglangServer(model_path, self.log_dir, extra_args=extra_args, env=env, name=name,
                                      python=python)
            self._servers[name] = srv
            srv.start(timeout=timeout)
        if name in self._order:
            self._order.remove(name)
        self._order.append(name)
        return srv

    def close(self) -> None:
        for srv in self._servers.values():
            srv.signal_stop()
        for srv in self._servers.values():
            srv.wait_stopped()
