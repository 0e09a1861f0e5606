"""Deploy + restart on N network-namespace hosts behind slow links: ddtree-ops against
ansible-playbook with the ddtree.ops collection (forks = N), side by side.

The hosts are the test fleet's kind (tests/netnsfleet.py): one network namespace each, its
own address, its own sshd on port 22, its server (the simulator, compressed time) on the
namespace's own loopback. Each host's Python prefix is a small SGLang 0.5.23 install
(tests/minisglang.py: the wheel's own copies of the files the bundle touches, its
dist-info), so 32 hosts fit in memory. A user-space delaying TCP proxy in front of each
sshd (benchmarks/deploy_latency.py's; ``tc netem`` is not available here) adds ``--rtt-ms``
of round trip to every SSH connection, both tools alike.

For each N in ``--hosts``, from the same clean state (no bundle, no server):

* ``ddtree-ops deploy GROUP --restart --budget 4 --topk 4 --max-parallel N``;
* ``ansible-playbook`` of ``ddtree.ops.bundle`` then ``ddtree.ops.server`` (budget 4, top-k 4)
  with ``--forks N``, the collection built and installed with ansible-galaxy first;

wall time of each as a whole process (its start-up included), then the hosts checked: the
bundle in place and every server serving DDTREE budget=4 topk=4, ready (``ddtree-ops
status``/``service-status``). The ratio to one host says what the fan-out costs.

    .venv/bin/python benchmarks/ansible_scale.py --hosts 1 16 32 --rtt-ms 50
    .venv/bin/python benchmarks/ansible_scale.py --quick      # 1 and 2 hosts, +10 ms RTT

Needs root (network namespaces), sshd and ansible-core (the test extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import netnsfleet  # noqa: E402
from deploy_latency import DelayProxy  # noqa: E402
from fleetlib import public_key  # noqa: E402
from minisglang import expose_toolkit, make_prefix  # noqa: E402

BIN = Path(sys.executable).parent
TREE = ("4", "4")
PLAYBOOK = """
- hosts: bench
  gather_facts: false
  tasks:
    - ddtree.ops.bundle:
    - ddtree.ops.server:
        budget: {budget}
        topk: {topk}
