"""Deploy latency over slow links: round trips, 1 host vs N in parallel, vs naive scp+ssh per file.

Starts N real sshd test hosts on loopback (tests/fleetlib.py) and puts a user-space
delaying TCP proxy in front of each (``tc netem`` is not available here): every chunk is
forwarded ``--rtt-ms / 2`` after it arrived, in each direction, without limiting
bandwidth. Then it measures, for the real ``patches/ddtree_temperature`` bundle:

- remote round trips per host for a fresh deploy and for a no-op re-deploy;
- wall time of a fresh deploy to 1 host vs N hosts in parallel (target: within 1.5x);
- the naive way, to 1 host: one ``ssh mkdir -p`` for the folders the files go into (the
  bundle's dist-info folder is new, and ``scp`` makes no folders), then one ``scp`` per file
  and one ``ssh`` (byte-compile) per Python file.

The bundle's verify commands are left out of the timed deploys (they import torch, which
costs seconds of CPU unrelated to the link); ``--with-verify`` keeps them.

    .venv/bin/python benchmarks/deploy_latency.py --hosts 4 --rtt-ms 50 --repeat 3
    .venv/bin/python benchmarks/deploy_latency.py --quick     # 2 hosts, +10 ms RTT, 1 repeat
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import posixpath
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from fleetlib import Fleet, build_fleet, known_hosts_line  # noqa: E402

from ddtree_ops.fleet import run_on_hosts  # noqa: E402
from ddtree_ops.inventory_types import Host  # noqa: E402
from ddtree_ops.patching.bundle import Bundle, load_bundle  # noqa: E402
from ddtree_ops.patching.executor import deploy, rollback  # noqa: E402
from ddtree_ops.transport import open_transport  # noqa: E402
from ddtree_ops.transport.base import RoundTripCounter  # noqa: E402


class DelayProxy:
    """Loopback TCP proxies that add a fixed one-way delay per direction.

    They run in a process of their own: the delay stands for the network, and in the
    controller's interpreter its event loop would wait for the GIL behind the controller's
    SSH threads, so that the more hosts the controller drives at once, the longer each
    packet's "link" would take (measured: a fresh deploy to 8 hosts at +50 ms RTT 1.74x
    one host's time with the proxy in the benchmark's process).
    """

    def __init__(self, one_way_s: float) -> None:
        # A plain interpreter, not multiprocessing's spawn (which would run the calling
        # script's module again): requests and answers are lines on its stdin and stdout.
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from deploy_latency import proxy_process; "
                "proxy_process(float(sys.argv[2]))")
        self._proc = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent), repr(one_way_s)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def add(self, target_port: int) -> int:
        """A proxy towards ``127.0.0.1:target_port``; its own loopback port."""
        return self.add_to("127.0.0.1", target_port)

    def add_to(self, address: str, port: int) -> int:
        """A proxy towards ``address:port`` (a namespace host's sshd); its loopback port."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"{address} {port}\n")
        self._proc.stdin.flush()
        got = self._proc.stdout.readline().strip()
        if not got.isdigit():
            raise OSError(f"delay proxy towards {address}:{port}: {got or 'the proxy process ended'}")
        return int(got)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # end of requests: the process closes its servers and exits
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)


