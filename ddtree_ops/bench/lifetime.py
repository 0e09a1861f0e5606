"""A server place's servers over one sweep, owned by a context manager (as vLLM's
``benchmarks/sweep`` owns its server with ``run_server``).

Entering takes the place's sweep lease, before anything else touches the host, so that
no other sweep or restart disturbs its servers until the sweep is done there (a dead
holder's lease is taken over; a live one's raises LeaseHeld at once). :meth:`restart`
launches a server through the one restart policy (``lifecycle.prepare_restart``) with
the smoke at the settings about to be measured; a live DDTree launch first writes its
runtime-state file into the place's run dir (atomically, through the transport). One
``bench`` command holds a place under one lease (:class:`Leases`, shared by its phases like
:class:`Borrowed`): a block another phase follows keeps it, the final block gives it back.

Borrowing a host is a transaction (design.md section 10): before its first launch on a
place the sweep remembers what served there (the launch record or drop-in, running or not:
``lifecycle.remember_server``), once for the whole ``bench`` command (:class:`Borrowed`,
shared by the predict phase and the measuring), and keeps that in its lease record, so that
a sweep taking over a dead holder's lease (a ``kill -9``'d ``bench``) puts back what served
before *that* sweep. The sweep's own launches never replace the host's launch record or our
``/etc`` drop-in (``manager.sweep_launch``). Leaving the last block of a place, however it
ended (done, failed rows, Ctrl-C, a lost host), puts that server back through the rollouts'
own ``lifecycle.restore_server``: relaunched with its recorded argv and proven ready, or,
where none ran, the sweep's server stopped; then the place is observed again, and the
:class:`PutBack` says what it was found doing. ``--leave-stopped`` stops the sweep's server
and relaunches nothing; ``--keep-server`` leaves the sweep's last server running (not after
an interrupt: then the previous one is put back). A block followed by another phase
(``final=False``) only stops what it started, unless it handed it over. The lease is given
back last.

A server can outlive one block for the next (``bench --predict``: the predict phase's
launch serves the measured part, so a host loads the DDTree model once): the first block
:meth:`~SweepServer.hand_over` s it as a :class:`KeptServer`, and the next one
:meth:`~SweepServer.adopt` s it, which takes it on only where it is still the same process
(the command's :class:`Leases` keep the place held between the two blocks; without them,
as a library caller may run the phases, another sweep or a ``restart`` may have replaced it).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from ddtree_ops import lockholder
from ddtree_ops.bench.livetree import states_file
from ddtree_ops.bench.plan import LaunchConfig, Sampling
from ddtree_ops.bench.rows import run_config
from ddtree_ops.bench.services import Services
from ddtree_ops.errors import DdtreeOpsError
from ddtree_ops.inventory_types import Host
from ddtree_ops.transport.base import Transport

if TYPE_CHECKING:
    from ddtree_ops.probe import HostFacts
    from ddtree_ops.service.lifecycle import PreviousServer, RestartResult, ServiceStatus
    from ddtree_ops.service.manager import LeasePass


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep runs: ``resume`` skips runs the ledger has ``ok`` rows for;
    ``fail_fast`` stops every host at the first failed row; ``keep_server`` leaves the
    sweep's last server running instead of putting the previous one back (unless the sweep
    was interrupted); ``leave_stopped`` stops the sweep's servers and puts nothing back;
    ``restart_timeout`` bounds each launch (None: load-aware); ``smoke`` decodes before a
    server is measured (``--no-smoke``: False)."""

    resume: bool = False
    fail_fast: bool = False
    keep_server: bool = False
    restart_timeout: float | None = None
    smoke: bool = True
    leave_stopped: bool = False


@dataclass(frozen=True)
class KeptServer:
    """A server one block left running for the next (see the module docstring): the
    server place it runs on (``Host.name``: the machine, or one of its GPU slots), the
    launch it serves and how that launch went (its rows' launch identity and smoke)."""

    place: str
    launch: LaunchConfig
    restart: RestartResult


