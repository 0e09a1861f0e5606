"""deploy -> restart -> bench -> report through the CLI on hosts with their own addresses.

Every other SSH test host lives on 127.0.0.1, where a client on the operator's machine
reaches a server bound to the host's loopback by accident: that hid issue 14 (every bench
row 'connection failed' on a real fleet). Here the two hosts are network namespaces
(``tests/netnsfleet.py``) reached over SSH at 10.77.N.2, each serving the simulator on
127.0.0.1:30000 as ``examples/inventories/ct200.yaml`` ships the server (bind_host 127.0.0.1), and
the sweep leaves the client mode at its default. The test asserts that every ledger row
is ok and that, while the pipeline runs, nothing but SSH listens on a non-loopback
address inside either namespace (the benchmark must not need an exposed server).

Needs root and ``ip netns``; skipped with the reason elsewhere, but a failure in CI
(``CI=true``), where both are available, so that this coverage cannot vanish silently.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import json_data
from fleetlib import fast_root
from netnsfleet import (
    FAST_SIM_ENV,
    NetnsFleet,
    NetnsHost,
    build_netns_fleet,
    exposed_listeners,
    listeners,
    netns_inventory,
    netns_unavailable,
)

from ddtree_ops.bench import ledger

pytestmark = [pytest.mark.fleet, pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "patches" / "ddtree_temperature"
GROUP = "netns"
SERVER_PORT = 30000  # the same on both hosts: each namespace has its own ports
NUM_PROMPTS = 3
MAX_NEW_TOKENS = 16


def _server_settings() -> dict[str, object]:
    """``examples/inventories/ct200.yaml``'s server, served by the simulator."""
    shipped = yaml.safe_load((REPO / "examples" / "inventories" / "ct200.yaml").read_text())
    server = shipped["all"]["children"]["ct200"]["vars"]["ddtree"]["server"]
    assert server["bind_host"] == "127.0.0.1", "ct200.yaml no longer binds loopback"
    return {
        "port": SERVER_PORT,
        "bind_host": server["bind_host"],
        "command": "{python} -m ddtree_ops.sim",
        "model_path": "sim/qwen3-8b",
        "draft_model_path": "sim/qwen3-8b-dflash",
        "expected_load_s": 5,
    }


@pytest.fixture
def netns_fleet(tmp_path: Path, clean_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NetnsFleet]:
    reason = netns_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the namespace pipeline test, but {reason}")
        pytest.skip(reason)
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing lands in the repository
    root, owned = fast_root(tmp_path / "netns")
    try:
        fleet = build_netns_fleet(root / "fleet")
        try:
            doc = netns_inventory(fleet, server=_server_settings())
            for host in fleet.netns_hosts:
                entry = doc["all"]["children"][GROUP]["hosts"][host.name]  # type: ignore[index]
                entry["ddtree"]["server"] = {"env": {**FAST_SIM_ENV, "SIM_GPU": host.gpu}}
            fleet.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
            yield fleet
        finally:
            fleet.close()
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)


class ExposureWatch:
    """Samples every host's listening sockets in a thread while the block runs: what
    listens on a non-loopback address (SSH aside), and whether the server was seen."""

    def __init__(self, hosts: list[NetnsHost], interval_s: float = 0.1) -> None:
        self.hosts, self.interval_s = hosts, interval_s
        self.exposed: dict[str, set[str]] = {}
        self.server_seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exposure-watch", daemon=True)

    def _sample(self) -> None:
        for host in self.hosts:
            try:
                found = listeners(host)
                exposed = exposed_listeners(host)
            except (OSError, RuntimeError):
                continue  # a process came and went between listing and reading
            if any(port == SERVER_PORT for _, port in found):
                self.server_seen.add(host.name)
            if exposed:
                self.exposed.setdefault(host.name, set()).update(exposed)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> ExposureWatch:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()


