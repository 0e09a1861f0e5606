"""SGLang-shaped log output for the simulated server.

Readiness and failure detection in the toolkit read these lines, so the wording and
the prefix follow SGLang 0.5.23 (``sglang/srt/utils/common.py::configure_logger``):
``[%(asctime)s{prefix}] %(message)s`` with ``%Y-%m-%d %H:%M:%S``, on stderr. Scheduler
lines carry `` TP<rank>`` when tp_size > 1, one line per rank, as real multi-GPU logs do.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

_FORMAT_DATE = "%Y-%m-%d %H:%M:%S"


def configure_logging(level: str = "info") -> None:
    """Route the ``sglang.sim`` loggers to stderr in SGLang's format."""
    root = logging.getLogger("sglang.sim")
    root.handlers.clear()
    root.propagate = False
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PrefixFormatter())
    root.addHandler(handler)


class _PrefixFormatter(logging.Formatter):
    """Adds the rank prefix a record carries in ``extra={"prefix": " TP0"}``."""

    def __init__(self) -> None:
        super().__init__(datefmt=_FORMAT_DATE)

    def format(self, record: logging.LogRecord) -> str:
        prefix = getattr(record, "prefix", "")
        stamp = self.formatTime(record, _FORMAT_DATE)
        text = f"[{stamp}{prefix}] {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


main_logger = logging.getLogger("sglang.sim.main")
scheduler_logger = logging.getLogger("sglang.sim.scheduler")


def log_ranks(tp_size: int, level: int, message: str) -> None:
    """Log ``message`` once per TP rank, as every scheduler process does."""
    if tp_size <= 1:
        scheduler_logger.log(level, message, extra={"prefix": ""})
        return
    for rank in range(tp_size):
        scheduler_logger.log(level, message, extra={"prefix": f" TP{rank}"})


def die_like_sglang(message_lines: list[str]) -> None:
    """Scheduler exception path: log, SIGQUIT the parent, which kills its process tree.

    SGLang's launcher answers the SIGQUIT with ``kill_process_tree(os.getpid())``, which
    SIGKILLs itself too, so the exit status is -9 (137 in a shell).
    """
    for line in message_lines:
        main_logger.error(line, extra={"prefix": ""})
    main_logger.error("Received sigquit from a child process. It usually means the child failed.", extra={"prefix": ""})
    sys.stderr.flush()
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def scheduler_crash(tp_size: int, trace: str) -> None:
    """Every scheduler rank logs the exception, then the process tree dies."""
    for rank in range(max(1, tp_size)):
        prefix = f" TP{rank}" if tp_size > 1 else ""
        scheduler_logger.error(f"Scheduler hit an exception: {trace}", extra={"prefix": prefix})
    die_like_sglang([])
