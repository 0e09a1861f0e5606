"""Remote side of the systemd manager: the unit's actions, sent with the process agent.

On the host this text and :mod:`._agent`'s are ONE program (this one's part from the
``HOST PROGRAM`` marker on, then the agent's, whose ``main`` runs the action): the run-dir
helpers (locks, leases, the launch record), the HTTP probes and the smoke are the agent's,
and only what systemd does differently lives here. The import below is for linters only;
it never travels. Stdlib only, Python 3.8, every value used as data: ``systemctl`` and
``journalctl`` get argv lists, the drop-in and environment file are written from the
payload (on stdin) with ``open``, never through a shell.

What ddtree-ops owns on the host, and nothing else: one drop-in
``/etc/systemd/system/<unit>.d/50-ddtree-ops.conf`` (the launch it computed, as
``ExecStart=``) and the environment file it names, ``/etc/ddtree-ops/<unit>.env``
(0600: the inventory's ``env``, tokens included, never on a command line nor in the
drop-in). The operator's unit file is read, never written. A directory it makes for those
files (``<unit>.d/``, ``/etc/ddtree-ops/``) gets an empty mark file, ``.made-by-ddtree-ops``
(systemd reads only ``*.conf`` in a drop-in directory); removing our files removes such a
directory when nothing but the mark is left in it, and never a directory without the mark
(the operator's, or one an older ddtree-ops made), nor one that holds anything else.
"""

from ddtree_ops.service._agent import (  # noqa: F401 - names the host program shares, see the docstring
    _alive,
    _lease_refusal,
    _port_open,
    _proc_start,
    _read_launch,
    _record_launch,
    _run_dir,
    _server_answers,
    _write_json,
    LAUNCH_FILE,
    SWEEP_LAUNCH_FILE,
)

# HOST PROGRAM
import os
import shlex
import subprocess
import time

SHOW_PROPS = (
    "LoadState", "ActiveState", "SubState", "Result", "MainPID", "NRestarts", "InvocationID",
    "FragmentPath", "DropInPaths", "UnitFileState", "ExecMainStatus", "ExecMainCode", "User",
)
USER_UNIT_DIRS = ("~/.config/systemd/user", "/etc/systemd/user", "/usr/local/lib/systemd/user",
                  "/usr/lib/systemd/user", "/lib/systemd/user")
# The part of a unit's ExecStart that says it launches SGLang, whatever the interpreter.
SGLANG_MARKERS = ("sglang.launch_server",)


def _run(argv, timeout=60.0, stdin=None):
    """(exit code, stdout, stderr) of ``argv``; a missing program or a timeout is an answer."""
    try:
        done = subprocess.run(argv, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except OSError as exc:
        return 127, "", "%s: %s" % (argv[0], exc.strerror or exc)
    except subprocess.TimeoutExpired:
        return 124, "", "%s timed out after %.0f s" % (" ".join(argv[:3]), timeout)
    return done.returncode, done.stdout, done.stderr


# Every systemctl call puts "--" before the unit, and journalctl names it as --unit=: the
# inventory refuses a name that starts with "-", and here such a name still cannot become an
# option ("-Hroot@host.service" would be `systemctl -H root@host`, over SSH).
def _show(unit):
    code, out, err = _run(["systemctl", "show", "--no-pager"] + ["-p" + p for p in SHOW_PROPS] + ["--", unit],
                          timeout=30)
    if code != 0:
        return {"_error": (err or out).strip()[-300:] or "systemctl show exited %d" % code}
    props = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key] = value
    return props


def _dropin_path(p):
    return os.path.join(p.get("unit_dir") or "/etc/systemd/system", p["unit"] + ".d", "50-ddtree-ops.conf")


def _env_path(p):
    return os.path.join(p.get("env_dir") or "/etc/ddtree-ops", p["unit"] + ".env")


