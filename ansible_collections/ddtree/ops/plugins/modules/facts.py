"""ddtree.ops.facts documentation; the work is its action plugin's (plugins/action/facts.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: facts
short_description: The host as ddtree-ops observes it - bundle, manager, what each server serves, ready - as facts
version_added: "0.1.0"
description:
  - Sets C(ansible_facts.ddtree_ops) to the observation every ddtree-ops command ends with - the patch status (as
    C(ddtree-ops status) shows it - SGLang version, the applied bundle, each file's state, a left-over journal
    or lock), and each server place (the host, or each GPU slot) - its manager (process or systemd, the unit's
    state and whether ddtree-ops' drop-in is in effect), pid, what C(/server_info) says it serves, and whether it
    is ready (answers, and with O(smoke) a short speculative decode passes).
  - C(ansible_facts.ddtree_ops.previous) is each server's launch as it is now - what M(ddtree.ops.server)
    O(ddtree.ops.server#module:state=previous) puts back after a failed change.
  - Changes nothing. The fact is C(ddtree_ops), not C(ddtree) - Ansible also sets each fact as a variable of
    the host, and C(ddtree) is the host's settings.
options:
  bundle:
    description: The bundle directory on the controller whose files are classified (default - the shipped bundle).
    type: path
  smoke:
    description: Prove a server that answers is ready with a short speculative decode (one request).
    type: bool
    default: true
attributes:
  action:
    support: full
  async:
    support: none
  check_mode:
    support: full
  diff_mode:
    support: none
  facts:
    support: full
  platform:
    platforms: posix
requirements:
  - ddtree-ops of the same release on the controller.
author:
  - ddtree-ops maintainers
"""

EXAMPLES = r"""
- name: Remember what the host runs before the change
  ddtree.ops.facts:
  register: before

- name: Say what serves
  ansible.builtin.debug:
    msg: "{{ ansible_facts.ddtree_ops.servers | map(attribute='summary') | list }}"
"""

RETURN = r"""
ansible_facts:
  description: The observation.
  returned: always
  type: dict
  contains:
    ddtree_ops:
      description: C(bundle) (name, version, identity, files per state), C(servers) (per server place), C(status)
        (the patch status as C(ddtree-ops status --json) gives it), C(previous) (per server, its launch record).
      type: dict
"""


def main():
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(argument_spec={}, bypass_checks=True)
    module.fail_json(msg="ddtree.ops.facts runs on the controller, as its action plugin; call it as ddtree.ops.facts")


if __name__ == "__main__":
    main()