"""


def run(argv: list[str], env: dict[str, str], *,
        timeout: float = 1800) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - started, proc


def must(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--quick", action="store_true", help="1 and 2 hosts, +10 ms RTT")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.rtt_ms = [1, 2], 10.0
    reason = netnsfleet.netns_unavailable()
    if reason is not None:
        raise SystemExit(f"cannot build namespace hosts: {reason}")
    root = Path(tempfile.mkdtemp(prefix="ddtree-ansible-scale-"))
    template = make_prefix(root / "template")
    expose_toolkit(template)
    netnsfleet.cached_prefix_template = lambda _wheel: template  # small prefixes: 32 hosts fit in memory
    fleet = netnsfleet.build_netns_fleet(root / "fleet", [None] * max(args.hosts))  # type: ignore[list-item]
    proxy = DelayProxy(args.rtt_ms / 2000.0)
    home = root / "ansible"
    home.mkdir()
    (home / "ansible.cfg").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")} | {
        "HOME": str(home), "ANSIBLE_CONFIG": str(home / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_COLLECTIONS_PATH": str(home / "collections"), "ANSIBLE_DEPRECATION_WARNINGS": "false",
        "DDTREE_OPS_STATE": str(root / "state.json"), "COLUMNS": "200",
    }
    figures: list[dict[str, Any]] = []
    try:
        _, built = run([str(BIN / "ddtree-ops"), "--json", "ansible-collection", "build", str(home / "dist")], env)
        must(built, "ddtree-ops ansible-collection build")
        tarball = json.loads(built.stdout)["data"]["tarball"]
        _, installed = run([str(BIN / "ansible-galaxy"), "collection", "install", "--offline", tarball, "-p",
                            str(home / "collections")], env)
        must(installed, "ansible-galaxy collection install")
        ports = {h.name: proxy.add_to(h.address, netnsfleet.SSH_PORT) for h in fleet.netns_hosts}
        fleet.known_hosts.write_text("".join(f"[127.0.0.1]:{ports[h.name]} {public_key(h.server.host_key)}\n"
                                             for h in fleet.netns_hosts))
        book = home / "deploy.yml"
        book.write_text(PLAYBOOK.format(budget=TREE[0], topk=TREE[1]))
        for n in args.hosts:
            members = fleet.netns_hosts[:n]
            inv = root / f"inventory-{n}.yml"
            inv.write_text(yaml.safe_dump(_inventory(fleet, members, ports)))
            cli = [str(BIN / "ddtree-ops"), "-i", str(inv), "--max-parallel", str(n)]
            row: dict[str, Any] = {"hosts": n, "rtt_ms": args.rtt_ms}
            for tool in ("ddtree-ops", "ansible-playbook"):
                _reset(cli, env)
                if tool == "ddtree-ops":
                    took, proc = run([*cli, "deploy", "bench", "--restart", "--budget", TREE[0], "--topk", TREE[1]],
                                     env)
                else:
                    took, proc = run([str(BIN / "ansible-playbook"), "-i", str(inv), "--forks", str(n), str(book)], env)
                must(proc, f"{tool} on {n} host(s)")
                _check(cli, env, members)
                row[tool] = round(took, 2)
            _reset(cli, env)
            figures.append(row)
            print(f"{n:3d} host(s), +{args.rtt_ms:g} ms RTT: ddtree-ops {row['ddtree-ops']:7.2f} s, "
                  f"ansible-playbook {row['ansible-playbook']:7.2f} s", file=sys.stderr, flush=True)
    finally:
        proxy.close()
        fleet.close()
        shutil.rmtree(root, ignore_errors=True)
    base = next((r for r in figures if r["hosts"] == 1), None)
    for r in figures:
        for tool in ("ddtree-ops", "ansible-playbook"):
            r[f"{tool} vs 1 host"] = round(r[tool] / base[tool], 2) if base else None
    if args.json:
        print(json.dumps({"rtt_ms": args.rtt_ms, "cpus": os.cpu_count(), "rows": figures}, indent=1))
        return
    print(f"deploy + restart (DDTREE budget={TREE[0]} topk={TREE[1]}), +{args.rtt_ms:g} ms RTT, {os.cpu_count()} CPUs")
    print(f"{'hosts':>5}  {'ddtree-ops':>10}  {'x 1 host':>8}  {'ansible-playbook':>16}  {'x 1 host':>8}")
    for r in figures:
        print(f"{r['hosts']:>5}  {r['ddtree-ops']:>9.2f}s  {r['ddtree-ops vs 1 host'] or 0:>7.2f}x  "
              f"{r['ansible-playbook']:>15.2f}s  {r['ansible-playbook vs 1 host'] or 0:>7.2f}x")


def _inventory(fleet: netnsfleet.NetnsFleet, members: list[netnsfleet.NetnsHost], ports: dict[str, int]) -> Any:
    """One inventory both tools read: each host through its proxy, every ``ddtree`` key at
    host level (Ansible replaces a dict variable whole), host keys checked by both."""
    hosts: dict[str, Any] = {}
    for h in members:
        server = {"command": "{python} -m ddtree_ops.sim", "model_path": "sim/qwen3-8b",
                  "draft_model_path": "sim/qwen3-8b-dflash", "port": 30000, "expected_load_s": 5,
                  "env": {**netnsfleet.FAST_SIM_ENV, "SIM_GPU": "rtx-pro-6000"}}
        hosts[h.name] = {"ansible_host": "127.0.0.1", "ansible_port": ports[h.name], "ddtree": {
            "python": str(h.python), "run_dir": str(h.run_dir), "known_hosts": str(fleet.known_hosts),
            "server": server}}
    group = {"ansible_user": "root", "ansible_ssh_private_key_file": str(fleet.client_key),
             "ansible_ssh_common_args": f"-o UserKnownHostsFile={fleet.known_hosts} -o StrictHostKeyChecking=yes"}
    return {"all": {"children": {"bench": {"vars": group, "hosts": hosts}}}}


def _reset(cli: list[str], env: dict[str, str]) -> None:
    """No server, no bundle: where each measured run starts."""
    _, stopped = run([*cli, "stop", "bench"], env)
    must(stopped, "ddtree-ops stop")
    _, rolled = run([*cli, "rollback", "bench"], env)
    must(rolled, "ddtree-ops rollback")


def _check(cli: list[str], env: dict[str, str], members: list[netnsfleet.NetnsHost]) -> None:
    """Every host done: the bundle in place, its server serving the tree, ready."""
    _, status = run([*cli, "--json", "status", "bench"], env)
    must(status, "ddtree-ops status")
    rows = json.loads(status.stdout)["data"]
    missing = [r["host"] for r in rows if not r.get("bundle") or r["service"].get("health") != 200]
    want = f"DDTREE budget={TREE[0]} topk={TREE[1]}"
    _, services = run([*cli, "--json", "service-status", "bench"], env)
    must(services, "ddtree-ops service-status")
    wrong = [h["host"] for h in json.loads(services.stdout)["data"]["hosts"] if (h.get("result") or {}).get("run")
             != want]
    if missing or wrong or len(rows) != len(members):
        raise SystemExit(f"not every host was done: no bundle or not ready {missing}, not serving {want} {wrong}")


if __name__ == "__main__":
    main()
