"""ddtree.ops.server documentation; the work is its action plugin's (plugins/action/server.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: server
short_description: SGLang with DDTree under the host's manager, proven ready, restarted only when it differs
version_added: "0.1.0"
description:
  - C(state=started) is the restart of C(ddtree-ops deploy --restart) on the task's host, with the same
    code - the launch (algorithm, budget, top-k, the machine's tuned policy, eager budgets, extra arguments)
    is built as the CLI builds it, and each server place (the host, or each of its GPU slots) is restarted
    only where the server observed there does not already serve exactly that launch, ready (its flags,
    environment and tree as C(/server_info) resolves them, its smoke decoding). A host already serving it
    reports C(changed=false).
  - The server runs under the host's manager - ddtree-ops' process manager, or the operator's systemd unit
    through a drop-in (C(ddtree.server.manager)).
  - A restart stops the old server, proves the port free, launches, waits until the NEW process serves
    (deadline from the learned or expected load time, extended while the log shows progress), then runs a
    speculative smoke (real decodes, greedy and sampled, alone and batched). A CUDA-graph capture failure,
    or a crash of the first decodes with graphs on, relaunches eager once and is recorded on the host
    (C(<run_dir>/ansible-state.json)) per tree budget, so the next restart starts eager at that budget and
    above.
  - After the restart the host is observed again; a server not serving the launch, ready, fails the task.
  - C(state=restarted) restarts even a server that serves the launch. C(state=stopped) stops the server
    ddtree-ops launched. C(state=previous) puts back what ran before a change (O(previous), taken by
    M(ddtree.ops.facts) before it) - what a playbook's C(rescue) does.
  - In check mode nothing is stopped or launched; the result says which servers would be restarted, and a
    launch the real run would refuse fails the task. The DDTree plugin is then taken to be deployed by the
    play's M(ddtree.ops.bundle) task (which check mode did not run either), as C(deploy --restart --dry-run) does.
options:
  state:
    description:
      - V(started) converges, V(restarted) always restarts, V(stopped) stops, V(previous) puts O(previous) back.
    type: str
    choices: [started, restarted, stopped, previous]
    default: started
  algorithm:
    description: The speculative algorithm (C(--algorithm)); V(AR) is the target model alone.
    type: str
    choices: [AR, DFLASH, DDTREE]
    default: DDTREE
  budget:
    description:
      - The DDTree node budget (C(--budget); DFLASH - its draft tokens). DDTREE without it - the tuned policy's
        launch state where the machine has one, else 16, as C(deploy --restart).
    type: int
  topk:
    description: The DDTree top-k (C(--topk)); DDTREE without it - the policy's, else 4.
    type: int
  eager:
    description: Launch without CUDA graphs (C(--eager)).
    type: bool
    default: false
  extra_args:
    description: Extra server arguments, one argv entry each (C(--extra-arg)); never a flag ddtree-ops sets itself.
    type: list
    elements: str
    default: []
  policy:
    description: DDTREE - launch with the tuned policy C(tune --deploy) put on the machine; V(false) is C(--no-policy).
    type: bool
    default: true
  retry_cuda_graph:
    description: Try CUDA graphs even where an eager fallback is recorded (C(--retry-cuda-graph)).
    type: bool
    default: false
  timeout:
    description: A fixed readiness deadline per launch, in seconds (C(--timeout)); default load-aware.
    type: float
  grace:
    description: Seconds between SIGTERM and SIGKILL for the old server (C(--grace)).
    type: float
    default: 30.0
  smoke:
    description: Run the speculative smoke before calling a server ready; V(false) is C(--no-smoke).
    type: bool
    default: true
  smoke_temperatures:
    description: Also smoke at these temperatures (C(--smoke-temperature)); greedy always runs.
    type: list
    elements: float
    default: []
  keep_on_failure:
    description: Leave a server that did not become ready running to inspect it (C(--keep-on-failure)).
    type: bool
    default: false
  force:
    description: Restart or stop even while a benchmark sweep holds the host (C(--force)).
    type: bool
    default: false
  previous:
    description:
      - With O(state=previous) - what ran on each server place before the change, as M(ddtree.ops.facts) returns
        it in C(ansible_facts.ddtree_ops.previous) (a mapping of server name to its launch record).
    type: dict
attributes:
  action:
    support: full
    description: Runs on the controller (an action plugin); the host needs only the Python of its C(ddtree.python).
  async:
    support: none
  check_mode:
    support: full
  diff_mode:
    support: none
  platform:
    platforms: posix
requirements:
  - ddtree-ops of the same release on the controller (the Python that runs Ansible).
  - A DDTREE launch needs the DDTree bundle deployed (M(ddtree.ops.bundle)); it is refused before the old server
    is stopped otherwise.
notes:
  - What the host's server is (model, port, command, manager, unit, environment, GPU slots) is its C(ddtree)
    variable, read as the ddtree-ops CLI reads it from an inventory.
author:
  - ddtree-ops maintainers
"""

EXAMPLES = r"""
- name: Serve DDTree, budget 8, top-k 2 (restarted only where it does not already)
  ddtree.ops.server:
    budget: 8
    topk: 2

- name: Put back what ran before the change
  ddtree.ops.server:
    state: previous
    previous: "{{ before.ansible_facts.ddtree_ops.previous }}"
"""

RETURN = r"""
servers:
  description: >-
    Per server place - its name, what was done (V(restarted), V(unchanged), V(stopped), V(already stopped); in
    check mode V(would restart)), a phrase, its pid and, for a restart, CUDA graphs on or off, the fallback's
    reason, launches, load and ready seconds. With O(state=previous), one phrase per server.
  returned: success
  type: list
run:
  description: The launch asked for (C(DDTREE budget=8 topk=2)).
  returned: state started or restarted
  type: str
observed:
  description: Each server place observed after the restart (manager, pid, what it serves, ready, smoke).
  returned: state started or restarted, not in check mode
  type: dict
error:
  description: The stable name of the error (as C(ddtree-ops --json)), e.g. V(readiness_timeout), V(not_deployed).
  returned: failed or unreachable
  type: str
exit_code:
  description: The exit code C(ddtree-ops) gives the same failure.
  returned: failed or unreachable
  type: int
"""


def main():
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(argument_spec={}, bypass_checks=True)
    module.fail_json(msg="ddtree.ops.server runs on the controller, as its action plugin; call it as ddtree.ops.server")


if __name__ == "__main__":
    main()