# A bench sweep's launch: a RUNTIME drop-in (under /run, gone at a reboot) that systemd
# applies after ours by its name, with its own env file under /run. Ours in /etc (or the
# operator's own ExecStart) stays what the unit runs once the sweep's launch ends: a stop
# or any launch that is not a sweep's removes these files.
SWEEP_DROPIN_NAME = "60-ddtree-ops-sweep.conf"


def _sweep_dropin_path(p):
    return os.path.join(p.get("runtime_unit_dir") or "/run/systemd/system", p["unit"] + ".d", SWEEP_DROPIN_NAME)


def _sweep_env_path(p):
    return os.path.join(p.get("runtime_env_dir") or "/run/ddtree-ops", p["unit"] + ".env")


def _dropins(props):
    return [d for d in props.get("DropInPaths", "").split() if d]


def _read_text(path):
    try:
        with open(path) as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def _exec_start(paths):
    """The ExecStart a unit runs, from its file and drop-ins in systemd's order: an empty
    ``ExecStart=`` clears what came before, a trailing backslash continues a line."""
    found = []
    for path in paths:
        text = _read_text(path) or ""
        section = None
        pending = ""
        for raw in text.splitlines():
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            if section == "Service" and sep and key.strip() == "ExecStart":
                value = value.strip()
                if value:
                    found.append(value)
                else:
                    found = []
    return found[-1] if found else None


def _words(exec_start):
    """An ExecStart as words, its prefixes (``-@:+!``) dropped; None when it cannot be split."""
    line = exec_start.lstrip("-@:+!|")
    try:
        return shlex.split(line)
    except ValueError:
        return None


def _is_sglang(words, markers):
    """Does this command line launch SGLang (``-m sglang.launch_server``, ``sglang serve``,
    or the inventory's own ``server.command`` module, e.g. a wrapper the operator names)?"""
    if not words:
        return False
    for i, word in enumerate(words):
        if word in markers and i > 0 and words[i - 1] == "-m":
            return True
        if os.path.basename(word) == "sglang" and i + 1 < len(words) and words[i + 1] == "serve":
            return True
    return False


def _user_unit(unit):
    """Where ``unit`` exists as a user unit (``systemd --user``), or None."""
    names = [unit]
    if "@" in unit:
        names.append(unit.split("@", 1)[0] + "@." + unit.rsplit(".", 1)[-1])
    for base in USER_UNIT_DIRS:
        for name in names:
            path = os.path.join(os.path.expanduser(base), name)
            if os.path.exists(path):
                return path
    return None


def _refusal(kind, detail):
    return {"error": "unit", "kind": kind, "detail": detail}


def _check(p):
    """(props, None) when ddtree-ops may drive the unit, else (props, refusal). Reads only."""
    unit = p["unit"]
    if not os.path.isdir("/run/systemd/system"):
        return {}, _refusal("no_systemd", "systemd is not the service manager of this host (no /run/systemd/system)")
    props = _show(unit)
    if "_error" in props:
        return props, _refusal("systemctl", "systemctl show %s failed: %s" % (unit, props["_error"]))
    load = props.get("LoadState")
    if load == "not-found":
        user = _user_unit(unit)
        if user is not None:
            return props, _refusal("user_unit", "%s is a user unit (%s), run by systemd --user; ddtree-ops drives "
                                   "system units: install it as a system unit" % (unit, user))
        return props, _refusal("not_found", "unit %s not found (systemctl list-unit-files shows the units there)"
                               % unit)
    if load == "masked" or props.get("UnitFileState") == "masked":
        return props, _refusal("masked", "unit %s is masked (systemctl unmask %s first)" % (unit, unit))
    if load != "loaded":
        return props, _refusal("not_loaded", "unit %s cannot be loaded (LoadState=%s)" % (unit, load))
    ours = (_dropin_path(p), _sweep_dropin_path(p))  # a sweep's runtime drop-in is ours too
    operator = [props.get("FragmentPath", "")] + [d for d in _dropins(props) if d not in ours]
    exec_start = _exec_start([path for path in operator if path])
    words = _words(exec_start) if exec_start else None
    markers = tuple(SGLANG_MARKERS) + tuple(p.get("markers") or ())
    if not _is_sglang(words, markers):
        shown = exec_start if exec_start else "none"
        return props, _refusal("not_sglang", "the ExecStart of %s is not an SGLang launch (%s); ddtree-ops only "
                               "replaces the launch of an SGLang server" % (unit, shown[:200]))
    props["_operator_exec_start"] = exec_start
    if os.geteuid() != 0:
        return props, _refusal("permission", "driving %s needs root on this host (the drop-in under "
                               "/etc/systemd/system and systemctl daemon-reload are root's); connect as root" % unit)
    return props, None