def proxy_process(one_way_s: float) -> None:
    """The proxies' process: one event loop; a request per stdin line (``address port``),
    answered with the new proxy's loopback port on stdout; ends at the end of stdin."""

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def sender() -> None:
            while True:
                due, data = await q.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    w.close()
                    return
                w.write(data)
                await w.drain()

        task = asyncio.create_task(sender())
        try:
            while True:
                data = await r.read(1 << 16)
                q.put_nowait((loop.time() + one_way_s, data))
                if not data:
                    break
        finally:
            q.put_nowait((0.0, b""))  # a reset connection ends the sender too
            await asyncio.gather(task, return_exceptions=True)

    async def forward(cr: asyncio.StreamReader, cw: asyncio.StreamWriter, address: str, port: int) -> None:
        try:
            ur, uw = await asyncio.open_connection(address, port)
        except OSError:
            cw.close()
            return
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw), return_exceptions=True)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        # Connections still open at the end are cut: nothing to report about them.
        loop.set_exception_handler(lambda _loop, _context: None)
        servers = []
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            address, port = line.split()
            try:
                server = await asyncio.start_server(
                    lambda r, w, a=address, p=int(port): forward(r, w, a, p), "127.0.0.1", 0)
            except OSError as e:
                print(f"cannot listen: {e}", flush=True)
                continue
            servers.append(server)
            print(server.sockets[0].getsockname()[1], flush=True)
        for server in servers:
            server.close()
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    asyncio.run(serve())


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _busy_s() -> float:
    """CPU seconds this machine has spent busy (every process: /proc/stat, less idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Timed:
    """One timed run: its wall time, the machine's busy CPU time and the controller's own."""

    wall_s: float
    machine_cpu_s: float
    controller_cpu_s: float


def timed_cpu(fn: Callable[[], Any]) -> Timed:
    """``fn`` timed, with the CPU it cost: here the test hosts' sshd and host programs run on
    the controller's CPUs, so an N-host run needs at least machine_cpu_s / CPUs of wall time,
    however well the controller fans out."""
    r0, b0, t0 = resource.getrusage(resource.RUSAGE_SELF), _busy_s(), time.perf_counter()
    fn()
    wall, r1, b1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), _busy_s()
    return Timed(wall, b1 - b0, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)


def naive_deploy(fleet: Fleet, fh_index: int, port: int, bundle: Bundle) -> int:
    """What people do by hand: one ``ssh mkdir -p`` for the folders the files go into (the
    bundle's dist-info is new: scp does not create folders), then scp each file and ssh to
    byte-compile each Python file; a new connection each time. Returns the connections."""
    fh = fleet.hosts[fh_index]
    common = ["-i", str(fleet.client_key), "-o", f"UserKnownHostsFile={fleet.known_hosts}",
              "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes"]
    folders = sorted({posixpath.dirname(f"{fh.sglang_dir}/{f.path}") for f in bundle.files})
    subprocess.run(["ssh", *common, "-p", str(port), "root@127.0.0.1", "mkdir", "-p", *folders], check=True)
    connections = 1
    for f in bundle.files:
        target = f"{fh.sglang_dir}/{f.path}"
        subprocess.run(["scp", "-q", *common, "-P", str(port), f.source, f"root@127.0.0.1:{target}"], check=True)
        connections += 1
        if f.path.endswith(".py"):
            subprocess.run(["ssh", *common, "-p", str(port), "root@127.0.0.1", str(fh.python), "-m", "py_compile",
                            target], check=True)
            connections += 1
    return connections


def undo_naive(fleet: Fleet, fh_index: int, bundle: Bundle, new_folders: list[Path]) -> None:
    """Put the upstream files back (the host is local to this machine), and remove the
    folders the naive deploy made, so that the next fresh deploy starts from the same state."""
    fh = fleet.hosts[fh_index]
    for f in bundle.files:
        if f.op == "add":
            (fh.sglang_dir / f.path).unlink(missing_ok=True)
    template = next((REPO / ".cache" / "fleet-prefix").glob("sglang-*"))
    rel = fh.sglang_dir.relative_to(fh.prefix)
    for f in bundle.files:
        if f.op == "replace":
            shutil.copy2(template / rel / f.path, fh.sglang_dir / f.path)
    for folder in sorted(new_folders, key=lambda p: len(p.parts), reverse=True):
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--with-verify", action="store_true")
    ap.add_argument("--bundle", type=Path, default=REPO / "patches" / "ddtree_temperature")
    ap.add_argument("--quick", action="store_true", help="2 hosts, +10 ms RTT, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.rtt_ms, args.repeat = 2, 10.0, 1

    bundle = load_bundle(args.bundle)
    if not args.with_verify:
        bundle = dataclasses.replace(bundle, verify=())
    root = Path(tempfile.mkdtemp(prefix="ddtree-deploy-bench-"))
    fleet = build_fleet(root, [None] * args.hosts)
    proxy = DelayProxy(args.rtt_ms / 2000.0)
    try:
        inv = fleet.load()
        hosts: list[Host] = []
        ports: list[int] = []
        with fleet.known_hosts.open("a") as kh:
            for fh in fleet.hosts:
                pport = proxy.add(fh.port)
                ports.append(pport)
                kh.write(known_hosts_line(pport, fh.server.host_key) + "\n")
                hosts.append(dataclasses.replace(inv.hosts[fh.name], port=pport))

        def fresh(hs: list[Host]) -> dict[str, Any]:
            def one(h: Host) -> Any:
                with open_transport(h) as t:
                    out = deploy(t, h, bundle)
                assert out.outcome == "applied", out
                return out

            res = run_on_hosts(hs, one, max_parallel=len(hs))
            bad = [r for r in res.values() if isinstance(r, BaseException)]
            if bad:
                raise bad[0]
            return res

        def undo(hs: list[Host]) -> None:
            def one(h: Host) -> Any:
                with open_transport(h) as t:
                    return rollback(t, h)

            run_on_hosts(hs, one, max_parallel=len(hs))

        # Round trips.
        c_fresh, c_noop = RoundTripCounter(), RoundTripCounter()
        with open_transport(hosts[0], counter=c_fresh) as t:
            deploy(t, hosts[0], bundle)
        with open_transport(hosts[0], counter=c_noop) as t:
            noop_s = timed(lambda: deploy(t, hosts[0], bundle))
        undo(hosts[:1])

        naive: list[float] = []
        one_cpu: list[Timed] = []
        n_cpu: list[Timed] = []
        for _ in range(args.repeat):
            one_cpu.append(timed_cpu(lambda: fresh(hosts[:1])))
            undo(hosts[:1])
            n_cpu.append(timed_cpu(lambda: fresh(hosts)))
            undo(hosts)
            fh0 = fleet.hosts[0]
            new_folders = [d for d in {(fh0.sglang_dir / f.path).parent.resolve() for f in bundle.files}
                           if not d.exists()]
            started = time.perf_counter()
            connections = naive_deploy(fleet, 0, ports[0], bundle)
            naive.append(time.perf_counter() - started)
            undo_naive(fleet, 0, bundle, new_folders)

        med = statistics.median
        print(f"bundle {bundle.name} {bundle.short_identity}: {len(bundle.files)} files, "
              f"{sum(len(f.content) for f in bundle.files) / 1024:.0f} KiB, verify {'on' if bundle.verify else 'off'}")
        print(f"link: +{args.rtt_ms:g} ms RTT via user-space proxy; {args.repeat} repeats, medians")
        print(f"round trips per host: fresh deploy {c_fresh.commands} commands + {c_fresh.file_ops} file ops; "
              f"no-op re-deploy {c_noop.commands} + {c_noop.file_ops} ({noop_s:.2f} s)")
        one_host, n_hosts = [r.wall_s for r in one_cpu], [r.wall_s for r in n_cpu]
        print(f"fresh deploy, 1 host:            {med(one_host):6.2f} s"
              f"  (all: {', '.join(f'{x:.2f}' for x in one_host)})")
        print(f"fresh deploy, {args.hosts} hosts parallel:   {med(n_hosts):6.2f} s"
              f"  ratio {med(n_hosts) / med(one_host):.2f}x  (all: {', '.join(f'{x:.2f}' for x in n_hosts)})")
        cpus = os.cpu_count() or 1
        for label, runs in (("1 host", one_cpu), (f"{args.hosts} hosts", n_cpu)):
            busy = med([r.machine_cpu_s for r in runs])
            print(f"CPU of a fresh deploy, {label}: {busy:.2f} s on this machine ({cpus} CPUs: at least "
                  f"{busy / cpus:.2f} s of wall time), the controller's own "
                  f"{med([r.controller_cpu_s for r in runs]):.2f} s"
                  "; the rest is the test hosts' sshd and host programs")
        print(f"naive scp+ssh per file, 1 host:  {med(naive):6.2f} s  ({connections} connections; "
              f"{med(naive) / med(one_host):.1f}x slower, and no lock/backup/verify/atomicity)")
    finally:
        proxy.close()
        fleet.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