def _what(before: PreviousServer) -> str:
    """What a remembered server is: its tree (``DDTREE budget=16 topk=4``), the unit's own
    ExecStart, or "" where nothing was ever launched there."""
    if before.operator:
        return "the unit's own ExecStart"
    return before.run or ("its recorded launch" if before.argv else "")


def describe_before(before: PreviousServer) -> str:
    """``DDTREE budget=16 topk=4, running (pid 812)``; ``..., stopped``; ``no server``."""
    what = _what(before)
    if not before.running:
        return f"{what}, stopped" if what else "no server"
    pid = f" (pid {before.pid})" if before.pid is not None else ""
    return f"{what or 'a server'}, running{pid}"


def note_of(before: PreviousServer) -> dict[str, Any]:
    """``before`` as the lease record keeps it (JSON)."""
    data = asdict(before)
    data["argv"] = list(before.argv)
    return {"before": data}


def before_of(note: object) -> PreviousServer | None:
    """The server a lease record's note remembers; None where there is none or it is not one
    (a note is data from the host: every field is checked)."""
    from ddtree_ops.service.lifecycle import PreviousServer

    data = note.get("before") if isinstance(note, Mapping) else None
    if not isinstance(data, Mapping):
        return None
    argv, pid = data.get("argv") or [], data.get("pid")
    texts = ("launch_command", "run")
    if not (isinstance(data.get("host"), str) and isinstance(argv, list) and all(isinstance(a, str) for a in argv)
            and (pid is None or (isinstance(pid, int) and not isinstance(pid, bool)))
            and all(data.get(k) is None or isinstance(data.get(k), str) for k in texts)):
        return None
    return PreviousServer(
        host=data["host"], running=data.get("running") is True, pid=pid, argv=tuple(argv),
        launch_command=data.get("launch_command"), cuda_graph=data.get("cuda_graph") is not False,
        run=data.get("run"), operator=data.get("operator") is True,
    )


@dataclass
class _Borrow:
    before: PreviousServer
    changed: bool = False  # a sweep launch was made there (by this bench, or a dead one)


class Borrowed:
    """What each server place served before this ``bench`` first changed it, kept for the
    whole command (the predict phase and the measuring share it): the end puts back this,
    not what a phase in between left running. Thread-safe (one worker per place)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._places: dict[str, _Borrow] = {}

    def get(self, place: str) -> _Borrow | None:
        with self._lock:
            return self._places.get(place)

    def remember(self, place: str, before: PreviousServer, *, changed: bool = False) -> None:
        """The first remembered wins: later blocks see the sweep's own servers."""
        with self._lock:
            self._places.setdefault(place, _Borrow(before, changed))

    def change(self, place: str) -> None:
        with self._lock:
            self._places[place].changed = True

    def owes(self, places: Iterable[str]) -> bool:
        """A sweep launch was made on one of ``places``: its put-back is still to come."""
        with self._lock:
            return any(p in self._places and self._places[p].changed for p in places)


class Leases:
    """The sweep leases one ``bench`` command holds, by server place: taken when the first
    block reaches a place (before probing it), kept by a block another phase follows on it
    (``bench --predict``: the predict phase's), given back by the final block's end, or by
    :meth:`release_all` for a place no final block entered (a host with nothing left to
    measure, one lost). So a place is never free between the phases (nor while a host whose
    predict phase ended waits for the others'): a ``restart`` or another sweep there is
    refused from the moment the sweep reaches it to its end. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Host, str]] = {}

    def token(self, place: str) -> str | None:
        with self._lock:
            held = self._held.get(place)
            return held[1] if held is not None else None

    def hold(self, place: Host, token: str) -> None:
        with self._lock:
            self._held[place.name] = (place, token)

    def drop(self, place: str) -> None:
        with self._lock:
            self._held.pop(place, None)

    def release_all(self, services: Services) -> None:
        """Give back every lease still held (best effort: a lease that cannot be released is
        provably dead once this run ended)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for place, token in held:
            try:
                with services.open_transport(place) as transport:
                    services.release_lease(transport, place, token)
            except DdtreeOpsError:
                pass
            finally:
                lockholder.run_ended(token)


