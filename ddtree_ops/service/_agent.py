"""Remote side of the process manager: sent on stdin to the host's own Python.

Run through ddtree_ops/transport/hostprogram.py: its ``PAYLOAD`` is ``{"action": ...,
"args": {...}}``, on stdin (the server's ``env`` holds tokens: never on a command line),
and it answers one message with ``reply``. Stdlib only and Python 3.8-compatible, because
it runs with whatever interpreter the GPU host has. Every value is used as data (argv
lists for Popen, paths for open); the program text is a constant of ours.

One ``poll`` is one round trip that answers everything the readiness loop needs: is the
launched process alive, what did its log say since the last poll, who listens on the
port, and what do ``/health_generate`` and ``/server_info`` answer. ``smoke`` sends the
few generation requests that prove the server decodes (and speculates) before a restart
says ready.
"""

import errno
import json
import os
import signal
import socket
import time

LAUNCH_FILE = "launch.json"
# A bench sweep's launch is recorded here, not in LAUNCH_FILE: that keeps the host's own
# launch (what a bare ``restart`` repeats, what the sweep puts back at its end), whatever
# the sweep launched or however it ended. The record lives as long as its process: a stop,
# or a launch that is not a sweep's, removes it.
SWEEP_LAUNCH_FILE = "sweep-launch.json"
# What readiness reads from /server_info: identity, the DDTREE tree it resolved (the
# plugin's "ddtree" object; the generic fields; an older bundle's own fields), graph mode.
SERVER_INFO_KEYS = (
    "launch_command",
    "startup_time",
    "version",
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_eagle_topk",
    "speculative_ddtree_budget",
    "speculative_ddtree_topk",
    "ddtree",
    # The graph mode the server resolved (on a device without CUDA graphs, e.g. CPU,
    # SGLang disables them whatever was asked).
    "cuda_graph_config",
    # Live speculative state: the DDTree plugin's runtime states and the policy it follows.
    "internal_states",
)
LOG_FILE = "server.log"


def _run_dir(payload):
    path = os.path.expanduser(payload["run_dir"])
    os.makedirs(path, exist_ok=True)
    return path