def _write_private(path, text, mode):
    """Write ``text`` to ``path`` atomically with ``mode`` from the first byte (a secret
    never sits in a file others can read, not even for a moment)."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, 0o700 if mode == 0o600 else 0o755)
    tmp = "%s.tmp%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _remove(path):
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# In a directory ddtree-ops made (see the module docstring): how a later removal knows it
# may take the directory away too. Emptiness alone cannot tell ours from an operator's.
MADE_MARK = ".made-by-ddtree-ops"


def _make_dirs(paths):
    """Create the missing directories of ``paths`` (files), each with our mark; 0700 for the
    env file's (it holds secrets), 0755 for the drop-in's. Returns those made."""
    made = []
    for path, mode in paths:
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            os.makedirs(directory, mode)
            os.close(os.open(os.path.join(directory, MADE_MARK), os.O_WRONLY | os.O_CREAT, 0o644))
            made.append(directory)
    return made


def _remove_made_dir(directory):
    """``directory`` removed when ddtree-ops made it (its mark) and holds nothing else; True
    when it is gone. An operator's file in it keeps it (rmdir refuses a non-empty one, so a
    file added after the look keeps it too)."""
    try:
        if os.listdir(directory) != [MADE_MARK]:
            return False
        os.unlink(os.path.join(directory, MADE_MARK))
        os.rmdir(directory)
        return True
    except OSError:
        return False


def _in_run_dir(text, run_dir):
    """The drop-in with ``WorkingDirectory=`` the run dir (as this host expands it): our
    launch runs there under either manager, so a file it names relatively (a sweep's
    runtime states) is found ("%" is a unit-file specifier, written "%%")."""
    line = "WorkingDirectory=" + os.path.abspath(run_dir).replace("%", "%%")
    return text.replace("[Service]\n", "[Service]\n" + line + "\n", 1)


def _configure(p):
    """Put our drop-in and environment file in place (``p["dropin"]`` text) or remove them
    (``None``), then daemon-reload. A failed reload puts the previous files back."""
    dropin, env_path = _dropin_path(p), _env_path(p)
    before = {dropin: _read_text(dropin), env_path: _read_text(env_path)}
    made = []
    try:
        _drop_sweep_files(p)  # a launch that is not a sweep's ends any sweep's (reloaded below)
        if p.get("dropin") is None:
            _remove(dropin)
            _remove(env_path)
        else:
            made = _make_dirs(((env_path, 0o700), (dropin, 0o755)))
            _write_private(env_path, p.get("env_file") or "", 0o600)
            _write_private(dropin, _in_run_dir(p["dropin"], _run_dir(p)), 0o644)
        code, out, err = _run(["systemctl", "daemon-reload"], timeout=120)
        if code != 0:
            raise RuntimeError("systemctl daemon-reload failed: %s" % (err or out).strip()[-300:])
    except BaseException as exc:
        for path, text in before.items():
            if text is None:
                _remove(path)
            else:
                _write_private(path, text, 0o600 if path == env_path else 0o644)
        _run(["systemctl", "daemon-reload"], timeout=120)
        for directory in made:  # made by this call, left empty by the restore
            _remove_made_dir(directory)
        return {"error": "configure", "detail": str(exc)}
    props = _show(p["unit"])
    in_effect = dropin in _dropins(props)
    if (p.get("dropin") is None) == in_effect:
        return {"error": "configure", "detail": "after daemon-reload systemd %s our drop-in %s" % (
            "still uses" if in_effect else "does not use", dropin)}
    if p.get("dropin") is None:
        # Only now: systemd has reloaded without our files, so nothing refers to the
        # directories; a failed removal above put the files back into them instead.
        removed = [d for d in (os.path.dirname(dropin), os.path.dirname(env_path)) if _remove_made_dir(d)]
        return {"ok": True, "removed_dirs": removed}
    return {"ok": True}


def _drop_sweep_files(p):
    """Remove a sweep's runtime drop-in and env file (and their directories under /run when
    left empty); True when there was one. The caller reloads systemd."""
    dropin, env_path = _sweep_dropin_path(p), _sweep_env_path(p)
    found = _remove(dropin)
    _remove(env_path)
    for directory in (os.path.dirname(dropin), os.path.dirname(env_path)):
        try:
            os.rmdir(directory)  # only an empty one
        except OSError:
            pass
    return found


def _configure_sweep(p):
    """A sweep's launch as the runtime drop-in, reloaded; our /etc drop-in and env file are
    left as they are. On a failure the runtime files are removed again."""
    dropin, env_path = _sweep_dropin_path(p), _sweep_env_path(p)
    try:
        _write_private(env_path, p.get("env_file") or "", 0o600)
        # Our drop-in's text, pointed at the runtime env file.
        text = ("# A bench sweep's launch: removed when its server is stopped, and at a reboot.\n"
                + p["dropin"].replace("EnvironmentFile=" + _env_path(p), "EnvironmentFile=" + env_path))
        _write_private(dropin, _in_run_dir(text, _run_dir(p)), 0o644)
        code, out, err = _run(["systemctl", "daemon-reload"], timeout=120)
        if code != 0:
            raise RuntimeError("systemctl daemon-reload failed: %s" % (err or out).strip()[-300:])
        if dropin not in _dropins(_show(p["unit"])):
            raise RuntimeError("after daemon-reload systemd does not use the sweep's drop-in %s" % dropin)
    except BaseException as exc:
        _drop_sweep_files(p)
        _run(["systemctl", "daemon-reload"], timeout=120)
        return {"error": "configure", "detail": str(exc)}
    return {"ok": True}


def _end_sweep_launch(p):
    """After a stop: a sweep's runtime drop-in and launch record go with its process."""
    if _drop_sweep_files(p):
        _run(["systemctl", "daemon-reload"], timeout=120)
    try:
        os.unlink(os.path.join(_run_dir(p), SWEEP_LAUNCH_FILE))
    except OSError:
        pass


