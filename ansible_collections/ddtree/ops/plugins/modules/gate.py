"""ddtree.ops.gate documentation; the work is its action plugin's (plugins/action/gate.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: gate
short_description: The canary gate of ddtree-ops - greedy tokens, speed and acceptance before and after a change
version_added: "0.1.0"
description:
  - The gate C(ddtree-ops deploy --restart --canary HOST) runs around its canary, in two tasks around the change
    (M(ddtree.ops.bundle), M(ddtree.ops.server)).
  - V(baseline) - before the change, each server on the host answers the gate's prompts at T=0 with the target's
    log-probabilities; the answers are recorded on the host (C(<run_dir>/gate-baseline.json)). Where no server
    answers, the target alone (AR) is launched first to give them (then C(changed)).
  - V(judge) - after the change, the same requests again (and at a sampled temperature). The task fails when the
    gate does - a changed greedy token that is not a near-tie of the baseline (its own log-probability of the
    new token within O(tie_epsilon) nats of its choice), fewer than O(agreement) of the tokens compared, decode
    speed below O(min_speed) of before, acceptance below the floor, or a failed request. A playbook's C(rescue)
    then puts the canary back (M(ddtree.ops.bundle) V(absent), M(ddtree.ops.server) V(previous)).
options:
  phase:
    description: V(baseline) before the change, V(judge) after it.
    type: str
    choices: [baseline, judge]
    required: true
  algorithm:
    description: What the change serves; acceptance is judged only for a speculative one (not V(AR)).
    type: str
    choices: [AR, DFLASH, DDTREE]
    default: DDTREE
  agreement:
    description: The share of the baseline's greedy tokens that must have been compared (C(--gate-agreement)).
    type: float
    default: 0.5
    aliases: [gate_agreement]
  tie_epsilon:
    description: Nats within which a changed greedy token is a near-tie of the baseline (C(--gate-tie-epsilon)).
    type: float
    default: 0.125
    aliases: [gate_tie_epsilon]
  min_speed:
    description:
      - Decode speed after, over before, on the same greedy requests, at least (C(--gate-min-speed)); 0 - not judged.
    type: float
    default: 0.9
    aliases: [gate_min_speed]
  accept_floor:
    description:
      - The acceptance-length floor at every temperature (C(--gate-accept-floor)); default from O(ledger), else 1.3.
    type: float
    aliases: [gate_accept_floor]
  temperature:
    description: The sampled temperature judged besides T=0 (C(--gate-temperature)).
    type: float
    default: 0.7
    aliases: [gate_temperature]
  ledger:
    description: Ledger files or folders on the controller whose measured acceptance sets the floor (C(--gate-ledger)).
    type: list
    elements: path
    default: []
    aliases: [gate_ledger]
attributes:
  action:
    support: full
    description: Runs on the controller (an action plugin); the requests are sent from the host itself.
  async:
    support: none
  check_mode:
    support: partial
    details: V(baseline) says whether it would launch the target alone; V(judge) is not judged (nothing changed).
  diff_mode:
    support: none
  platform:
    platforms: posix
requirements:
  - ddtree-ops of the same release on the controller.
author:
  - ddtree-ops maintainers
"""

EXAMPLES = r"""
- name: Record the canary's answers before the change
  ddtree.ops.gate:
    phase: baseline

- name: Judge the changed canary
  ddtree.ops.gate:
    phase: judge
    gate_min_speed: 0.9
"""

RETURN = r"""
gates:
  description: >-
    Per server - passed, greedy agreement, divergences (and which were near-ties), speed, acceptance per
    temperature and its floor.
  returned: phase judge
  type: dict
path:
  description: Where the baseline was recorded on the host.
  returned: phase baseline
  type: str
servers:
  description: The servers whose answers were recorded.
  returned: phase baseline
  type: list
  elements: str
error:
  description: V(canary_failed) when the gate failed, else the stable name of the error.
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
    module.fail_json(msg="ddtree.ops.gate runs on the controller, as its action plugin; call it as ddtree.ops.gate")


if __name__ == "__main__":
    main()