def _proc_start(pid):
    """Kernel start time of pid (jiffies since boot), or None; guards against pid reuse."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def _proc_state(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()


def _alive(pid, pstart):
    if not pid:
        return False
    fields = _proc_state(pid)
    if fields is None:
        if os.path.isdir("/proc/self"):
            return False
        try:
            os.kill(pid, 0)
        except OSError as exc:
            return exc.errno == errno.EPERM
        return True
    if fields[0] in ("Z", "X"):
        return False
    if pstart is not None and fields[19] != pstart:
        return False
    return True


def _session_pids(sid):
    out = []  # type: list[int]
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        fields = _proc_state(int(name))
        # fields[3] is the session id (field 6 of /proc/pid/stat)
        if fields is not None and len(fields) > 3 and fields[3] == str(sid) and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return out


def _listen_inodes(port):
    inodes = set()
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        found_table = True
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            local, state, inode = parts[1], parts[3], parts[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes if found_table else None


def _listener_ours(port, sid):
    """True if a process of session ``sid`` holds the listening socket; None if unknowable."""
    inodes = _listen_inodes(port)
    if inodes is None:
        return None
    if not inodes or not sid:
        return False
    wanted = {"socket:[%s]" % i for i in inodes}
    for pid in _session_pids(sid):
        fd_dir = "/proc/%d/fd" % pid
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) in wanted:
                    return True
            except OSError:
                continue
    return False


def _port_open(host, port, timeout=0.5):
    try:
        sock = socket.create_connection((host, port), timeout)
    except OSError:
        return False
    sock.close()
    return True


def _http(host, port, path, timeout, body=None, limit=1 << 20):
    """GET ``path`` (POST of ``body`` as JSON when given): (status, at most ``limit`` bytes)."""
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(limit)
    finally:
        conn.close()


def _read_launch(run_dir, name=LAUNCH_FILE):
    try:
        with open(os.path.join(run_dir, name)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _live_sweep(run_dir):
    """The sweep launch record whose process still runs (SWEEP_LAUNCH_FILE), or None."""
    rec = _read_launch(run_dir, SWEEP_LAUNCH_FILE)
    return rec if isinstance(rec, dict) and _alive(rec.get("pid"), rec.get("pstart")) else None


def _record_launch(run_dir, record, sweep):
    """Write a fresh launch's record: a sweep's (``sweep``: its name, run id and lease token)
    to its own file, anything else to the host's launch record, which ends any sweep's."""
    if sweep:
        record["sweep"] = sweep
        _write_json(os.path.join(run_dir, SWEEP_LAUNCH_FILE), record)
        return
    _write_json(os.path.join(run_dir, LAUNCH_FILE), record)
    try:
        os.unlink(os.path.join(run_dir, SWEEP_LAUNCH_FILE))
    except OSError:
        pass


def _write_json(path, data):
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _tail(path, lines, max_bytes=65536):
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace").splitlines()
    return text[-lines:] if lines > 0 else []


def action_portcheck(p):
    return {"port_open": _port_open(p["probe_host"], p["port"])}


def action_start(p):
    run_dir = _run_dir(p)
    old = _live_sweep(run_dir) or _read_launch(run_dir)
    if old and _alive(old.get("pid"), old.get("pstart")):
        return {"error": "running", "pid": old.get("pid")}
    if p.get("check_port", True) and _port_open(p["probe_host"], p["port"]):
        return {"error": "port_busy"}
    log_path = os.path.join(run_dir, LOG_FILE)
    if os.path.exists(log_path):
        os.replace(log_path, log_path + ".prev")
    env = dict(os.environ)
    env.update(p.get("env") or {})
    import subprocess

    log = open(log_path, "ab")
    try:
        started_at = time.time()
        try:
            proc = subprocess.Popen(
                p["argv"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=run_dir,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            return {"error": "exec", "detail": "%s: %s" % (p["argv"][0], exc.strerror or exc)}
    finally:
        log.close()
    record = {
        "pid": proc.pid,
        "pstart": _proc_start(proc.pid),
        "argv": p["argv"],
        "argv_hash": p.get("argv_hash"),
        "launch_command": p.get("launch_command"),
        "env_keys": sorted((p.get("env") or {}).keys()),
        "started_at": started_at,
        "port": p["port"],
        "probe_host": p["probe_host"],
        "log": log_path,
        "cuda_graph": p.get("cuda_graph"),
        "run": p.get("run"),
    }
    _record_launch(run_dir, record, p.get("sweep"))
    return record


def action_poll(p):
    run_dir = _run_dir(p)
    pid, pstart = p["pid"], p.get("pstart")
    out = {"now": time.time(), "alive": _alive(pid, pstart)}
    log_path = os.path.join(run_dir, LOG_FILE)
    offset = int(p.get("offset", 0))
    try:
        with open(log_path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read(int(p.get("max_bytes", 262144)))
    except OSError:
        chunk = b""
    # Hand back whole lines only; a partial last line is read again next time.
    cut = chunk.rfind(b"\n") + 1
    out["log"] = chunk[:cut].decode("utf-8", "replace")
    out["offset"] = offset + cut
    out.update(_server_answers(p, pid))
    return out


def _server_answers(p, sid):
    """Who listens on the port (a process of session ``sid``?), and what /health_generate
    and /server_info answer: the part of a poll that does not depend on the manager."""
    out = {}
    host, port = p["probe_host"], p["port"]
    out["port_open"] = _port_open(host, port)
    out["listener_ours"] = _listener_ours(port, sid) if out["port_open"] else False
    out["health"] = None
    out["server_info"] = None
    if out["port_open"]:
        timeout = float(p.get("http_timeout", 5.0))
        try:
            status, _ = _http(host, port, "/health_generate", timeout)
            out["health"] = status
        except Exception as exc:  # any failure is an answer, not a crash of the probe
            out["health"] = "error: %s" % (exc,)
        if out["health"] == 200:
            try:
                status, body = _http(host, port, "/server_info", timeout)
                info = json.loads(body.decode("utf-8", "replace")) if status == 200 else {}
                out["server_info"] = dict(
                    {key: info.get(key) for key in SERVER_INFO_KEYS}, status=status
                )
            except Exception as exc:
                out["server_info"] = {"status": None, "error": str(exc)}
    return out


def _smoke_one(host, port, request, timeout, out, keep_tokens=False):
    """One /generate request of the smoke; ``out`` (a dict) receives its answer."""
    started = time.time()
    try:
        status, body = _http(host, port, "/generate", timeout, body=request, limit=1 << 22)
        out["status"] = status
        try:
            answer = json.loads(body.decode("utf-8", "replace"))
        except ValueError:
            answer = None
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        if isinstance(meta, dict):
            out["completion_tokens"] = meta.get("completion_tokens")
            out["spec_verify_ct"] = meta.get("spec_verify_ct")
        if keep_tokens and isinstance(answer, dict):
            # What a rollout's gate compares before and after a change: the tokens (the
            # text where a server gives no ids).
            ids = answer.get("output_ids")
            out["output_ids"] = ids[:4096] if isinstance(ids, list) else None
            text = answer.get("text")
            out["text"] = text[:20000] if isinstance(text, str) else None
            if isinstance(meta, dict):
                # ... and what it judges besides them: the server's own timing (e2e_latency
                # always; first_token_latency and decode_throughput with --enable-metrics), the
                # simulator's time scale (a compressed clock is no speed) and, where the request
                # asked for them (top_logprobs_num), each output position's best [token, logprob]
                # pairs (0.5.23's rows are [logprob, token_id, text]).
                for key in ("e2e_latency", "first_token_latency", "decode_throughput", "sim_time_scale"):
                    value = meta.get(key)
                    out[key] = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
                rows = meta.get("output_top_logprobs")
                if isinstance(rows, list):
                    out["top_logprobs"] = [
                        [[e[1], e[0]] for e in row[:20] if isinstance(e, (list, tuple)) and len(e) >= 2]
                        if isinstance(row, list) else None
                        for row in rows[:4096]
                    ]
        if status != 200:
            out["error"] = body.decode("utf-8", "replace")[:300]
    except socket.timeout:
        out["error"] = "timed out after %.0f s" % timeout
        out["timed_out"] = True
    except Exception as exc:  # a reset or refused connection is an answer, not a crash of the probe
        out["error"] = "%s: %s" % (type(exc).__name__, exc)
    out["seconds"] = time.time() - started


def action_smoke(p):
    """Send the smoke's rounds of /generate requests (each round's requests at once, so
    a round of several is one decode batch), stopping at the first round that fails;
    then say whether the launched process still lives."""
    import threading

    host, port, timeout = p["probe_host"], p["port"], float(p.get("request_timeout", 60.0))
    started = time.time()
    results = []
    for round_no, requests in enumerate(p["rounds"]):
        answers = [{"round": round_no} for _ in requests]
        threads = [
            threading.Thread(target=_smoke_one, args=(host, port, req, timeout, ans, bool(p.get("keep_tokens"))))
            for req, ans in zip(requests, answers)
        ]
        for t in threads:
            t.daemon = True
            t.start()
        for t in threads:
            t.join(timeout + 5.0)
        results.extend(answers)
        if any(a.get("error") or a.get("status") != 200 for a in answers):
            break
    seconds = time.time() - started
    alive = _alive(p["pid"], p.get("pstart"))
    # A connection cut without an answer is how a crashing server ends a request; SGLang's
    # launcher kills its tree a moment later. Give it that moment before saying it lives.
    if alive and any(a.get("error") and "status" not in a and not a.get("timed_out") for a in results):
        deadline = time.time() + float(p.get("death_grace", 5.0))
        while alive and time.time() < deadline:
            time.sleep(0.1)
            alive = _alive(p["pid"], p.get("pstart"))
    return {"results": results, "seconds": seconds, "alive": alive}


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
        return True
    except OSError:
        try:
            os.kill(pid, sig)
            return True
        except OSError:
            return False


def action_stop(p):
    run_dir = _run_dir(p)
    leased = _lease_refusal(run_dir, p)
    if leased is not None:
        return leased
    # What runs is a sweep's launch (its own record) or the host's: stop whichever lives.
    swept = _live_sweep(run_dir)
    out = _stop_launch(swept or _read_launch(run_dir), p)
    if out["exited"]:
        _record_gone(run_dir)
    return out


def _record_gone(run_dir):
    """Remove a sweep's launch record whose process is gone: the host's record stands."""
    path = os.path.join(run_dir, SWEEP_LAUNCH_FILE)
    if os.path.exists(path) and _live_sweep(run_dir) is None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _stop_launch(rec, p):
    """SIGTERM to the group of ``rec``'s process, SIGKILL after the grace period."""
    out = {"was_running": False, "pid": None, "signal": None, "waited_s": 0.0, "exited": True}  # type: dict[str, object]
    if not rec:
        return out
    pid, pstart = rec.get("pid"), rec.get("pstart")
    out["pid"] = pid
    if not _alive(pid, pstart):
        return out
    out["was_running"] = True
    grace = float(p.get("grace_s", 30.0))
    start = time.time()
    _signal_group(pid, signal.SIGTERM)
    out["signal"] = "SIGTERM"
    while time.time() - start < grace:
        if not _alive(pid, pstart) and not _session_pids(pid):
            break
        time.sleep(0.1)
    else:
        _signal_group(pid, signal.SIGKILL)
        out["signal"] = "SIGKILL"
        kill_start = time.time()
        while time.time() - kill_start < 10 and _alive(pid, pstart):
            time.sleep(0.05)
    out["waited_s"] = time.time() - start
    out["exited"] = not _alive(pid, pstart)
    return out