PUT_BACK_ACTIONS = ("relaunched", "stopped", "untouched", "kept", "left-stopped", "failed")


@dataclass(frozen=True)
class PutBack:
    """What the end of the sweep did to one server place (``action``, one of
    :data:`PUT_BACK_ACTIONS`), what served there before it (:func:`describe_before`), and
    what the place was observed doing afterwards (``running``/``pid``/``ready``: None where
    it could not be observed). ``failed``: ``detail`` says why, ``error_type`` its class."""

    place: str
    action: str
    before: str
    detail: str = ""
    running: bool | None = None
    pid: int | None = None
    ready: bool | None = None
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.action != "failed"

    def describe(self) -> str:
        seen = ("not observed" if self.running is None else
                f"pid {self.pid}, {'ready' if self.ready else 'NOT ready'}" if self.running else "nothing runs")
        if self.action == "relaunched":
            return f"relaunched what served before: {self.before}; now {seen}"
        if self.action == "stopped":
            return f"sweep's server stopped, as found: {self.before}; now {seen}"
        if self.action == "kept":
            return f"kept the sweep's last server (--keep-server): {seen}; not put back: {self.before}"
        if self.action == "left-stopped":
            return f"left stopped (--leave-stopped): {seen}; not put back: {self.before}"
        if self.action == "untouched":
            return "untouched (the sweep launched nothing here)"
        return f"NOT put back ({self.before}): {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok, "summary": self.describe()}