def _journal(invocation, after=None, limit=None, unit=None, pid=None):
    """(lines, cursor) of the unit's output in one invocation, after ``after`` (a cursor).

    With ``unit`` and ``pid`` (the invocation's main process) also the lines of that
    process under the unit, whatever invocation they carry: journald tags a stream's line
    with the invocation it reads from /run/systemd/units/invocation:UNIT when it processes
    the line (systemd 252, journald-context.c, once the process is gone and its cgroup
    cannot be read), and on a loaded machine it processed a process's last lines after the
    unit had stopped (no invocation at all) or restarted (the next one's): the reason a
    server exited was missing from our error however long we waited."""
    if not invocation:
        return [], after
    argv = ["journalctl", "--no-pager", "-q", "-o", "cat", "--show-cursor", "_SYSTEMD_INVOCATION_ID=" + invocation]
    if unit and pid:
        argv += ["+", "_SYSTEMD_UNIT=" + unit, "_PID=%d" % int(pid)]
    if after:
        argv.append("--after-cursor=" + after)
    if limit is not None:
        argv += ["-n", str(int(limit))]
    code, out, _ = _run(argv, timeout=30)
    lines = out.splitlines()
    cursor = after
    if lines and lines[-1].startswith("-- cursor: "):
        cursor = lines.pop()[len("-- cursor: "):]
    return lines, cursor


