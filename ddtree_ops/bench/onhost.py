"""Which client measures a host's server, and the controller's half of on-host load generation.

Two clients, one interface (:class:`LoadClient`): ``local`` sends the requests from this
machine (:mod:`.client`, httpx) to the host's address; ``host`` runs
:mod:`._hostclient` on the host itself over its transport, against the server's loopback
address, and reads back one record per request as each finishes. ``host`` is the default
whenever the server binds a loopback address — nothing else could reach it — and
``local`` otherwise; a sweep's ``client:`` key chooses explicitly.

The host client's records are turned into the same :class:`RequestResult` the local
client builds, from the same request bodies (built here, sent as data), so the runner
and the metrics cannot tell the modes apart except by the row's ``client`` field.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from ddtree_ops.bench import client as local_client
from ddtree_ops.bench.client import LoadReport, LoadResult, LoadSpec, load_payload
from ddtree_ops.bench.livetree import SwitchAnswer, refusal_detail, switch_request
from ddtree_ops.bench.metrics import RequestResult
from ddtree_ops.errors import DdtreeOpsError
from ddtree_ops.inventory_types import Host
from ddtree_ops.service.launch import probe_address
from ddtree_ops.transport.base import Transport
from ddtree_ops.transport.hostprogram import run_program
from ddtree_ops.workload.prompt import chat_messages

ClientMode = Literal["local", "host"]
HOSTCLIENT_SOURCE = Path(__file__).with_name("_hostclient.py").read_text()
# Startup of the host's Python and the SSH round trip, on top of the requests' own time.
_COMMAND_SLACK_S = 60.0
# The host program's bound on one /flush_cache (sent as its flush_timeout_s): what a
# command that flushes adds to its own timeout.
_FLUSH_S = 30.0


def is_loopback(bind_host: str) -> bool:
    if bind_host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def client_mode(host: Host, chosen: str | None) -> ClientMode:
    """The sweep's choice, else ``host`` for a loopback-bound server (unreachable from
    here) and ``local`` for one listening on the network."""
    if chosen is not None:
        return "host" if chosen == "host" else "local"
    return "host" if is_loopback(host.ddtree.server.bind_host) else "local"


@dataclass(frozen=True)
class Rendered:
    """What ``/v1/tokenize`` gave for a workload's chat prompts: ids per conversation, or why not."""

    ids: tuple[tuple[int, ...], ...] = ()
    error: str | None = None


class LoadClient(Protocol):
    """What the runner asks of a client; every method reports failure as data."""

    @property
    def mode(self) -> ClientMode: ...

    def flush_cache(self) -> tuple[bool, str]: ...

    def server_info(self) -> dict[str, Any] | None: ...

    def switch_tree(self, budget: int, topk: int) -> SwitchAnswer:
        """Pin a live DDTree server's tree, then read ``/server_info`` back (never raises)."""
        ...

    def set_state(self, server_args: Mapping[str, Any]) -> SwitchAnswer:
        """``/set_internal_state`` with ``server_args`` (e.g. the tree trace's switch), then
        ``/server_info`` read back (never raises)."""
        ...

    def render_chat(self, conversations: Sequence[Sequence[tuple[str, str]]]) -> Rendered:
        """Token ids of each conversation through the served model's chat template."""
        ...

    def run_load(self, spec: LoadSpec, *, flush: bool = False,
                 on_done: Callable[[RequestResult], None] | None = None) -> LoadResult:
        """``spec``'s load; with ``flush``, ``POST /flush_cache`` first, so that one cell's
        prefix cache does not speed up the next: on the host, in the same program run (one
        round trip a measured cell, not two). SGLang refuses a flush while requests run (a
        request of the last cell the client gave up on, or someone else's) and is asked to
        wait up to :data:`_FLUSH_S` for them; a flush still refused sends no request, and
        every request of the result fails saying why (a warm cache, or a load beside
        requests not its own, is not a measurement)."""
        ...


def server_url(host: Host) -> str:
    address = host.address if host.connection == "ssh" and host.address else "127.0.0.1"
    if ":" in address:
        address = f"[{address}]"
    return f"http://{address}:{host.ddtree.server.port}"


@dataclass(frozen=True)
class LocalClient:
    """Requests from this machine to the host's address (the server must listen there)."""

    url: str
    mode: ClientMode = "local"

    def flush_cache(self) -> tuple[bool, str]:
        return local_client.flush_cache(self.url, timeout_s=_FLUSH_S)

    def server_info(self) -> dict[str, Any] | None:
        return local_client.server_info(self.url)

    def switch_tree(self, budget: int, topk: int) -> SwitchAnswer:
        return self.set_state(switch_request(budget, topk)["server_args"])

    def set_state(self, server_args: Mapping[str, Any]) -> SwitchAnswer:
        status, detail = local_client.set_internal_state(self.url, {"server_args": dict(server_args)})
        return SwitchAnswer(status, detail, self.server_info() if status == 200 else None)

    def render_chat(self, conversations: Sequence[Sequence[tuple[str, str]]]) -> Rendered:
        ids, why = local_client.render_chat(self.url, conversations)
        return Rendered(error=why) if ids is None else Rendered(tuple(map(tuple, ids)))

    def run_load(self, spec: LoadSpec, *, flush: bool = False,
                 on_done: Callable[[RequestResult], None] | None = None) -> LoadResult:
        if flush:
            ok, detail = local_client.flush_cache(self.url, timeout_s=_FLUSH_S)
            if not ok:
                return LoadReport(on_done=on_done).result(spec, _not_flushed(detail))
        return local_client.run_load(self.url, spec, on_done=on_done)


