"""The one entry point of the collection's action plugins: a task by name, on one host.

The plugin hands over what only Ansible knows (the validated arguments, the host's name and
resolved ``ddtree`` variable, its connection as an :data:`~ddtree_ops.ansible.transport.Execute`,
check and diff mode); everything else is decided here and below, where it is typed, linted and
tested with the rest of the toolkit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddtree_ops.ansible import tasks
from ddtree_ops.ansible.hostvars import host_from_vars
from ddtree_ops.ansible.specs import SPECS, check_ranges
from ddtree_ops.ansible.transport import ConnectionTransport, Execute
from ddtree_ops.errors import DdtreeOpsError
from ddtree_ops.service.launch import RunConfig, parse_algorithm

TASKS = tuple(SPECS)


def run_task(
    name: str,
    args: Mapping[str, Any],
    *,
    host_name: str,
    ddtree: Any,
    execute: Execute,
    connection: str | None = None,
    base_dir: str | None = None,
    check_mode: bool = False,
    diff: bool = False,
    max_diff_bytes: int = 104448,
) -> tasks.Result:
    """The task ``name`` (bundle, server, gate, facts) with ``args`` (already validated
    against its spec) on ``host_name``; its Ansible result (never raises for the host)."""
    try:
        check_ranges(name, args)
        host = host_from_vars(host_name, ddtree, connection=connection, base_dir=base_dir)
        ctx = tasks.TaskContext(ConnectionTransport(host_name, execute), host, check_mode=check_mode, diff=diff,
                                max_diff_bytes=max_diff_bytes)
        if name == "bundle":
            return tasks.bundle(ctx, state=args["state"], bundle_dir=args.get("bundle"), force=args["force"],
                                force_version=args["force_version"], replace_other=args["replace"],
                                break_lock=args["break_lock"], lock_wait=args["lock_wait"])
        if name == "server":
            return tasks.server(
                ctx, state=args["state"], algorithm=args["algorithm"], budget=args.get("budget"),
                topk=args.get("topk"), eager=args["eager"], extra_args=args["extra_args"], policy=args["policy"],
                retry_cuda_graph=args["retry_cuda_graph"], timeout=args.get("timeout"), grace=args["grace"],
                smoke=args["smoke"], smoke_temperatures=args["smoke_temperatures"],
                keep_on_failure=args["keep_on_failure"], force=args["force"], previous=args.get("previous"))
        if name == "gate":
            algorithm = parse_algorithm(args["algorithm"])
            spec = tasks.gate_spec(agreement=args["agreement"], tie_epsilon=args["tie_epsilon"],
                                   min_speed=args["min_speed"], accept_floor=args.get("accept_floor"),
                                   temperature=args["temperature"], ledgers=args["ledger"], host=host,
                                   run=RunConfig(algorithm))
            return tasks.gate(ctx, phase=args["phase"], spec=spec, algorithm=algorithm)
        if name == "facts":
            return tasks.facts(ctx, bundle_dir=args.get("bundle"), smoke=args["smoke"])
        raise ValueError(f"unknown task {name!r}")
    except DdtreeOpsError as exc:
        return tasks.failure(exc)


__all__ = ["TASKS", "run_task"]
