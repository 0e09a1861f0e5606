"""Reading the CLI's ``--json`` output: exactly one envelope on stdout (README "JSON output")."""

from __future__ import annotations

import json
from typing import Any

ENVELOPE_KEYS = ["schema_version", "command", "ok", "exit_code", "data", "errors"]


def read_envelope(stdout: str) -> dict[str, Any]:
    """The one JSON document on ``stdout``, checked to be an envelope of schema 1."""
    env = json.loads(stdout)  # raises on anything else on stdout (a second document, a table)
    assert isinstance(env, dict) and list(env) == ENVELOPE_KEYS, stdout[:2000]
    assert env["schema_version"] == 1
    assert env["ok"] is (env["exit_code"] == 0) is (env["errors"] == []), env
    for err in env["errors"]:
        assert set(err) == {"code", "message", "host"} and err["code"] and err["message"], err
    return env


def json_data(stdout: str) -> Any:
    """The command's payload (the envelope's ``data``)."""
    return read_envelope(stdout)["data"]
