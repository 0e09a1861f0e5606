"""ddtree-ops inside Ansible: the ``ddtree.ops`` collection's tasks, run by its action plugins.

The collection (``ansible_collections/ddtree/ops/``) is thin: each of its action plugins
(``bundle``, ``server``, ``gate``, ``facts``) validates its arguments, builds the host from
the task's variables (:mod:`.hostvars`) and a transport over Ansible's own connection to it
(:mod:`.transport`), and calls one task here (:mod:`.tasks`). A task is the CLI's own code
(the patch executor, the restart and its convergence rule, the gate, the observation) on that
transport, so the programs a host runs, their framing (``transport/hostprogram.py``), the
journal, locks and records they keep there are the same whichever tool ran them: one
implementation, not a port. Nothing in this package imports Ansible; the collection's glue
(``plugins/plugin_utils/ddtree.py``) is the only code that touches both.
"""