class SweepServer:
    """The servers of one server place (``host``: a machine, or one of its GPU slots, of
    ``machine``) over a sweep; see the module docstring. ``borrowed``: the command's memory
    of what served before (a fresh one by default); ``final``: leaving puts that back (False:
    another phase follows on this place, which puts back)."""

    def __init__(
        self, services: Services, transport: Transport, host: Host, machine: Host, *, sweep: str, run_id: str,
        options: SweepOptions, cancel: threading.Event, on_takeover: Callable[[str], None],
        borrowed: Borrowed | None = None, final: bool = True, on_put_back: Callable[[str], None] | None = None,
        leases: Leases | None = None,
    ) -> None:
        self.services, self.transport, self.host, self.machine = services, transport, host, machine
        self._sweep, self._run_id, self._options, self._cancel = sweep, run_id, options, cancel
        self._on_takeover = on_takeover
        self._on_put_back = on_put_back or (lambda _m: None)
        self.borrowed = borrowed if borrowed is not None else Borrowed()
        self._final = final
        # The command's leases (shared by its phases): a place's lease is taken once and kept
        # until its final block ends; None: this block's own, given back when it ends.
        self._leases = leases
        self.lease: str | None = None
        self.started = False
        self._handed_over = False
        # What leaving the final block did to the place (None: not left yet, or not final).
        self.put_back: PutBack | None = None

    def lease_pass(self) -> LeasePass:
        from ddtree_ops.service.manager import LeasePass

        return LeasePass(token=self.lease)

    def __enter__(self) -> SweepServer:
        # A phase before this one holds the place already: the same lease, taken again (it
        # proves the lease is still ours; the record is the same but for its time).
        held = self._leases.token(self.host.name) if self._leases is not None else None
        token = held or uuid.uuid4().hex
        holder = lockholder.holder_record(token, "bench") | {"sweep": self._sweep, "run_id": self._run_id}
        if held is None:
            # Marked running first: a lease of this very process is dead only once its run ended.
            lockholder.run_started(token)
        try:
            taken = self.services.take_lease(self.transport, self.host, token=token, holder=holder)
        except BaseException:
            if self._leases is not None:
                self._leases.drop(self.host.name)
            lockholder.run_ended(token)
            raise
        self.lease = token
        if self._leases is not None:
            self._leases.hold(self.host, token)
        place = self.host.name
        if taken is not None:
            from ddtree_ops.service.manager import describe_lease

            # The dead sweep borrowed this place: what served before it is what comes back.
            before = before_of(taken.get("note"))
            if before is not None:
                self.borrowed.remember(place, before, changed=True)
            self._on_takeover(f"took over the lease of dead {describe_lease(taken)}"
                              + (f"; puts back what served before it: {describe_before(before)}" if before else ""))
        borrow = self.borrowed.get(place)
        if borrow is not None:
            self._note(borrow.before)  # a lease of its own now: the memory goes with it
        return self

    def _note(self, before: PreviousServer) -> None:
        """``before`` into the lease record, for a sweep that takes it over should this one
        die. Best effort: without it such a sweep observes instead (this one's put-back at
        its end does not depend on it)."""
        assert self.lease is not None
        try:
            self.services.note_lease(self.transport, self.host, self.lease, note_of(before))
        except DdtreeOpsError:
            pass

    def _borrow(self) -> None:
        """Before a launch changes the place: remember what serves there (once per command),
        then count the place as changed."""
        place = self.host.name
        if self.borrowed.get(place) is None:
            before = self.services.remember(self.transport, self.host)
            self.borrowed.remember(place, before)
            self._note(before)
        self.borrowed.change(place)

    def __exit__(self, *exc: object) -> None:
        try:
            if self._final:
                self.put_back = self._put_back()
            elif self.started and (self._cancel.is_set() or not self._handed_over):
                try:
                    self.services.stop(self.transport, self.host, lease=self.lease_pass())
                except DdtreeOpsError:
                    pass  # the host may be the one that went away; its rows say so
        finally:
            # A lease that cannot be released (host gone) is provably dead once this run ended.
            # Kept where another phase follows on the place (the command's leases).
            keep = not self._final and self._leases is not None
            if self.lease is not None and not keep:
                if self._leases is not None:
                    self._leases.drop(self.host.name)
                try:
                    self.services.release_lease(self.transport, self.host, self.lease)
                except DdtreeOpsError:
                    pass
                finally:
                    lockholder.run_ended(self.lease)

    def _put_back(self) -> PutBack:
        """Leave the place as the sweep found it (see the module docstring), then observe it."""
        place = self.host.name
        borrow = self.borrowed.get(place)
        if borrow is None or not borrow.changed:
            return PutBack(place, "untouched", "")
        before, opts = borrow.before, self._options
        try:
            if opts.keep_server and not self._cancel.is_set() and self.started and self.serving():
                action = "kept"
            elif opts.leave_stopped:
                self._on_put_back("stopping the sweep's server (--leave-stopped)")
                self.services.stop(self.transport, self.host, lease=self.lease_pass())
                action = "left-stopped"
            else:
                self._on_put_back(describe_before(before))
                self.services.put_back(self.transport, self.host, before, lease=self.lease_pass())
                action = "relaunched" if before.running else "stopped"
        except DdtreeOpsError as exc:
            return PutBack(place, "failed", describe_before(before), detail=exc.message,
                           error_type=type(exc).__name__)
        return self._observed(PutBack(place, action, describe_before(before)))

    def _observed(self, done: PutBack) -> PutBack:
        """``done`` with what the place is seen doing now; an observation that contradicts
        it (the relaunched server does not serve, a stopped place runs one) fails it."""
        from ddtree_ops.errors import ServiceError

        try:
            st = self.services.status(self.transport, self.host)
        except DdtreeOpsError:
            return done
        seen = replace(done, running=st.running, pid=st.pid if st.running else None,
                       ready=st.running and st.health == 200)
        serving = done.action in ("relaunched", "kept")
        if serving and not seen.ready:
            why = f"observed afterwards: {'no server runs' if not st.running else f'health {st.health}'}"
        elif not serving and st.running:
            why = f"observed afterwards: a server still runs (pid {st.pid})"
        else:
            return seen
        return replace(seen, action="failed", detail=why, error_type=ServiceError.__name__)

    def restart(self, launch: LaunchConfig, samplings: Iterable[Sampling], facts: HostFacts | None) -> RestartResult:
        """Launch ``launch`` and wait until it serves (lifecycle errors propagate): a sweep's
        launch, recorded apart from the host's own (``manager.sweep_launch``)."""
        from ddtree_ops.service.fallback import fallback_key, plan_runtime_budgets
        from ddtree_ops.service.lifecycle import prepare_restart
        from ddtree_ops.service.manager import sweep_launch
        from ddtree_ops.service.smoke import SmokeSampling, SmokeSpec
        from ddtree_ops.state import StateStore

        self._borrow()

        smoke = SmokeSpec.for_samplings(
            SmokeSampling.of(s.temperature, s.top_p, s.top_k) for s in samplings
        ) if self._options.smoke else None
        request = prepare_restart(
            self.transport, self.host, run_config(launch), machine=self.machine,
            facts=facts, lease=self.lease_pass(), timeout=self._options.restart_timeout, smoke=smoke,
        )
        if launch.live:
            # The budgets recorded to fail capture here serve eager (the states' eager_budgets)
            # and the others keep their graphs; the launch moves off an eager budget.
            run = request.run
            planned = plan_runtime_budgets(
                StateStore(), fallback_key(self.host, run, arch=request.facts.gpu_arch,
                                           sglang_version=request.facts.sglang_version), launch.budgets,
            )
            name, content = states_file(launch, eager_budgets=planned.eager_budgets)
            # Through the agent (stdin), not SFTP: a host's sshd may offer no SFTP subsystem.
            self.services.put_run_file(self.transport, self.host, name, content)
            # Relative on purpose: the server runs in the run dir (the process manager's cwd,
            # a systemd unit's WorkingDirectory), whatever ``~`` or a relative run dir means there.
            request = replace(request, run=replace(run, budget=planned.launch_budget, adaptive_config=name),
                              runtime_note=planned.note)
        with sweep_launch({"sweep": self._sweep, "run_id": self._run_id, "lease": self.lease}):
            result = self.services.restart(self.transport, request, cancel=self._cancel)
        self.started = True
        return result

    def hand_over(self, launch: LaunchConfig, restart: RestartResult) -> KeptServer:
        """Leave the server ``restart`` launched running when the (non-final) block ends,
        for the next phase to :meth:`adopt` (an interrupted sweep still stops it). Called once
        the block's work succeeded: a failed phase stops its server, and the next launches its own."""
        self._handed_over = True
        return KeptServer(self.host.name, launch, restart)

    def adopt(self, kept: KeptServer) -> bool:
        """Take ``kept`` on as this place's server, where it still serves as launched: then
        leaving the block stops it as one this block started (unless the sweep keeps it).
        False where it is another place's, is gone, or is another process now (another
        sweep or a ``restart`` replaced it between the blocks): launch as usual."""
        # The pid, not the argv: a relaunch of the same launch (another run of this sweep,
        # systemd reviving its unit) has the same argv, but is another process whose rows
        # must not carry this launch's identity and smoke.
        answering = self._answering() if kept.place == self.host.name else None
        if answering is None or answering.pid != kept.restart.pid:
            return False
        self.started = True
        if self.borrowed.get(self.host.name) is None:
            # A phase that did not share this command's memory (a library caller): whether a
            # server ran before it is not known here (the kept one runs now); the host's
            # record is kept, and the kept server stopped at the end, as before there was a
            # put-back.
            before = self.services.remember(self.transport, self.host)
            self.borrowed.remember(self.host.name, replace(before, running=False, pid=None))
        self.borrowed.change(self.host.name)
        return True

    def serving(self) -> bool:
        """The server answers (after a failed row: is it still there?)."""
        return self._answering() is not None

    def _answering(self) -> ServiceStatus | None:
        """The status of this place's server where it runs and answers; None where it does
        not, or the host cannot say."""
        try:
            st = self.services.status(self.transport, self.host)
        except DdtreeOpsError:
            return None
        return st if st.running and st.health == 200 else None