def _journal_of_the_dead(invocation, limit=None, settle_s=5.0, unit=None, pid=None):
    """``_journal`` of an invocation whose process has already exited: one that exits at
    once (a flag SGLang refuses, an ExecStart systemd cannot run) can be gone before
    journald has read its last lines from the stream, and an error would say "log empty"
    where the journal is about to hold the reason. An empty answer is read again for up
    to ``settle_s``: on a loaded machine journald took longer than a second (CI, two cores
    at a load average near 5: SGLang's argparse error missing after 1 s of reads), and
    the wait is paid only where the answer stays empty. systemd 252 has no way to ask
    journald to drain a stream first (``journalctl --sync`` only writes what it has read)."""
    lines, cursor = _journal(invocation, limit=limit, unit=unit, pid=pid)
    deadline = time.time() + settle_s
    while not lines and invocation and time.time() < deadline:
        time.sleep(0.1)
        lines, cursor = _journal(invocation, limit=limit, unit=unit, pid=pid)
    return lines, cursor


def _wait_main_pid(unit, timeout_s=30.0):
    """The unit's properties once it has a main process, or has failed to get one."""
    deadline = time.time() + timeout_s
    props = _show(unit)
    while time.time() < deadline:
        if props.get("MainPID", "0") not in ("", "0") or props.get("ActiveState") in ("failed", "inactive"):
            return props
        time.sleep(0.1)
        props = _show(unit)
    return props


def _pre_exec(pid):
    """Whether pid is still systemd's child between its fork and the exec of the unit's
    command: MainPID is set at the fork, and until the exec the process runs systemd's
    binary (``systemd``; ``systemd-executor`` from systemd 255) named ``(<command>)``,
    its cmdline that name and NULs. Raises OSError once pid is gone."""
    with open("/proc/%d/comm" % pid) as fh:
        comm = fh.read().strip()
    try:
        exe = os.path.basename(os.readlink("/proc/%d/exe" % pid))
    except PermissionError:  # another user's process: its name alone tells
        exe = ""
    return (comm.startswith("(") and comm.endswith(")")) or exe in ("systemd", "systemd-executor")


def _exec_argv(pid, timeout_s=10.0):
    """The argv pid runs once it has exec'd its command ([] if it died first, or had not
    exec'd within timeout_s): read at once, it can be the forked manager's, which no server
    would ever report as its launch_command."""
    deadline = time.time() + timeout_s
    try:
        while _pre_exec(pid):
            if time.time() >= deadline:
                return []
            time.sleep(0.02)
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def _launched_record(p, props, started_at, operator):
    pid = int(props.get("MainPID") or 0)
    record = {
        "manager": "systemd",
        "unit": p["unit"],
        "invocation": props.get("InvocationID"),
        "pid": pid,
        "pstart": _proc_start(pid) if pid else None,
        "started_at": started_at,
        "port": p["port"],
        "probe_host": p["probe_host"],
        "log": "journalctl -u %s" % p["unit"],
        "operator": operator,
    }
    if operator:
        # What the unit's own ExecStart launched, read back from the process itself.
        record["argv"] = _exec_argv(pid)
        record["launch_command"] = None
        record["cuda_graph"] = None
        record["run"] = None
    else:
        for key in ("argv", "argv_hash", "launch_command", "cuda_graph", "run"):
            record[key] = p.get(key)
        record["env_keys"] = sorted(p.get("env_keys") or [])
    return record


def _start_unit(p, operator):
    unit = p["unit"]
    started_at = time.time()
    # --no-block: a Type=notify unit would hold systemctl until SGLang says READY=1, which
    # it never does; readiness is ours to judge, by polling.
    code, out, err = _run(["systemctl", "start", "--no-block", "--", unit], timeout=60)
    if code != 0:
        return {"error": "exec", "detail": "systemctl start %s: %s" % (unit, (err or out).strip()[-300:])}
    props = _wait_main_pid(unit)
    if props.get("MainPID", "0") in ("", "0"):
        lines, _ = _journal_of_the_dead(props.get("InvocationID") or "", limit=8)
        return {"error": "exec", "detail": "%s did not start (ActiveState=%s, Result=%s)%s" % (
            unit, props.get("ActiveState"), props.get("Result"),
            ("; journal: " + " | ".join(lines)) if lines else "")}
    record = _launched_record(p, props, started_at, operator)
    _record_launch(_run_dir(p), record, p.get("sweep"))
    return record


