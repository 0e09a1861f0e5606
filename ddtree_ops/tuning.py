"""``tune --deploy``: a tuned DDTREE policy onto one host, its servers restarted with it.

Per host (a machine; its GPU slots are its servers), in this order:

1. **Which policy.** The host's machine type is the one its own ledger rows name (the
   report groups machines by GPU type); a host the ledger never measured gets the GPU
   type its probe finds (``nvidia-smi``). No policy for that type: refused, nothing touched.
2. **What runs now** on each server (its launch record): what a failure puts back.
3. **The file** beside the applied bundle (:func:`ddtree_ops.patching.placed.place_file`:
   under the deploy lock, atomic, sha256 checked), returning what it replaced.
4. **Each server restarted** through the one restart policy (``prepare_restart``, eager
   fallbacks and the sweep lease honoured) at the policy's launch state with
   ``--speculative-adaptive-config <file>``; ready only once the smoke decoded and
   ``/server_info`` says the server follows exactly this policy
   (``internal_states[0].ddtree.mode == "policy"``).
5. **Remembered** in the local state (:class:`ddtree_ops.state.PolicyRecord`) only then,
   so that a later plain ``restart`` launches with it too.

A failure (or Ctrl-C) after step 3 leaves the host as it was, like the patch engine's
rollback and pipx's: the previous file content is put back (or the file removed), every
server this run touched is stopped and its previous server relaunched from its launch
record, the local record is left as it was, and the error says what was rolled back.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ddtree_ops.errors import ConfigError, DdtreeOpsError, recorded_error
from ddtree_ops.inventory_types import Host
from ddtree_ops.patching.placed import PlacedFile, place_file, restore_file
from ddtree_ops.probe import HostFacts, probe_host
from ddtree_ops.report.policy import Policy
from ddtree_ops.service import lifecycle
from ddtree_ops.service.fallback import RuntimeBudgets, fallback_key, plan_runtime_budgets
from ddtree_ops.service.launch import RunConfig
from ddtree_ops.service.logphases import PhaseEvent
from ddtree_ops.service.manager import LeasePass
from ddtree_ops.service.smoke import SmokeSpec
from ddtree_ops.state import PolicyRecord, StateStore
from ddtree_ops.transport.base import Transport


@dataclass(frozen=True)
class PolicyTarget:
    """Which machine type a host is, and how that was learned (``ledger`` or ``probe``)."""

    host: str
    machine_type: str | None
    learned_from: str


@dataclass(frozen=True)
class PolicyUndo:
    """What puts a host back after its policy served (a rollout's canary that failed its
    gate): the file as placed (with what it replaced) and each server's previous launch."""

    host: str
    placed: PlacedFile
    before: Mapping[str, lifecycle.PreviousServer]


@dataclass(frozen=True)
class DeployedPolicy:
    """One host carrying a tuned policy: the file, and every server serving it."""

    host: str
    machine_type: str
    learned_from: str
    path: str
    sha256: str
    replaced: bool  # a file was there before (a previous tune)
    budget: int  # the launch state
    topk: int
    servers: tuple[lifecycle.RestartResult, ...]


def machine_type_of(host: Host, host_machines: Mapping[str, str], facts: HostFacts | None) -> PolicyTarget:
    """The ledger's word for ``host`` first (the policy was chosen from its rows), else the
    probed GPU name; None when neither says."""
    if host.name in host_machines:
        return PolicyTarget(host.name, host_machines[host.name], "ledger")
    gpus = facts.gpus if facts is not None else ()
    return PolicyTarget(host.name, gpus[0].name if gpus else None, "probe")


def planned_target(host: Host, host_machines: Mapping[str, str]) -> PolicyTarget:
    """What ``--dry-run`` can say without touching the host: the ledger's machine type, or
    that the probe will decide."""
    return machine_type_of(host, host_machines, None)