def action_status(p):
    """The launch record and whether its process lives; the port, its owner, health and
    ``/server_info`` as a poll reads them (what an observation of the host needs, in this
    one round trip)."""
    run_dir = _run_dir(p)
    rec = _read_launch(run_dir)
    out = {"record": rec, "alive": False}
    # ``record`` stays the host's launch while a sweep's runs; ``sweep`` and ``pid`` say
    # which process it is that runs (and answers on the port).
    swept = _live_sweep(run_dir)
    if swept:
        out["sweep"], out["pid"] = swept, swept.get("pid")
    live = swept or rec
    pid = live.get("pid") if live else None
    if live:
        out["alive"] = _alive(pid, live.get("pstart"))
        out["log_tail"] = _tail(live.get("log") or os.path.join(run_dir, LOG_FILE), int(p.get("lines", 5)))
    out.update(_server_answers(dict(p, http_timeout=5.0), pid if live else None))
    if not live:
        out.pop("listener_ours", None)
    return out


def action_logs(p):
    run_dir = _run_dir(p)
    path = os.path.join(run_dir, LOG_FILE)
    offset = p.get("offset")
    if offset is None:
        lines = _tail(path, int(p.get("lines", 50)))
        try:
            size = os.path.getsize(path)
        except OSError:
            size = 0
        return {"lines": lines, "offset": size, "exists": os.path.exists(path)}
    try:
        with open(path, "rb") as fh:
            fh.seek(int(offset))
            chunk = fh.read(262144)
    except OSError:
        return {"lines": [], "offset": offset, "exists": False}
    cut = chunk.rfind(b"\n") + 1
    return {"lines": chunk[:cut].decode("utf-8", "replace").splitlines(), "offset": int(offset) + cut, "exists": True}


