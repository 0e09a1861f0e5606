"""A server place's servers over one sweep, owned by a context manager (as vLLM's
``benchmarks/sweep`` owns its server with ``run_server``).

Entering takes the place's sweep lease, before anything else touches the host, so that
no other sweep or restart disturbs its servers until the sweep is done there (a dead
holder's lease is taken over; a live one's raises LeaseHeld at once). :meth:`restart`
launches a server through the one restart policy (``lifecycle.prepare_restart``) with
the smoke at the settings about to be measured; a live DDTree launch first writes its
runtime-state file into the place's run dir (atomically, through the transport).
Leaving, however the block ended, stops the server it started (unless the sweep keeps it,
or the block handed it over to the next phase, and was not interrupted) and gives the lease
back.

A server can outlive one block for the next (``bench --predict``: the predict phase's
launch serves the measured part, so a host loads the DDTree model once): the first block
:meth:`~SweepServer.hand_over` s it as a :class:`KeptServer`, and the next one
:meth:`~SweepServer.adopt` s it, which takes it on only where it is still the same process:
the lease is not held between the two blocks, so another sweep or a ``restart`` may have
replaced it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

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
    from ddtree_ops.service.lifecycle import RestartResult, ServiceStatus
    from ddtree_ops.service.manager import LeasePass


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep runs: ``resume`` skips runs the ledger has ``ok`` rows for;
    ``fail_fast`` stops every host at the first failed row; ``keep_server`` leaves the
    last server running; ``restart_timeout`` bounds each launch (None: load-aware);
    ``smoke`` decodes before a server is measured (``--no-smoke``: False)."""

    resume: bool = False
    fail_fast: bool = False
    keep_server: bool = False
    restart_timeout: float | None = None
    smoke: bool = True


@dataclass(frozen=True)
class KeptServer:
    """A server one block left running for the next (see the module docstring): the
    server place it runs on (``Host.name``: the machine, or one of its GPU slots), the
    launch it serves and how that launch went (its rows' launch identity and smoke)."""

    place: str
    launch: LaunchConfig
    restart: RestartResult


class SweepServer:
    """The servers of one server place (``host``: a machine, or one of its GPU slots, of
    ``machine``) over a sweep; see the module docstring."""

    def __init__(
        self, services: Services, transport: Transport, host: Host, machine: Host, *, sweep: str, run_id: str,
        options: SweepOptions, cancel: threading.Event, on_takeover: Callable[[str], None],
    ) -> None:
        self.services, self.transport, self.host, self.machine = services, transport, host, machine
        self._sweep, self._run_id, self._options, self._cancel = sweep, run_id, options, cancel
        self._on_takeover = on_takeover
        self.lease: str | None = None
        self.started = False
        self._handed_over = False

    def lease_pass(self) -> LeasePass:
        from ddtree_ops.service.manager import LeasePass

        return LeasePass(token=self.lease)

    def __enter__(self) -> SweepServer:
        token = uuid.uuid4().hex
        holder = lockholder.holder_record(token, "bench") | {"sweep": self._sweep, "run_id": self._run_id}
        # Marked running first: a lease of this very process is dead only once its run ended.
        lockholder.run_started(token)
        try:
            taken = self.services.take_lease(self.transport, self.host, token=token, holder=holder)
        except BaseException:
            lockholder.run_ended(token)
            raise
        self.lease = token
        if taken is not None:
            from ddtree_ops.service.manager import describe_lease

            self._on_takeover(f"took over the lease of dead {describe_lease(taken)}")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            keep = self._options.keep_server or self._handed_over
            if self.started and (self._cancel.is_set() or not keep):
                try:
                    self.services.stop(self.transport, self.host, lease=self.lease_pass())
                except DdtreeOpsError:
                    pass  # the host may be the one that went away; its rows say so
        finally:
            # A lease that cannot be released (host gone) is provably dead once this run ended.
            if self.lease is not None:
                try:
                    self.services.release_lease(self.transport, self.host, self.lease)
                except DdtreeOpsError:
                    pass
                finally:
                    lockholder.run_ended(self.lease)

    def restart(self, launch: LaunchConfig, samplings: Iterable[Sampling], facts: HostFacts | None) -> RestartResult:
        """Launch ``launch`` and wait until it serves (lifecycle errors propagate)."""
        from ddtree_ops.service.fallback import fallback_key, plan_runtime_budgets
        from ddtree_ops.service.lifecycle import prepare_restart
        from ddtree_ops.service.smoke import SmokeSampling, SmokeSpec
        from ddtree_ops.state import StateStore

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
        result = self.services.restart(self.transport, request, cancel=self._cancel)
        self.started = True
        return result

    def hand_over(self, launch: LaunchConfig, restart: RestartResult) -> KeptServer:
        """Leave the server ``restart`` launched running when the block ends, for the next
        phase to :meth:`adopt` (an interrupted sweep still stops it). Called once the
        block's work succeeded: a failed phase stops its server, and the next launches its own."""
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


__all__ = ["KeptServer", "SweepOptions", "SweepServer"]