def policy_of(target: PolicyTarget, policies: Sequence[Policy]) -> Policy:
    """The policy tuned for ``target``'s machine type (ConfigError when there is none)."""
    tuned = ", ".join(p.machine for p in policies) or "none"
    if target.machine_type is None:
        raise ConfigError(
            f"not in the ledger, and its probe found no GPU to tell its machine type (tuned: {tuned})",
            host=target.host,
        )
    policy = next((p for p in policies if p.machine == target.machine_type), None)
    if policy is None:
        raise ConfigError(
            f"machine type {target.machine_type} (from the {target.learned_from}) has no tuned policy (tuned: {tuned})",
            host=target.host,
        )
    return policy


@dataclass(frozen=True)
class PolicyFile:
    """The policy file ``tune --deploy`` places on one host, as it will be: its machine
    type's policy, rendered with the budgets this machine is recorded to fail capturing
    (``eager_budgets``), its sha256, and the launch state (moved off an eager budget). What
    ``--dry-run`` shows is this, and :func:`deploy_policy` places exactly this."""

    host: str
    policy: Policy
    learned_from: str
    text: str
    sha256: str
    launch_budget: int
    eager_budgets: tuple[int, ...]


def policy_file(
    transport: Transport, host: Host, policies: Sequence[Policy], host_machines: Mapping[str, str], *,
    state: StateStore, facts: HostFacts | None = None,
) -> PolicyFile:
    """Step 1 and step 3's file (module docstring), changing nothing: ``host`` probed (or
    ``facts``), its policy, and the file for it. ConfigError where no policy fits;
    the probe's error where the host cannot be reached."""
    facts = facts if facts is not None else probe_host(transport, host)
    if not facts.reachable:
        raise recorded_error(facts.error_type, facts.error or "unreachable", host=host.name)
    target = machine_type_of(host, host_machines, facts)
    policy = policy_of(target, policies)
    planned = runtime_budgets(transport, host, policy, facts, state)
    text = policy.render(planned.eager_budgets)
    return PolicyFile(host=host.name, policy=policy, learned_from=target.learned_from, text=text,
                      sha256=hashlib.sha256(text.encode()).hexdigest(), launch_budget=planned.launch_budget,
                      eager_budgets=planned.eager_budgets)


def deploy_policy(
    transport: Transport,
    host: Host,
    policies: Sequence[Policy],
    host_machines: Mapping[str, str],
    *,
    state: StateStore | None = None,
    timeout: float | None = None,
    smoke: SmokeSpec | None = lifecycle.DEFAULT_SMOKE,
    lease: LeasePass | None = None,
    stop_grace_s: float = 30.0,
    on_phase: Callable[[PhaseEvent], None] | None = None,
    cancel: threading.Event | None = None,
    on_placed: Callable[[PolicyUndo], None] | None = None,
) -> DeployedPolicy:
    """Steps 1-5 of the module docstring on one machine ``host``; raises with the host as
    it was (the message says what was rolled back). ``on_placed`` receives, once the file is
    on the host, what :func:`undo_policy` needs to put the host back later."""
    state = state if state is not None else StateStore()
    facts = probe_host(transport, host)
    planned = policy_file(transport, host, policies, host_machines, state=state, facts=facts)
    policy, text = planned.policy, planned.text
    servers = host.slot_hosts()
    before = {server.name: lifecycle.remember_server(transport, server) for server in servers}
    placed = place_file(transport, host, text.encode())
    if on_placed is not None:
        on_placed(PolicyUndo(host.name, placed, before))
    record = PolicyRecord(
        host=host.machine, path=placed.path, sha256=placed.sha256, config=text,
        machine_type=policy.machine, temperature=policy.temperature, budget=planned.launch_budget,
        topk=policy.launch.topk, recorded_at=0.0,
    )
    run = RunConfig("DDTREE", budget=planned.launch_budget, topk=policy.launch.topk)
    touched: list[Host] = []
    results: list[lifecycle.RestartResult] = []
    try:
        for server in servers:
            touched.append(server)
            request = lifecycle.prepare_restart(
                transport, server, run, machine=host, facts=facts, lease=lease, timeout=timeout,
                stop_grace_s=stop_grace_s, smoke=smoke, tree_policy=record, state=state,
                refresh_policy=False,
            )
            results.append(lifecycle.restart(transport, request, state=state, on_phase=on_phase, cancel=cancel))
    except BaseException as exc:
        undone = _roll_back(transport, host, placed, touched, before, state=state, lease=lease,
                            stop_grace_s=stop_grace_s)
        if isinstance(exc, DdtreeOpsError):
            exc.message = f"{exc.message}; {undone}"
        raise
    state.record_policy(replace(record, recorded_at=time.time()))
    return DeployedPolicy(
        host=host.name, machine_type=policy.machine, learned_from=planned.learned_from, path=placed.path,
        sha256=placed.sha256, replaced=placed.previous is not None, budget=planned.launch_budget,
        topk=policy.launch.topk, servers=tuple(results),
    )


