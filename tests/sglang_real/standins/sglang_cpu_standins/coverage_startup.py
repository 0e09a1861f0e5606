"""Start coverage.py where the DDTree bundle under test runs (TEST-ONLY).

Nothing happens unless ``DDTREE_COVERAGE_RC`` names a coverage configuration (the
real-server lane of ``make test`` sets it for the servers of a prefix and for the
one-interpreter checks; see ``tests/sglang_real/bundle_coverage.py``). Not coverage.py's
own ``COVERAGE_PROCESS_START``: coverage installs a ``.pth`` of its own that starts it in
every process that variable reaches, start-up and all. Then:

* an interpreter with ``DDTREE_COVERAGE_NOW=1`` (the checks that resolve server arguments
  or call the bundle in one process) starts coverage at once: ``setup_env.py`` puts
  ``sglang_cpu_coverage.pth`` into the test venv, which imports this module in every
  interpreter of the venv and of the prefixes;
* a server starts it in its scheduler when the DDTREE worker is created (:func:`around`, a
  hook on ``DDTreeSpecAlgo.create_worker`` -- ``CustomSpecAlgo``'s, srt/speculative/
  spec_registry.py -- that the stand-in plugin registers): from there on the scheduler
  runs the bundle. Tracing a process's imports costs ~45 % of them (measured:
  importing SGLang's scheduler, models and DFlash worker took 14.5-15.7 s, 21.3-22.3 s
  traced), so the launcher, the detokenizer and the scheduler's start-up up to the worker
  run untraced; what they execute of the bundle -- argument resolution, plugin loading,
  the modules' top-level code -- the one-interpreter checks execute and measure.

Saving. A one-interpreter check saves at exit. A server's scheduler cannot: SGLang ends
it with SIGKILL (``kill_process_tree``, srt/utils/common.py), which no exit hook
survives. So the scheduler saves on ``SIGUSR2`` (free in SGLang 0.5.23), in its main
thread, and ``tests/sglang_real/server.py`` sends it before stopping a server: the
scheduler announces itself in ``DDTREE_COVERAGE_DIR/pids/<pid>`` (with its start time,
so that a reused pid is never signalled) and touches ``<pid>.saved`` after each save. Not
a timer thread: ``Collector.flush_data`` copies the tracers' sets and clears them after
writing, so lines recorded by another thread in between are lost (measured: whole
functions run once went missing).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

SAVE_SIGNAL = signal.SIGUSR2
_started = False


def process_start_time(pid: int) -> str:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot): with the pid, names one
    process for the life of the machine."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[19]


def start(*, save_on_signal: bool = False) -> None:
    global _started
    rc = os.environ.get("DDTREE_COVERAGE_RC")
    if _started or not rc:
        return
    _started = True
    import atexit

    import coverage

    cov = coverage.Coverage(config_file=rc, data_suffix=True)
    cov.start()

    def _at_exit() -> None:
        cov.stop()
        cov.save()

    atexit.register(_at_exit)
    if not save_on_signal:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("coverage_startup: a server's coverage must start in its main thread (signal handler)")
    pids = Path(os.environ["DDTREE_COVERAGE_DIR"]) / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    me = os.getpid()

    saves = [0]

    def _save(signum, frame) -> None:
        # In the main thread, between two bytecodes of the scheduler: no tracer adds
        # to the sets while flush_data copies and clears them.
        cov.save()
        saves[0] += 1
        (pids / f"{me}.saved").write_text(str(saves[0]))

    signal.signal(SAVE_SIGNAL, _save)
    (pids / f"{me}").write_text(process_start_time(me))


def around(original, *args, **kwargs):
    """AROUND ``DDTreeSpecAlgo.create_worker``: measure this process from here on."""
    start(save_on_signal=True)
    return original(*args, **kwargs)


if os.environ.get("DDTREE_COVERAGE_NOW") == "1":
    start()