LOCK_FILE = "restart.lock"


def _guarded(run_dir):
    """Exclusive flock on a side file: reading, judging and replacing the lock is one step.

    Without it two restarts that both found a dead holder could each remove the lock the
    other had just taken. The flock lives only as long as this short agent process.
    """
    import fcntl

    fd = os.open(os.path.join(run_dir, LOCK_FILE + ".guard"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _read_lock(path):
    try:
        with open(path) as fh:
            held = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"unreadable": str(exc)}
    return held if isinstance(held, dict) else {"unreadable": "not a JSON object"}


def action_lock(p):
    """Take the restart lock. An expired or unreadable lock is replaced, and so is a lock
    whose token equals ``take_over`` (the controller proved that holder dead)."""
    run_dir = _run_dir(p)
    path = os.path.join(run_dir, LOCK_FILE)
    guard = _guarded(run_dir)
    try:
        now = time.time()
        leased = _lease_blocks(run_dir, p)
        if leased is not None:
            return {"ok": False, "leased": leased, "now": now}
        record = {"token": p["token"], "holder": p.get("holder"), "taken_at": now,
                  "expires_at": now + float(p["ttl_s"])}
        held = _read_lock(path)
        if held is not None and "unreadable" not in held:
            expired = float(held.get("expires_at") or 0) <= now
            proven_dead = p.get("take_over") is not None and held.get("token") == p.get("take_over")
            if not (expired or proven_dead):
                return {"ok": False, "held": held, "now": now}
        # Whole record first, then one rename: a reader never sees a half-written lock.
        _write_json(path, record)
        return {"ok": True, "replaced": held}
    finally:
        os.close(guard)


def _remove_own(p, name):
    """Remove ``run_dir/name`` if it still carries ``p["token"]`` (never another holder's)."""
    run_dir = _run_dir(p)
    path = os.path.join(run_dir, name)
    guard = _guarded(run_dir)
    try:
        held = _read_lock(path)
        if not held or held.get("token") != p["token"]:
            return {"ok": False}
        os.unlink(path)
        return {"ok": True}
    finally:
        os.close(guard)


def action_unlock(p):
    return _remove_own(p, LOCK_FILE)


LEASE_FILE = "sweep.lease"


def _lease_blocks(run_dir, p):
    """The sweep lease that forbids this action, or None; call under :func:`_guarded`.

    ``p["lease"]`` says how the caller stands: ``token`` (its own lease: the sweep that
    holds it passes), ``force`` (an operator overriding it), ``clear`` (the token of a
    lease whose holder the controller proved dead: removed, then the action proceeds).
    Without ``p["lease"]`` nothing is checked (the caller already holds the restart lock).
    """
    lease = p.get("lease")
    if lease is None:
        return None
    path = os.path.join(run_dir, LEASE_FILE)
    held = _read_lock(path)
    if held is None or "unreadable" in held or held.get("token") == lease.get("token"):
        return None
    if lease.get("clear") is not None and held.get("token") == lease.get("clear"):
        os.unlink(path)
        return None
    if lease.get("force"):
        return None
    return held


def _lease_refusal(run_dir, p):
    """The answer that refuses a stop while another sweep holds the host, or None."""
    if p.get("lease") is None:
        return None
    guard = _guarded(run_dir)
    try:
        leased = _lease_blocks(run_dir, p)
    finally:
        os.close(guard)
    return None if leased is None else {"leased": leased, "now": time.time()}


def action_lease(p):
    """Take the host's sweep lease for ``p["token"]``: refused while another token holds
    it, unless that is the token in ``take_over`` (a holder proved dead)."""
    run_dir = _run_dir(p)
    path = os.path.join(run_dir, LEASE_FILE)
    guard = _guarded(run_dir)
    try:
        now = time.time()
        held = _read_lock(path)
        if held is not None and "unreadable" not in held and held.get("token") != p["token"] \
                and held.get("token") != p.get("take_over"):
            return {"ok": False, "leased": held, "now": now}
        _write_json(path, {"token": p["token"], "holder": p.get("holder"), "taken_at": now})
        return {"ok": True, "replaced": held}
    finally:
        os.close(guard)


def action_release(p):
    return _remove_own(p, LEASE_FILE)


def action_leasenote(p):
    """Keep ``note`` in the lease ``token`` holds (a sweep's record of what served before it,
    for the sweep that takes the lease over should this one die); ``ok`` False where the
    lease is another's or gone."""
    run_dir = _run_dir(p)
    path = os.path.join(run_dir, LEASE_FILE)
    guard = _guarded(run_dir)
    try:
        held = _read_lock(path)
        if not held or held.get("token") != p["token"]:
            return {"ok": False}
        held["note"] = p.get("note")
        _write_json(path, held)
        return {"ok": True}
    finally:
        os.close(guard)


def action_leaseinfo(p):
    held = _read_lock(os.path.join(_run_dir(p), LEASE_FILE))
    return {"lease": held if held is not None and "unreadable" not in held else None, "now": time.time()}


def action_putfile(p):
    """Write ``p["name"]`` (a plain file name) into the run dir, atomically, from the base64
    ``content`` of the payload: how a file reaches the host without SFTP, which not every
    sshd offers (Ansible too falls back to piping when it has none)."""
    import base64

    name = p["name"]
    if not name or "/" in name or name in (".", ".."):
        return {"error": "agent", "detail": "%r is not a plain file name" % (name,)}
    path = os.path.join(_run_dir(p), name)
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "wb") as fh:
        fh.write(base64.b64decode(p["content"]))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return {"path": path}