@dataclass(frozen=True)
class HostClient:
    """Runs :mod:`._hostclient` on the host, against the server's loopback address."""

    transport: Transport
    host: Host
    mode: ClientMode = "host"

    def _run(self, payload: dict[str, Any], stream: LoadReport, timeout: float) -> str | None:
        """One host client run; None, or why it did not answer completely."""
        server = self.host.ddtree.server
        body = {"address": probe_address(server.bind_host), "port": server.port, **payload}
        try:
            result = run_program(self.transport, self.host.python, HOSTCLIENT_SOURCE, body, timeout=timeout,
                                 on_message=stream.message).result
        except DdtreeOpsError as exc:
            return f"host client on {self.host.name}: {exc}"
        if result.returncode != 0:
            return (
                f"host client ({self.host.python}) on {self.host.name} exited {result.returncode}: "
                f"{result.stderr.strip()[-300:]}"
            )
        return None

    def flush_cache(self) -> tuple[bool, str]:
        stream = LoadReport()
        problem = self._run({"flush": True, "flush_timeout_s": _FLUSH_S}, stream, timeout=_FLUSH_S + _COMMAND_SLACK_S)
        answer = stream.answers.get("flush")
        if answer is None:
            return False, problem or "host client gave no answer"
        return bool(answer.get("ok")), str(answer.get("detail", ""))

    def server_info(self) -> dict[str, Any] | None:
        stream = LoadReport()
        self._run({"server_info": True}, stream, timeout=10.0 + _COMMAND_SLACK_S)
        info = stream.answers.get("server_info", {}).get("info")
        return info if isinstance(info, dict) else None

    def switch_tree(self, budget: int, topk: int) -> SwitchAnswer:
        return self.set_state(switch_request(budget, topk)["server_args"])

    def set_state(self, server_args: Mapping[str, Any]) -> SwitchAnswer:
        # One host-program run: the switch, then /server_info (the program keeps that order).
        stream = LoadReport()
        problem = self._run({"set_state": {"server_args": dict(server_args)}, "server_info": True}, stream,
                            timeout=40.0 + _COMMAND_SLACK_S)
        answer = stream.answers.get("set_state")
        if answer is None:
            return SwitchAnswer(None, problem or "host client gave no answer", None)
        status, body = answer.get("status"), str(answer.get("body", ""))
        if not isinstance(status, int):
            return SwitchAnswer(None, body, None)
        info = stream.answers.get("server_info", {}).get("info")
        detail = "" if status == 200 else refusal_detail(status, body.encode())
        return SwitchAnswer(status, detail, info if isinstance(info, dict) and status == 200 else None)

    def render_chat(self, conversations: Sequence[Sequence[tuple[str, str]]]) -> Rendered:
        stream = LoadReport()
        render = [chat_messages(m) for m in conversations]
        problem = self._run({"render": render}, stream, timeout=30.0 * max(1, len(render)) + _COMMAND_SLACK_S)
        answer = stream.answers.get("rendered")
        if answer is None:
            return Rendered(error=problem or "host client gave no answer")
        ids = answer.get("ids")
        if not isinstance(ids, list) or len(ids) != len(render):
            return Rendered(error=str(answer.get("error") or "the host client's answer holds no ids"))
        return Rendered(tuple(tuple(int(t) for t in one) for one in ids))

    def run_load(self, spec: LoadSpec, *, flush: bool = False,
                 on_done: Callable[[RequestResult], None] | None = None) -> LoadResult:
        stream = LoadReport(on_done=on_done)
        # The host client flushes before it loads (_hostclient.main keeps that order).
        payload: dict[str, object] = {"load": load_payload(spec)}
        if flush:
            payload.update(flush=True, flush_timeout_s=_FLUSH_S)
        timeout = _load_timeout(spec, spec.warmup) + (_FLUSH_S if flush else 0.0)
        problem = self._run(payload, stream, timeout=timeout)
        flushed = stream.answers.get("flush")
        if flush and flushed is not None and not flushed.get("ok"):
            problem = _not_flushed(str(flushed.get("detail", "")))
        return stream.result(spec, problem or "host client ended without reporting this request")


def _not_flushed(detail: str) -> str:
    return f"not measured: the prefix cache was not flushed before the load ({detail})"


def _load_timeout(spec: LoadSpec, warmup: int) -> float:
    """A bound for the whole run, only against a host client that hangs: every request
    already has its own timeout on the host, so this is the worst case of all of them in
    sequence per slot, plus the arrivals' own spread at a request rate."""
    waves = math.ceil(len(spec.prompts) / spec.concurrency) + math.ceil(warmup / spec.concurrency)
    arrivals = len(spec.prompts) / spec.request_rate * 3 if spec.request_rate else 0.0
    return waves * spec.timeout_s + arrivals + _COMMAND_SLACK_S


def make_client(mode: ClientMode, transport: Transport, host: Host) -> LoadClient:
    if mode == "host":
        return HostClient(transport, host)
    return LocalClient(server_url(host))