def runtime_budgets(
    transport: Transport, host: Host, policy: Policy, facts: HostFacts, state: StateStore
) -> RuntimeBudgets:
    """Which of ``policy``'s budgets its file lists in ``ddtree.eager_budgets`` on ``host``,
    and the launch budget: the budgets recorded to fail capture on this machine (its GPU
    arch and SGLang, as the restart keys them) serve eager, and the others keep their graphs,
    instead of the whole server going eager for one large budget. The launch moves off an
    eager budget (the bundle refuses it there) to the largest one with graphs."""
    launch = lifecycle.launch_facts(transport, host, facts)
    run = RunConfig("DDTREE", budget=policy.launch.budget, topk=policy.launch.topk)
    key = fallback_key(host, run, arch=launch.gpu_arch, sglang_version=launch.sglang_version)
    return plan_runtime_budgets(state, key, policy.budgets)


def undo_policy(
    transport: Transport,
    host: Host,
    undo: PolicyUndo,
    previous: PolicyRecord | None,
    *,
    state: StateStore,
    lease: LeasePass | None = None,
    stop_grace_s: float = 30.0,
) -> str:
    """Put back a host whose policy was deployed and served: the previous file (or none),
    every server's previous launch, and the local record as it was (``previous``)."""
    done = _roll_back(transport, host, undo.placed, host.slot_hosts(), undo.before, state=state, lease=lease,
                      stop_grace_s=stop_grace_s)
    if previous is not None:
        state.record_policy(previous)
    else:
        state.forget_policy(host.machine)
    return done


def _roll_back(
    transport: Transport,
    host: Host,
    placed: PlacedFile,
    touched: Sequence[Host],
    before: Mapping[str, lifecycle.PreviousServer],
    *,
    state: StateStore,
    lease: LeasePass | None,
    stop_grace_s: float,
) -> str:
    """Put back the file and every touched server; one phrase saying what was done (and
    what could not be: each step is tried whatever the one before it did). A server still
    the one that ran before (a restart refused before it stopped anything: the lock, the
    lease, a bad launch state) is left alone."""
    done: list[str] = []
    failed: list[str] = []
    try:
        restore_file(transport, host, placed)
        done.append("policy file restored" if placed.previous is not None else "policy file removed")
    except DdtreeOpsError as exc:
        failed.append(f"policy file {placed.path}: {exc.message}")
    for server in touched:
        try:
            if lifecycle.remember_server(transport, server) == before[server.name]:
                done.append(f"{server.name} untouched")
                continue
            what = lifecycle.restore_server(transport, server, before[server.name], state=state, lease=lease,
                                            stop_grace_s=stop_grace_s)
            done.append(f"{server.name} {what}")
        except DdtreeOpsError as exc:
            failed.append(f"{server.name}: {exc.message}")
    if failed:
        return f"rollback incomplete: {'; '.join(failed)}" + (f" (done: {', '.join(done)})" if done else "")
    return f"rolled back: {', '.join(done)}"


__all__ = [
    "DeployedPolicy",
    "PolicyFile",
    "PolicyTarget",
    "PolicyUndo",
    "deploy_policy",
    "machine_type_of",
    "planned_target",
    "policy_file",
    "policy_of",
    "undo_policy",
]