@dataclass(frozen=True)
class PlannedPutBack:
    """What the end of the sweep will do to one server place (the dry run): ``action`` one
    of ``relaunch``, ``stop``, ``keep``, ``leave-stopped``, ``unknown`` (the place could not
    be observed: ``error``); ``before`` what serves there now (:func:`describe_before`), or
    what served before a dead sweep (``dead_sweep`` names it) whose lease this one takes over."""

    place: str
    action: str
    before: str
    error: str | None = None
    dead_sweep: str | None = None

    def describe(self) -> str:
        if self.action == "unknown":
            return f"{self.place}: cannot say what will be put back (not observed: {self.error})"
        found = (f"before the dead {self.dead_sweep}, whose lease this sweep takes over: {self.before}"
                 if self.dead_sweep else f"now: {self.before}")
        return f"{self.place}: at the end " + {
            "relaunch": f"puts back what serves, relaunched and proven ready ({found})",
            "stop": f"stops the sweep's server, nothing to relaunch ({found})",
            "keep": f"keeps the sweep's last server running, --keep-server ({found}; not put back)",
            "leave-stopped": f"leaves it stopped, --leave-stopped ({found}; not put back)",
        }[self.action]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"summary": self.describe()}


def _planned(place: str, before: PreviousServer, options: SweepOptions, dead_sweep: str | None) -> PlannedPutBack:
    action = ("keep" if options.keep_server else "leave-stopped" if options.leave_stopped
              else "relaunch" if before.running else "stop")
    return PlannedPutBack(place, action, describe_before(before), dead_sweep=dead_sweep)


