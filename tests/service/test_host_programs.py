"""Every program ddtree-ops runs on a host is framed one way (transport/hostprogram.py):
payload on stdin, one marked reply, everything else on stdout ignored.

Two properties, each on this machine and on a host of the SSH test fleet:

* a value of the inventory's ``env`` (where tokens live) never appears in any process's
  command line on the host, sampled from ``/proc/*/cmdline`` while a restart runs the
  service agent many times (it used to be the agent's JSON argv entry);
* a host whose Python talks on stdout before any program runs (a shell hook, a
  ``sitecustomize``) is probed, restarted, polled and benchmarked as any other (the agent's
  reply used to be parsed as bare stdout, so every call failed there).
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import replace
from pathlib import Path

from fleetlib import CHATTER, chatty_python

from ddtree_ops.bench.client import LoadSpec
from ddtree_ops.bench.onhost import HostClient
from ddtree_ops.inventory_types import Host
from ddtree_ops.probe import probe_host
from ddtree_ops.service import RunConfig, lifecycle
from ddtree_ops.service.lifecycle import LaunchFacts, RestartRequest
from ddtree_ops.transport.hostprogram import BOOTSTRAP
from ddtree_ops.workload.prompt import Prompt

DDTREE16 = RunConfig("DDTREE", budget=16, topk=4)
FAST = {"poll_interval_s": 0.2, "stop_grace_s": 5.0}


class CmdlineSampler:
    """Reads every process's command line on this machine (where the fleet's hosts run
    too) until stopped: what any local user of the host can read."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        self.seen.add(f.read())
                except OSError:
                    continue

    def __enter__(self) -> CmdlineSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_an_env_value_never_reaches_a_command_line_on_the_host(sim_target) -> None:
    secret = f"hf_{uuid.uuid4().hex}"
    host = sim_target.host(extra_env={"HF_TOKEN": secret})
    with CmdlineSampler() as sampler:
        result = lifecycle.restart(sim_target.transport, RestartRequest(host, DDTREE16, LaunchFacts("0.5.23"), **FAST))
        lifecycle.service_status(sim_target.transport, host)
    assert result.pid > 0
    agents = [c for c in sampler.seen if BOOTSTRAP.encode() in c]
    # Not vacuous: the sampler saw the agent run (start, polls, smoke) with the bootstrap.
    assert agents, "the sampler never caught a host program running"
    leaked = [c.replace(b"\0", b" ")[:300] for c in sampler.seen if secret.encode() in c]
    assert not leaked, leaked
    # ... while the server did get it, through its environment.
    environ = Path(f"/proc/{result.pid}/environ").read_bytes() if sim_target.kind == "local" else None
    if environ is not None:
        assert f"HF_TOKEN={secret}".encode() in environ.split(b"\0")


def _chatty(host: Host, bin_dir: Path) -> Host:
    wrapper = chatty_python(bin_dir, host.python)
    return replace(host, ddtree=replace(host.ddtree, python=str(wrapper)))


def test_a_host_whose_python_talks_on_stdout_works_like_any_other(sim_target, tmp_path) -> None:
    host = _chatty(sim_target.host(), tmp_path / "chatty")
    t = sim_target.transport
    # The noise is really there: a plain run of the interpreter prints it.
    assert CHATTER in t.run([host.python, "-c", "pass"], timeout=60, check=True).stdout

    facts = probe_host(t, host)
    assert facts.error is None and facts.python_version, facts
    result = lifecycle.restart(t, RestartRequest(host, DDTREE16, LaunchFacts("0.5.23"), **FAST))
    assert result.cuda_graph and result.smoke is not None and result.smoke.passed
    status = lifecycle.service_status(t, host)
    assert status.running and status.health == 200 and status.pid == result.pid

    client = HostClient(t, host)
    assert client.flush_cache()[0]
    info = client.server_info()
    assert info is not None and info["speculative_algorithm"] == "DDTREE"
    spec = LoadSpec(prompts=(Prompt("hello"), Prompt("tree")), max_new_tokens=8, sampling={"temperature": 0.0},
                    ignore_eos=True, concurrency=2)
    load = client.run_load(spec)
    assert [r.ok for r in load.results] == [True, True], load.results
    assert all(r.completion_tokens == 8 for r in load.results)