def action_version(p):
    """SGLang's installed version from package metadata, without importing sglang."""
    try:
        from importlib import metadata
    except ImportError:
        return {"sglang_version": None}
    try:
        return {"sglang_version": metadata.version("sglang")}
    except Exception:
        return {"sglang_version": None}


ACTIONS = {
    "lock": action_lock,
    "unlock": action_unlock,
    "lease": action_lease,
    "release": action_release,
    "leasenote": action_leasenote,
    "leaseinfo": action_leaseinfo,
    "version": action_version,
    "putfile": action_putfile,
    "start": action_start,
    "poll": action_poll,
    "stop": action_stop,
    "status": action_status,
    "logs": action_logs,
    "portcheck": action_portcheck,
    "smoke": action_smoke,
}


def main(payload):
    # A systemd host's program is the unit agent's text (its UNIT_ACTIONS) followed by this one.
    actions = dict(ACTIONS, **globals().get("UNIT_ACTIONS", {}))
    try:
        result = actions[payload["action"]](payload["args"])
    except Exception as exc:
        result = {"error": "agent", "detail": "%s: %s" % (type(exc).__name__, exc)}
    globals()["reply"](result)  # defined by the bootstrap (ddtree_ops/transport/hostprogram.py)


if __name__ == "__main__":
    main(globals()["PAYLOAD"])
