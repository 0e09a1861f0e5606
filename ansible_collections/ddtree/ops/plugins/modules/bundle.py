"""ddtree.ops.bundle documentation; the work is its action plugin's (plugins/action/bundle.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: bundle
short_description: Deploy or roll back a ddtree-ops patch bundle in a host's SGLang site-packages
version_added: "0.1.0"
description:
  - C(state=present) is C(ddtree-ops deploy HOST [BUNDLE]) on the task's host, C(state=absent) is
    C(ddtree-ops rollback HOST), with the same code - the bundle is read on the controller and its files
    shipped over the play's connection; on the host the same program keeps the same journal, lock, backups
    and state record, so either tool sees and undoes what the other did.
  - All-or-nothing per host - every file is uploaded and hash-checked beside its target before any is
    renamed into place; the bundle's verify commands run after; a failure puts every file back. A journal
    left by an interrupted run is recovered first.
  - Guards - a file that is neither the original the bundle was made for nor its patched content
    (drifted), another bundle applied, an SGLang version the bundle was not made for, or a lock held by
    another run refuse the host, with nothing changed, unless told otherwise (O(force), O(replace),
    O(force_version), O(break_lock)).
  - After the change the host is observed again - the bundle must be seen in place (or the originals back),
    else the task fails.
  - Reports C(changed) only when files changed. In check mode nothing is written and the plan is returned
    (the C(--dry-run)); with C(--diff) each changed file's before and after is shown.
  - On a systemd host, C(state=absent) also removes ddtree-ops' drop-in from the unit (as C(rollback) does);
    the server is not restarted - use M(ddtree.ops.server) for that.
options:
  state:
    description: V(present) deploys the bundle, V(absent) restores the original files and clears the record.
    type: str
    choices: [present, absent]
    default: present
  bundle:
    description:
      - The bundle directory on the controller (its C(patch.yaml) and files). Default - the DDTree bundle
        shipped with ddtree-ops. Ignored with O(state=absent).
    type: path
  force:
    description:
      - Back up drifted files and overwrite them (C(--force)); with O(state=absent), restore originals over drifted
        files.
    type: bool
    default: false
  force_version:
    description: Deploy to an SGLang version the bundle was not made for (C(--force-version)).
    type: bool
    default: false
  replace:
    description: Deploy over another applied bundle; its files this one does not patch are restored (C(--replace)).
    type: bool
    default: false
  break_lock:
    description: Take over a host lock held by another controller (C(--break-lock)).
    type: bool
    default: false
  lock_wait:
    description: Seconds to wait for a host lock held by another run (C(--lock-wait)).
    type: float
    default: 0.0
attributes:
  action:
    support: full
    description: Runs on the controller (an action plugin); the host needs only the Python of its C(ddtree.python).
  async:
    support: none
  check_mode:
    support: full
  diff_mode:
    support: full
  platform:
    platforms: posix
requirements:
  - ddtree-ops of the same release on the controller (the Python that runs Ansible).
  - On the host, the Python named by the host's C(ddtree.python) variable, with SGLang installed.
notes:
  - The host's settings are its C(ddtree) variable, read as the ddtree-ops CLI reads it from an inventory.
    Ansible replaces a dict variable whole, so a host's C(ddtree) replaces its group's (ddtree-ops' own
    loader merges them key by key); set each host's C(ddtree) at one level to give both tools the same host.
author:
  - ddtree-ops maintainers
"""

EXAMPLES = r"""
- name: Deploy the DDTree bundle shipped with ddtree-ops
  ddtree.ops.bundle:

- name: Deploy a bundle of our own, over a file a hotfix changed
  ddtree.ops.bundle:
    bundle: patches/ddtree_temperature
    force: true

- name: Put the original SGLang files back
  ddtree.ops.bundle:
    state: absent
"""

RETURN = r"""
outcome:
  description: >-
    What was done - V(applied), V(rolled-back), V(noop) (already in place / nothing applied), or in check
    mode V(planned) (and, on a failed task, the outcome the run would refuse with).
  returned: always, unless the host could not be read
  type: str
  sample: applied
bundle:
  description: The bundle's name, version and identity (state present).
  returned: state present
  type: dict
  sample: {"name": "ddtree_temperature", "version": "0.2.0", "identity": "5f0c..."}
plan:
  description: Each file of the plan - its path (relative to the package), action, current and new sha256, why.
  returned: success
  type: list
  elements: dict
txn:
  description: The transaction id recorded on the host (null when nothing changed).
  returned: success
  type: str
recovered:
  description: What recovering a journal left by an interrupted run did, or null.
  returned: success
  type: str
package_version:
  description: The SGLang version installed on the host.
  returned: success
  type: str
notes:
  description: What else the plan or the rollback says (files placed beside the bundle removed, a drop-in removed).
  returned: success
  type: list
  elements: str
observed:
  description: >-
    The host observed after the change (not in check mode) - its bundle (name, identity, files per state) and
    each server place (manager, pid, what it serves, ready).
  returned: when not in check mode
  type: dict
error:
  description: The stable name of the error (the same as C(ddtree-ops --json)'s), e.g. V(drift), V(locked).
  returned: failed or unreachable
  type: str
exit_code:
  description: The exit code C(ddtree-ops) gives the same failure (2 config, 3 transport, 4 patch, 5 service).
  returned: failed or unreachable
  type: int
"""


def main():
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(argument_spec={}, bypass_checks=True)
    module.fail_json(msg="ddtree.ops.bundle runs on the controller, as its action plugin; call it as ddtree.ops.bundle")


if __name__ == "__main__":
    main()