def action_unit_check(p):
    props, refusal = _check(p)
    if refusal is not None:
        return refusal
    return {"ok": True, "props": {k: v for k, v in props.items() if not k.startswith("_")},
            "operator_exec_start": props.get("_operator_exec_start")}


def action_unit_start(p):
    """Refusals first (nothing changed), then our drop-in and env file, daemon-reload,
    start, and the launch record with the unit's new main process."""
    props, refusal = _check(p)
    if refusal is not None:
        return refusal
    if props.get("ActiveState") in ("active", "activating", "reloading", "deactivating"):
        return {"error": "running", "pid": int(props.get("MainPID") or 0)}
    if p.get("check_port", True) and _port_open(p["probe_host"], p["port"]):
        return {"error": "port_busy"}
    sweep = p.get("sweep") and p.get("dropin") is not None
    configured = _configure_sweep(p) if sweep else _configure(p)
    if configured.get("error"):
        return configured
    return _start_unit(p, operator=p.get("dropin") is None)


def action_unit_configure(p):
    """Our drop-in written (or removed, ``dropin`` None) and reloaded; the unit not started."""
    _, refusal = _check(p)
    if refusal is not None:
        return refusal
    return _configure(p)


def action_unit_poll(p):
    pid, pstart = p["pid"], p.get("pstart")
    props = _show(p["unit"])
    alive = str(pid) == props.get("MainPID") and _alive(pid, pstart)
    out = {"now": time.time(), "alive": alive}
    if alive or p.get("offset"):
        # Alive, journald can read the process's cgroup: its lines carry their invocation.
        lines, cursor = _journal(p.get("invocation") or "", after=p.get("offset") or None,
                                 unit=None if alive else p["unit"], pid=None if alive else pid)
    else:
        lines, cursor = _journal_of_the_dead(p.get("invocation") or "", unit=p["unit"], pid=pid)
    out["log"] = "".join(line + "\n" for line in lines)
    out["offset"] = cursor or p.get("offset") or ""
    out["unit"] = {k: props.get(k) for k in ("ActiveState", "SubState", "Result", "MainPID", "NRestarts",
                                              "ExecMainStatus", "ExecMainCode")}
    out.update(_server_answers(p, pid))
    return out


def action_unit_stop(p):
    """``systemctl stop`` (the unit's own stop: ExecStop, KillMode), SIGKILL after the
    grace period; the lease is checked first, as for a process the agent launched."""
    run_dir = _run_dir(p)
    leased = _lease_refusal(run_dir, p)
    if leased is not None:
        return leased
    out = _stop_unit(p)
    if out["exited"]:
        _end_sweep_launch(p)
    return out


def _stop_unit(p):
    unit = p["unit"]
    props = _show(unit)
    pid = int(props.get("MainPID") or 0)
    out = {"was_running": False, "pid": pid or None, "signal": None, "waited_s": 0.0,
           "exited": True}  # type: dict[str, object]
    if props.get("ActiveState") not in ("active", "activating", "reloading", "deactivating"):
        return out
    out["was_running"] = True
    out["signal"] = "SIGTERM"
    start = time.time()
    _run(["systemctl", "stop", "--no-block", "--", unit], timeout=30)
    grace = float(p.get("grace_s", 30.0))
    while time.time() - start < grace:
        props = _show(unit)
        if props.get("ActiveState") in ("inactive", "failed"):
            break
        time.sleep(0.1)
    else:
        _run(["systemctl", "kill", "--signal=SIGKILL", "--", unit], timeout=30)
        out["signal"] = "SIGKILL"
        while time.time() - start < grace + 15:
            props = _show(unit)
            if props.get("ActiveState") in ("inactive", "failed"):
                break
            time.sleep(0.1)
    out["waited_s"] = time.time() - start
    out["exited"] = props.get("ActiveState") in ("inactive", "failed")
    return out


