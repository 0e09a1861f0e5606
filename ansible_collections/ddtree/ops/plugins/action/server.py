"""ddtree.ops.server: see plugins/modules/server.py for its documentation; the work is ddtree-ops'."""

from __future__ import annotations

from ansible.plugins.action import ActionBase

from ansible_collections.ddtree.ops.plugins.plugin_utils.ddtree import run_action


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = True

    def run(self, tmp=None, task_vars=None):
        self._supports_check_mode = True
        self._supports_async = False
        result = super().run(tmp, task_vars)
        result.update(run_action(self, "server", task_vars))
        return result
