"""What every ddtree.ops action plugin does: the one place that touches both Ansible and ddtree-ops.

An action plugin runs on the controller. It validates its task's arguments (the spec is
ddtree-ops', ``ddtree_ops.ansible.specs``), reads the host's resolved ``ddtree`` variable,
and hands the task to ``ddtree_ops.ansible.run.run_task`` with the play's connection to the
host as a callable: each program ddtree-ops runs on the host goes over that connection
(``become``, ssh arguments, multiplexing are the play's), byte for byte what the CLI sends.
"""

from __future__ import annotations

import json

from ansible import constants as C
from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.module_utils.common.text.converters import to_bytes, to_text

# The ddtree-ops release this collection is built from. Its tasks are that release's code:
# another release's host programs, records or options are not what the collection documents.
TOOLKIT_VERSION = "0.1.0"


def _toolkit():
    """The ddtree_ops.ansible entry point, or an AnsibleError saying how to install it."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("ddtree-ops")
        except PackageNotFoundError:
            found = None
        from ddtree_ops.ansible import run as toolkit_run
    except ImportError as exc:
        raise AnsibleError(
            f"ddtree.ops runs ddtree-ops on the controller, and the Python that runs Ansible cannot import it "
            f"({exc}): pip install 'ddtree-ops=={TOOLKIT_VERSION}' into that environment"
        ) from None
    if found is not None and found != TOOLKIT_VERSION:
        raise AnsibleError(
            f"ddtree.ops {TOOLKIT_VERSION} needs ddtree-ops {TOOLKIT_VERSION} on the controller, found {found}: "
            f"install that release, or build the collection from the installed one "
            f"(ddtree-ops ansible-collection build DIR)"
        )
    return toolkit_run


def _plain(value):
    """A templated variable as plain JSON types (Ansible's tagged strings and dicts)."""
    return json.loads(json.dumps(value))


def run_action(action, name, task_vars):
    """The body of each plugin's ``run``: task ``name`` on the task's host."""
    toolkit = _toolkit()
    from ddtree_ops.ansible.specs import SPECS
    from ddtree_ops.errors import ConnectError

    _validation, args = action.validate_argument_spec(argument_spec=SPECS[name])
    task_vars = task_vars or {}
    host_name = to_text(task_vars.get("inventory_hostname", ""))
    templar = action._templar
    ddtree = task_vars.get("ddtree")
    ddtree = _plain(templar.template(ddtree)) if ddtree is not None else None
    connection = task_vars.get("ansible_connection")
    connection = to_text(templar.template(connection)) if connection is not None else action._connection.transport

    def execute(line, stdin):
        try:
            res = action._low_level_execute_command(line, sudoable=True, in_data=stdin,
                                                    encoding_errors="surrogateescape")
        except AnsibleConnectionFailure as exc:
            raise ConnectError(" ".join(to_text(exc).split()), host=host_name) from None
        return (int(res.get("rc") or 0), to_bytes(res.get("stdout", ""), errors="surrogateescape"),
                to_bytes(res.get("stderr", ""), errors="surrogateescape"))

    return toolkit.run_task(
        name, args, host_name=host_name, ddtree=ddtree, execute=execute, connection=connection,
        base_dir=to_text(task_vars.get("inventory_dir") or action._loader.get_basedir()),
        check_mode=bool(action._task.check_mode), diff=bool(action._task.diff),
        max_diff_bytes=int(C.MAX_FILE_SIZE_FOR_DIFF),
    )