def action_unit_status(p):
    """The unit as systemd sees it (state, main pid, restarts, whether our drop-in is in
    effect) and as a client sees it (port, socket owner, health), with the journal's tail."""
    props = _show(p["unit"])
    rec = _read_launch(_run_dir(p))
    pid = int(props.get("MainPID") or 0)
    swept = _sweep_dropin_path(p) in _dropins(props)
    out = {
        "unit": {k: v for k, v in props.items() if not k.startswith("_")},
        "dropin": _dropin_path(p),
        "dropin_in_effect": _dropin_path(p) in _dropins(props),
        "record": rec,
        "alive": pid > 0 and props.get("ActiveState") in ("active", "activating", "reloading"),
        "pid": pid or None,
        "port_open": _port_open(p["probe_host"], p["port"]),
        # A sweep's launch in effect (its runtime drop-in): ``record`` stays the unit's own.
        "sweep_dropin_in_effect": swept,
        "sweep": _read_launch(_run_dir(p), SWEEP_LAUNCH_FILE) if swept else None,
    }
    if out["port_open"]:
        answers = _server_answers(dict(p, http_timeout=5.0), pid)
        out["listener_ours"] = answers["listener_ours"] if pid else False
        out["health"] = answers["health"]
        out["server_info"] = answers["server_info"]
    else:
        out["listener_ours"] = False
    lines = int(p.get("lines", 5))
    invocation = props.get("InvocationID")
    out["log_tail"] = _journal(invocation, limit=lines)[0] if invocation and lines > 0 else []
    return out


def _cursor_split(out):
    lines = out.splitlines()
    if lines and lines[-1].startswith("-- cursor: "):
        return lines[:-1], lines[-1][len("-- cursor: "):]
    return lines, None


def action_unit_logs(p):
    """``journalctl -u UNIT``: its last ``lines`` since the last launch (the record's time),
    or what came after ``offset`` (a journal cursor, for ``--follow``)."""
    base = ["journalctl", "--no-pager", "-q", "-o", "cat", "--unit=" + p["unit"]]
    offset = p.get("offset")
    if offset:
        code, out, err = _run(base + ["--show-cursor", "--after-cursor=" + offset], timeout=30)
        if code != 0:
            return {"error": "agent", "detail": "journalctl: %s" % (err or out).strip()[-300:]}
        lines, cursor = _cursor_split(out)
        return {"lines": lines, "offset": cursor or offset, "exists": True}
    # The newest entries since the launch: -n with --since counts from the start, so read
    # them newest first (-r) and turn them around; the cursor to follow from is the newest's.
    argv = base + ["-r", "-n", str(int(p.get("lines", 50)))]
    rec = _read_launch(_run_dir(p)) or {}
    if isinstance(rec.get("started_at"), (int, float)) and rec.get("unit") == p["unit"]:
        argv.append("--since=@%d" % int(rec["started_at"]))
    code, out, err = _run(argv, timeout=30)
    if code != 0:
        return {"error": "agent", "detail": "journalctl: %s" % (err or out).strip()[-300:]}
    lines = out.splitlines()[::-1]
    _, cursor = _cursor_split(_run(base + ["-n", "1", "--show-cursor"], timeout=30)[1])
    return {"lines": lines if int(p.get("lines", 50)) > 0 else [], "offset": cursor or "", "exists": True}


UNIT_ACTIONS = {
    "unit_check": action_unit_check,
    "unit_start": action_unit_start,
    "unit_configure": action_unit_configure,
    "unit_poll": action_unit_poll,
    "unit_stop": action_unit_stop,
    "unit_status": action_unit_status,
    "unit_logs": action_unit_logs,
}