def plan_put_back(
    services: Services, hosts: Sequence[Host], options: SweepOptions
) -> dict[str, tuple[PlannedPutBack, ...]]:
    """Per host, what the end of a sweep with ``options`` will put back on each of its server
    places: each observed now (one round trip for the lease, one for the server; in parallel),
    changing nothing. A dead sweep's lease with a note says what served before that sweep."""
    from ddtree_ops.service.agent import dead_lease
    from ddtree_ops.service.manager import describe_lease

    places = [place for host in hosts for place in host.slot_hosts()]

    def one(place: Host) -> PlannedPutBack:
        try:
            with services.open_transport(place) as transport:
                lease = services.read_lease(transport, place)
                before = before_of(lease.get("note")) if lease is not None and dead_lease(lease) else None
                if before is not None:
                    assert lease is not None
                    return _planned(place.name, before, options, describe_lease(lease))
                return _planned(place.name, services.remember(transport, place), options, None)
        except DdtreeOpsError as exc:
            return PlannedPutBack(place.name, "unknown", "", error=str(exc))

    if not places:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(places)), thread_name_prefix="put-back-plan") as pool:
        planned = list(pool.map(one, places))
    by_place = dict(zip((p.name for p in places), planned, strict=True))
    return {host.name: tuple(by_place[p.name] for p in host.slot_hosts()) for host in hosts}


__all__ = [
    "PUT_BACK_ACTIONS",
    "Borrowed",
    "KeptServer",
    "Leases",
    "PlannedPutBack",
    "PutBack",
    "SweepOptions",
    "SweepServer",
    "before_of",
    "describe_before",
    "note_of",
    "plan_put_back",
]