def _short_sweep(path: Path) -> Path:
    """An AR baseline and one DDTree cell at two concurrencies; the client mode is left
    to its default (the server binds loopback)."""
    spec = {
        "name": "netns",
        "description": "pipeline on namespace hosts",
        "targets": [GROUP],
        "baselines": ["autoregressive"],
        "grid": {"algorithm": ["ddtree"], "budget": [4], "topk": [4], "temperature": [0.0], "concurrency": [1, 4]},
        "workload": {"prompt_set": "mixed", "num_prompts": NUM_PROMPTS, "max_new_tokens": MAX_NEW_TOKENS, "seed": 0},
        "repeats": 1,
        "warmup": 1,
        "request_timeout_s": 60,
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _ok_json(result: Any, what: str) -> Any:
    assert result.exit_code == 0, f"{what} exited {result.exit_code}:\n{result.stderr[-3000:]}\n{result.stdout[-3000:]}"
    return json_data(result.stdout)


def test_pipeline_on_namespace_hosts_keeps_servers_on_loopback(
    netns_fleet: NetnsFleet, cli: Callable[..., Any], tmp_path: Path
) -> None:
    inv = ("-i", str(netns_fleet.inventory))
    hosts = netns_fleet.netns_hosts
    names = {h.name for h in hosts}

    deployed = _ok_json(cli("--json", *inv, "deploy", GROUP, str(BUNDLE)), "deploy")
    assert {r["host"]: (r["ok"], r["outcome"]) for r in deployed} == dict.fromkeys(names, (True, "applied")), deployed

    with ExposureWatch(hosts) as watch:
        restarted = _ok_json(
            cli("--json", *inv, "restart", GROUP, "--algorithm", "DDTREE", "--budget", "4", "--topk", "4"), "restart"
        )
        assert restarted["ok"] is True and {h["host"] for h in restarted["hosts"]} == names, restarted
        for host in hosts:
            # The server is up inside the namespace, and on its loopback only.
            assert SERVER_PORT in {port for _, port in listeners(host)}, (host.name, listeners(host))
            assert exposed_listeners(host) == [], (host.name, listeners(host))

        sweep = _short_sweep(tmp_path / "netns_sweep.yaml")
        plan = _ok_json(cli("--json", *inv, "bench", "--sweep", str(sweep), "--dry-run"), "bench --dry-run")
        assert plan["clients"] == dict.fromkeys(names, "host"), plan
        out = tmp_path / "results" / "netns.jsonl"
        bench = cli(*inv, "bench", "--sweep", str(sweep), "--out", str(out))

    read = ledger.read_ledger(out)
    rows = read.rows
    assert read.bad_lines == []
    failed = [(r["host"], r["algorithm"], r["concurrency"], r["error"]) for r in rows if r["status"] != "ok"]
    assert failed == [], f"{len(failed)} of {len(rows)} rows failed: {failed}"
    assert bench.exit_code == 0, f"bench exited {bench.exit_code}:\n{bench.stderr[-3000:]}\n{bench.stdout[-3000:]}"
    assert len(rows) == len(names) * plan["rows_per_host"], [(r["host"], r["algorithm"]) for r in rows]
    assert {r["host"] for r in rows} == names
    for r in rows:
        where = f"{r['host']} {r['algorithm']} c={r['concurrency']}"
        assert r["client"] == "host", where  # the default for a loopback-bound server
        assert r["completed"] == NUM_PROMPTS and r["failed"] == 0, where
        assert r["total_output_tokens"] == NUM_PROMPTS * MAX_NEW_TOKENS and r["output_tok_s"] > 0, where

    # The watch saw each server (it can see what it checks) and nothing exposed.
    assert watch.server_seen == names, watch.server_seen
    assert watch.exposed == {}, f"listening on a non-loopback address inside the hosts: {watch.exposed}"

    report = cli(*inv, "report", str(out), "--min-repeats", "1", "--csv", str(tmp_path / "results" / "netns.csv"))
    assert report.exit_code == 0, f"report exited {report.exit_code}:\n{report.stderr[-3000:]}\n{report.stdout[-3000:]}"
    assert f"Read {len(rows)} rows from 1 ledger(s)." in report.stdout
