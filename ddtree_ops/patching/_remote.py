"""The program ddtree-ops runs on a host, with the host's own interpreter.

It is sent whole on stdin for every remote step (see :mod:`ddtree_ops.patching.remote`)
and is never imported on the controller. Values arrive as one JSON document after the
program text, never pasted into code. It uses only the standard library and syntax that
Python 3.8 accepts, because it runs on whatever interpreter the fleet has.

Files are named by keys relative to the package directory: a package path, or
``../<name>-<version>.dist-info/<file>`` for distribution metadata beside the package
(see :mod:`ddtree_ops.patching.bundle`). Nothing here trusts a key: each is parsed and
resolved again, with the checks of :func:`target_path`.

State lives outside the package directory, in ``<sys.prefix>/.ddtree-ops/``:

    state.json      what is applied: bundle, txn, when, by whom, per file original/patched
                    hashes, and the directories ddtree-ops created (removed again once empty)
    journal.json    present only while a transaction is in flight (or was cut)
    lock/           atomic mkdir; lock/info.json says who holds it
    backups/<txn>/  previous contents of every file a transaction overwrites

Every step answers one message (``reply``, transport/hostprogram.py), so that noise a
site-customize prints on stdout cannot be mistaken for the answer.
"""

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time

# py_compile and subprocess are imported where a step needs them (commit and rollback), and
# importlib.metadata only where a plain dist-info does not say the version: every step
# starts a fresh interpreter, and a gather paid 30 ms of CPU for imports it never used,
# three times a deploy on every host (README "Running from Ansible": fan-out).

TMP_PREFIX = ".ddtree-tmp-"
SITE_KEY_PREFIX = "../"
# Same pattern as the controller's bundle.DIST_INFO_RE (this file runs alone on the host).
DIST_INFO_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.]*)-([A-Za-z0-9_.!+]+)\.dist-info$")
SITE_DIR_NAMES = ("site-packages", "dist-packages")


class Refused(Exception):
    """A step declines on purpose; ``kind`` maps to a controller-side error class."""

    def __init__(self, kind, message, **extra):
        Exception.__init__(self, message)
        self.kind = kind
        self.message = message
        self.extra = extra


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path):
    # Same as the controller's helper; repeated because this file runs alone on the host.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"unreadable": str(exc)}


def state_dir():
    return os.path.join(sys.prefix, ".ddtree-ops")


def dist_name_key(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def is_site_key(key):
    return key.startswith(SITE_KEY_PREFIX)


class Package(object):
    """Where the target package is, found without importing it (imports are slow and may fail)."""

    def __init__(self, name):
        self.name = name
        self.dir = None
        self.locations = []
        self._site = None
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return
        self.locations = list(spec.submodule_search_locations)
        self.dir = os.path.realpath(self.locations[0])

    @functools.cached_property
    def version(self):
        """The installed distribution's version, read once, where a step needs it."""
        if self.dir is None:
            return None
        return self._beside_version(self.dir) or self._metadata_version()

    def _beside_version(self, pkg_dir):
        """``Version:`` of the one ``<name>-*.dist-info`` in the directory holding the package
        (where pip put it with these files); None when that is not one plain dist-info.

        importlib.metadata answers the same for such an install and costs 30 ms of imports;
        it still answers every other layout (egg-info, a dist-info elsewhere on sys.path).
        """
        parent = os.path.dirname(pkg_dir)
        want = dist_name_key(self.name)
        try:
            entries = os.listdir(parent)
        except OSError:
            return None
        found = []
        for e in entries:
            m = DIST_INFO_RE.match(e)
            if m and dist_name_key(m.group(1)) == want:
                found.append(e)
        if len(found) != 1:
            return None
        meta = os.path.join(parent, found[0], "METADATA")
        name = version = None
        try:
            with open(meta, "rb") as fh:
                for raw in fh:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if not line:
                        break  # the headers end at the first empty line
                    key, sep, value = line.partition(":")
                    if sep and key.lower() == "name":
                        name = value.strip()
                    elif sep and key.lower() == "version":
                        version = value.strip()
        except OSError:
            return None
        if name is None or dist_name_key(name) != want or not version:
            return None
        return version

    def _metadata_version(self):
        try:
            from importlib import metadata

            return metadata.version(self.name)
        except Exception:
            return None

    def site_dir(self):
        """The directory holding the package, where files keyed ``../`` go; Refused where that is unsafe.

        Accepted only when all of these hold:
        - the package is one plain directory sitting directly in it (one search location,
          not a symlink): an editable install or a symlinked checkout points elsewhere,
          and its parent is somebody's source tree;
        - it is named site-packages or dist-packages: the directories installers own and
          put *.dist-info into (a source checkout or PYTHONPATH entry is on sys.path too,
          but metadata written there would be litter in someone's tree);
        - it is on this interpreter's sys.path (compared resolved): only then does
          importlib.metadata in the server, which runs this interpreter, see what we add.
        """
        if self._site is not None:
            return self._site
        if self.dir is None:
            raise Refused("escape", "package %s is not installed" % self.name)
        if len(self.locations) != 1:
            raise Refused("escape", "package %s spans several directories (%s); refusing to write beside it"
                          % (self.name, ", ".join(self.locations)))
        loc = self.locations[0]
        parent = os.path.dirname(self.dir)
        if os.path.islink(loc) or not os.path.isdir(self.dir) or os.path.realpath(os.path.dirname(loc)) != parent:
            raise Refused("escape", "package %s is not a plain directory in its site-packages (%s -> %s, an editable"
                          " or linked install?); refusing to write beside it" % (self.name, loc, self.dir))
        if os.path.basename(parent) not in SITE_DIR_NAMES:
            raise Refused("escape", "%s, which holds package %s, is not a site-packages or dist-packages directory"
                          " (an editable install?); refusing to write beside it" % (parent, self.name))
        on_path = {os.path.realpath(p) for p in sys.path if p}
        if parent not in on_path:
            raise Refused("escape", "%s, which holds package %s, is not a directory on %s's sys.path;"
                          " refusing to write beside it" % (parent, self.name, sys.executable))
        self._site = parent
        return parent


def target_path(pkg, key, is_dir=False):
    """Absolute path of the file (or directory) ``key`` names, refusing anything that could lead out of its place.

    A package key stays inside the package directory; a ``../`` key stays inside its
    ``<name>-<version>.dist-info`` directory (not the target package's own) in the
    directory holding the package. Symlinked parents that resolve elsewhere, and the
    target itself being a symlink, are refused.
    """
    if is_site_key(key):
        rel = key[len(SITE_KEY_PREFIX):]
        parts = rel.split("/")
        m = DIST_INFO_RE.match(parts[0])
        if (len(parts) < (1 if is_dir else 2) or m is None or any(p in ("", ".", "..") for p in parts)
                or "\\" in rel):
            raise Refused("escape", "%s is not inside a <name>-<version>.dist-info directory" % key)
        if dist_name_key(m.group(1)) == dist_name_key(pkg.name):
            raise Refused("escape", "%s is inside %s's own metadata directory" % (key, pkg.name))
        root = pkg.site_dir()
        where = "its dist-info directory"
    else:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise Refused("escape", "%s is not a plain path inside the package directory" % key)
        root = pkg.dir
        where = "the package directory"
    full = os.path.join(root, *parts)
    expected = os.path.dirname(full)
    parent = os.path.realpath(expected)
    if is_site_key(key):
        ok = parent == expected  # no symlink anywhere below site-packages
    else:
        ok = parent == root or parent.startswith(root + os.sep)
    if not ok:
        raise Refused("escape", "%s resolves outside %s (%s)" % (key, where, parent))
    if os.path.islink(full):
        raise Refused("escape", "%s is a symlink; refusing to replace it" % key)
    return full


def backup_relpath(key):
    # Same as the controller's bundle.backup_relpath: '.ddtree-' names are never package paths.
    if is_site_key(key):
        return ".ddtree-site-packages/" + key[len(SITE_KEY_PREFIX):]
    return key


def file_sha(pkg, rel):
    try:
        full = target_path(pkg, rel)
    except Refused as exc:
        return "escape:" + exc.message
    if not os.path.exists(full):
        return None
    if not os.path.isfile(full):
        return "notfile:"
    return sha256_file(full)


def lock_info():
    lock = os.path.join(state_dir(), "lock")
    if not os.path.isdir(lock):
        return None
    info = read_json(os.path.join(lock, "info.json"))
    if info is None:
        # Between mkdir and writing info.json, or a holder that died right there.
        info = {"unreadable": "lock directory without info.json"}
    try:
        info["age_s"] = time.time() - os.stat(lock).st_mtime
    except OSError:
        pass
    info["remote_alive"] = pid_alive(info.get("remote_pid"))
    return info


def pid_alive(pid):
    """Whether a step process that held the lock still runs here (its connection may be gone, it may not)."""
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            # A reused pid is some other program; our steps run `python -c <bootstrap naming ddtree-ops>`.
            return b"<ddtree-ops>" in fh.read()
    except OSError:
        return True  # no /proc: assume alive, the safe side


def acquire_lock(holder, break_txn):
    sd = state_dir()
    os.makedirs(sd, exist_ok=True)
    lock = os.path.join(sd, "lock")
    try:
        os.mkdir(lock)
    except FileExistsError:
        current = lock_info() or {}
        if break_txn is not None and current.get("txn") == break_txn:
            shutil.rmtree(lock, ignore_errors=True)
            os.mkdir(lock)
        else:
            raise Refused("locked", "host is locked by another deploy", holder=current) from None
    write_json_atomic(os.path.join(lock, "info.json"), dict(holder, remote_pid=os.getpid()))


def check_lock(txn):
    info = lock_info()
    if info is None or info.get("txn") != txn:
        raise Refused("lost_lock", "the deploy lock is no longer ours (held by %r)" % (info,))
    info.pop("age_s", None)
    info.pop("remote_alive", None)
    info["remote_pid"] = os.getpid()
    write_json_atomic(os.path.join(state_dir(), "lock", "info.json"), info)


def release_lock():
    shutil.rmtree(os.path.join(state_dir(), "lock"), ignore_errors=True)


def unlink_quietly(path):
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def is_empty_dir(d):
    """True if nothing but an empty __pycache__ is left in ``d`` (a byte-compile of what was removed)."""
    try:
        names = os.listdir(d)
        return not names or (names == ["__pycache__"] and not os.listdir(os.path.join(d, "__pycache__")))
    except OSError:
        return False


def remove_if_empty(d):
    """Remove a directory ddtree-ops created (with its __pycache__, ours too) once nothing is left in it."""
    if is_empty_dir(d):
        try:
            if os.path.isdir(os.path.join(d, "__pycache__")):
                os.rmdir(os.path.join(d, "__pycache__"))
            os.rmdir(d)
        except OSError:
            pass


def remove_created_dirs(entries):
    """Directories a transaction created for added files, removed again if they are empty."""
    for e in reversed(entries):
        for d in reversed(e.get("created_dirs", [])):
            remove_if_empty(d)


def recompile(full, key):
    # Files beside the package are distribution metadata, never imported: nothing to compile.
    if full.endswith(".py") and not is_site_key(key):
        import py_compile

        py_compile.compile(full, doraise=True)


def drop_pyc(full):
    if full.endswith(".py"):
        try:
            os.unlink(importlib.util.cache_from_source(full))
        except OSError:
            pass


# ---------------------------------------------------------------------------- steps


# How many times a gather reads the state directory again when it changed under it (a
# deploy's lock came or went while the files were hashed); each further pass most likely
# finds the next transaction's lock, which ends the reading.
GATHER_PASSES = 50


def dir_stamp(path):
    """What changes whenever an entry of ``path`` is created, removed or replaced: the lock
    directory taken or dropped, the journal or the state record written. None: no directory."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def do_gather(p):
    """Everything a plan needs, as one consistent snapshot.

    The lock and the journal are read first, then the state record and the hashes, then
    the lock and the journal again together with the state directory's stamp. A snapshot
    with no lock nor journal is answered only when nothing changed in the state directory
    while it was read: otherwise another deploy took or dropped its lock meanwhile (it may
    have committed between the state record and the hashes), and everything is read again.
    A snapshot that shows a lock or a journal is answered as it is: the plan refuses it
    ("recover") and the controller waits for the lock or recovers the journal first.
    The prepare step checks the snapshot again under the lock (``expect_state``,
    ``expect_files``), so nothing read here is acted on once it no longer holds.
    """
    pkg = Package(p["package"])
    sd = state_dir()
    jpath = os.path.join(sd, "journal.json")
    for _pass in range(GATHER_PASSES):
        stamp = dir_stamp(sd)
        lock = lock_info()
        journal = read_json(jpath)
        state = read_json(os.path.join(sd, "state.json"))
        paths = list(p.get("paths", []))
        if isinstance(state, dict):
            for rel in (state.get("files") or {}):
                if rel not in paths:
                    paths.append(rel)
        files = {}
        if pkg.dir is not None:
            for rel in paths:
                files[rel] = file_sha(pkg, rel)
        if lock is not None or journal is not None:
            break
        if dir_stamp(sd) == stamp and lock_info() is None and not os.path.exists(jpath):
            break
        time.sleep(0.02)
    else:
        raise Refused("busy", "the state directory %s kept changing while it was read (%d passes)"
                      % (sd, GATHER_PASSES))
    writable = bool(pkg.dir and os.access(pkg.dir, os.W_OK))
    site_dir = None
    if pkg.dir is not None and any(is_site_key(rel) for rel in paths):
        try:
            site_dir = pkg.site_dir()
        except Refused:
            pass  # each such file's hash already says why (an "escape:" answer)
        else:
            writable = writable and os.access(site_dir, os.W_OK)
    return {
        "python": sys.executable,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "prefix": sys.prefix,
        "state_dir": sd,
        "package_dir": pkg.dir,
        "site_dir": site_dir,
        "version": pkg.version,
        "writable": writable,
        "files": files,
        "state": state,
        "journal": journal,
        "lock": lock,
    }


def check_snapshot(pkg, p):
    """Under the lock: is the host still what the plan was made from? The state record as
    gathered (``expect_state``) and every hash gathered (``expect_files``), the files the
    plan leaves alone included: a plan made before another deploy's commit would otherwise
    write its state record over that deploy's (and lose its backups of the originals)."""
    if "expect_state" not in p:
        return
    state = read_json(os.path.join(state_dir(), "state.json"))
    if state != p["expect_state"]:
        raise Refused("stale", "the state record changed since the plan was made (another deploy or rollback "
                               "committed meanwhile)")
    for rel, sha in sorted((p.get("expect_files") or {}).items()):
        current = file_sha(pkg, rel)
        if current != sha:
            raise Refused("stale", "%s changed since the plan was made (now %s)" % (rel, current))


def _cleanup_prepared(entries, txn):
    for e in entries:
        unlink_quietly(e.get("temp"))
    remove_created_dirs(entries)
    shutil.rmtree(os.path.join(state_dir(), "backups", txn), ignore_errors=True)


def do_prepare(p):
    """Lock, back up, upload temps beside their targets, verify them, write the journal.

    Nothing in the package directory changes here except new temp files (dot-named, so
    never imported); on any failure they and the backups are removed and the lock freed.
    """
    pkg = Package(p["package"])
    if pkg.dir is None:
        raise Refused("missing", "package %s is not installed for %s" % (p["package"], sys.executable))
    txn = p["txn"]
    sd = state_dir()
    acquire_lock(p["holder"], p.get("break_txn"))
    entries = []
    try:
        if os.path.exists(os.path.join(sd, "journal.json")):
            raise Refused("journal", "a journal from an interrupted deploy is present; recover first")
        check_snapshot(pkg, p)
        backup_root = os.path.join(sd, "backups", txn)
        for f in p["files"]:
            rel = f["path"]
            full = target_path(pkg, rel)
            current = file_sha(pkg, rel)
            if current != f["expect_sha"]:
                raise Refused("changed", "%s changed since the plan was made (now %s)" % (rel, current))
            entry = {"path": rel, "target": full, "prev_sha": current, "new_sha": f["new_sha"],
                     "temp": None, "backup": None, "created_dirs": []}
            entries.append(entry)
            if current is not None:
                backup = os.path.join(backup_root, *backup_relpath(rel).split("/"))
                os.makedirs(os.path.dirname(backup), exist_ok=True)
                shutil.copy2(full, backup)
                if sha256_file(backup) != current:
                    raise Refused("io", "backup of %s does not match its source" % rel)
                entry["backup"] = backup
            if f["new_sha"] is None:
                continue  # a deletion (restoring an added file's absence)
            parent = os.path.dirname(full)
            missing = []
            d = parent
            while not os.path.isdir(d):
                missing.append(d)
                d = os.path.dirname(d)
            for d in reversed(missing):
                os.mkdir(d)
                entry["created_dirs"].append(d)
            temp = os.path.join(parent, TMP_PREFIX + txn[:12] + "-" + os.path.basename(full))
            entry["temp"] = temp
            if f.get("from_backup"):
                shutil.copyfile(f["from_backup"], temp)
            else:
                import base64

                with open(temp, "wb") as fh:
                    fh.write(base64.b64decode(f["content_b64"]))
                    fh.flush()
                    os.fsync(fh.fileno())
            mode = os.stat(full).st_mode & 0o7777 if current is not None else 0o644
            os.chmod(temp, mode)
            got = sha256_file(temp)
            if got != f["new_sha"]:
                raise Refused("io", "uploaded %s has sha256 %s, expected %s" % (rel, got, f["new_sha"]))
        for e in entries:
            if e["temp"]:
                fsync_dir(os.path.dirname(e["temp"]))
        journal = {"txn": txn, "phase": "prepared", "entries": entries, "new_state": p["new_state"],
                   "keep_backups": p.get("keep_backups", []), "drop_backups": p.get("drop_backups", []),
                   "dirs": _our_dirs(pkg, entries), "created": time.time()}
        write_json_atomic(os.path.join(sd, "journal.json"), journal)
    except BaseException:
        _cleanup_prepared(entries, txn)
        release_lock()
        raise
    return {"txn": txn, "prepared": [e["path"] for e in entries]}


def _our_dirs(pkg, entries):
    """Directories ddtree-ops created, by this transaction or (per the state record) an earlier one.

    As [key, absolute path] pairs. A committed transaction removes those left empty (an
    empty ``*.dist-info`` would still be listed by importlib.metadata as a nameless
    distribution) and records the rest, so a later rollback removes them once emptied.
    A recorded directory that cannot be resolved safely any more is kept, untouched.
    """
    state = read_json(os.path.join(state_dir(), "state.json"))
    recorded = state.get("created_dirs") if isinstance(state, dict) else None
    out = []
    for key in recorded if isinstance(recorded, list) else []:
        try:
            out.append([key, target_path(pkg, key, is_dir=True)])
        except Refused:
            out.append([key, None])
    for e in entries:
        for d in e["created_dirs"]:
            key = os.path.relpath(d, pkg.dir).replace(os.sep, "/")
            if key not in [k for k, _ in out]:
                out.append([key, d])
    return out


def _rollback_entries(entries):
    """Put every entry back to its previous content; returns paths that could not be."""
    problems = []
    for e in entries:
        full = e["target"]
        cur = sha256_file(full) if os.path.isfile(full) else None
        if cur == e["prev_sha"]:
            pass
        elif cur == e["new_sha"] or (e["new_sha"] is None and cur is None):
            if e["prev_sha"] is None:
                os.unlink(full)
                drop_pyc(full)
            else:
                tmp = full + ".ddtree-restore"
                shutil.copy2(e["backup"], tmp)
                os.replace(tmp, full)
                try:
                    recompile(full, e["path"])
                except Exception:
                    pass
        else:
            problems.append("%s is neither its previous nor its new content" % e["path"])
        unlink_quietly(e.get("temp"))
        fsync_dir(os.path.dirname(full))
    remove_created_dirs(entries)
    return problems


def _finish(journal, *, committed):
    sd = state_dir()
    txn = journal["txn"]
    if committed:
        # Directories we created and nothing of ours fills any more (deepest first).
        for _key, d in sorted(journal.get("dirs") or [], key=lambda kd: -len(kd[1] or "")):
            if d:
                remove_if_empty(d)
        # Keep only backups the new state refers to (originals); others were transient.
        keep = set(journal.get("keep_backups", []))
        for e in journal["entries"]:
            b = e.get("backup")
            if b and b not in keep:
                try:
                    os.unlink(b)
                except OSError:
                    pass
        for old in journal.get("drop_backups", []) or []:
            try:
                os.unlink(old)
            except OSError:
                pass
    else:
        shutil.rmtree(os.path.join(sd, "backups", txn), ignore_errors=True)
    # Empty backup directories carry no information; remove them bottom-up.
    for dirpath, _dirnames, _filenames in os.walk(os.path.join(sd, "backups"), topdown=False):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass
    try:
        os.unlink(os.path.join(sd, "journal.json"))
    except FileNotFoundError:
        pass
    fsync_dir(sd)
    release_lock()


def do_commit(p):
    """Rename every temp into place, byte-compile, verify, record the state, drop the journal."""
    import py_compile
    import subprocess

    sd = state_dir()
    txn = p["txn"]
    check_lock(txn)
    jpath = os.path.join(sd, "journal.json")
    journal = read_json(jpath)
    if not journal or journal.get("txn") != txn:
        raise Refused("journal", "no journal for transaction %s" % txn)
    journal["phase"] = "committing"
    write_json_atomic(jpath, journal)
    entries = journal["entries"]
    try:
        for e in entries:
            if e["temp"]:
                os.replace(e["temp"], e["target"])
            else:
                os.unlink(e["target"])
                drop_pyc(e["target"])
        for e in entries:
            fsync_dir(os.path.dirname(e["target"]))
        for e in entries:
            if e["temp"]:
                try:
                    recompile(e["target"], e["path"])
                except py_compile.PyCompileError as exc:
                    raise Refused("verify", "%s does not compile: %s"
                                  % (e["path"], str(exc).strip().splitlines()[-1])) from exc
        for argv in p.get("verify", []):
            try:
                proc = subprocess.run([sys.executable] + list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      timeout=p.get("verify_timeout", 300), cwd=sd)
            except subprocess.TimeoutExpired as exc:
                raise Refused("verify", "verify command timed out: %s" % " ".join(argv)) from exc
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).decode("utf-8", "replace").strip().splitlines()[-3:]
                raise Refused("verify", "verify command failed (exit %d): %s — %s"
                              % (proc.returncode, " ".join(argv)[:200], " | ".join(tail)))
    except BaseException as exc:
        problems = _rollback_entries(entries)
        if problems:
            # Leave the journal: a person (or the next run) must look at it.
            raise Refused("recover", "rollback after failure left problems: %s" % "; ".join(problems)) from exc
        _finish(journal, committed=False)
        if isinstance(exc, Refused):
            raise
        raise Refused("io", "commit failed and was rolled back: %s" % (exc,)) from exc
    new_state = journal["new_state"]
    if new_state:
        new_state = dict(new_state)
        new_state["txn"] = txn
        new_state["applied_at"] = time.time()
        # Those left empty are removed by _finish; a cleared record forgets the others.
        new_state["created_dirs"] = sorted(k for k, d in journal.get("dirs") or []
                                           if d is None or (os.path.isdir(d) and not is_empty_dir(d)))
        write_json_atomic(os.path.join(sd, "state.json"), new_state)
    placed_removed = []
    if not new_state:
        try:
            os.unlink(os.path.join(sd, "state.json"))
        except FileNotFoundError:
            pass
        # Files placed beside the bundle (a tuned policy) are read by its plugin only: with
        # the bundle gone, a launch that named one would come up half-changed.
        placed_removed = _remove_placed(sd)
    _finish(journal, committed=True)
    return {"txn": txn, "files": {e["path"]: (sha256_file(e["target"]) if os.path.isfile(e["target"]) else None)
                                  for e in entries}, "placed_removed": placed_removed}


def _remove_placed(sd):
    """Remove ``<state_dir>/placed/`` and say which files it held."""
    folder = os.path.join(sd, PLACED_DIR)
    if not os.path.isdir(folder) or os.path.islink(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) or os.path.islink(path):
            os.unlink(path)
            removed.append(path)
    remove_if_empty(folder)
    return removed


def do_recover(p):
    """Bring an interrupted transaction to a consistent end, deterministically.

    If the state record already names the journal's transaction, the commit had finished
    everything but the cleanup: finish it. Otherwise roll every entry back to its
    previous content: a half-applied transaction never counts as applied.
    """
    sd = state_dir()
    jpath = os.path.join(sd, "journal.json")
    journal = read_json(jpath)
    lock = lock_info()
    if lock is not None and lock.get("txn") != p.get("break_txn"):
        raise Refused("locked", "host is locked by another deploy", holder=lock)
    if lock is not None and lock.get("remote_alive"):
        # Its controller is gone but the step itself still runs here: let it finish first.
        raise Refused("busy", "a step of that deploy is still running on the host (pid %s)" % lock.get("remote_pid"),
                      holder=lock)
    if journal is None:
        release_lock()
        return {"outcome": "lock-released" if lock is not None else "nothing"}
    # Recovery holds the lock itself, so no deploy can start while files are put back.
    acquire_lock(p["holder"], lock.get("txn") if lock is not None else None)
    try:
        if "unreadable" in journal:
            raise Refused("recover", "journal %s is unreadable: %s" % (jpath, journal["unreadable"]))
        state = read_json(os.path.join(sd, "state.json")) or {}
        if state.get("txn") == journal["txn"]:
            _finish(journal, committed=True)
            return {"outcome": "completed", "txn": journal["txn"]}
        problems = _rollback_entries(journal["entries"])
        if problems:
            raise Refused("recover", "cannot recover journal %s: %s" % (journal["txn"], "; ".join(problems)))
        _finish(journal, committed=False)
    except BaseException:
        release_lock()  # the journal stays and says what is left to do
        raise
    return {"outcome": "rolled-back", "txn": journal["txn"], "phase": journal.get("phase")}


# Files of ours beside the applied bundle's record (a tuned DDTREE policy), in the state
# directory: outside the package, so a reinstall of SGLang does not take them away.
PLACED_DIR = "placed"


def _refuse_without_bundle(sd):
    state = read_json(os.path.join(sd, "state.json"))
    if not isinstance(state, dict) or "unreadable" in state or not state.get("name"):
        raise Refused("no_bundle", "no bundle is applied for %s (no state record in %s); `ddtree-ops deploy` first"
                      % (sys.executable, sd))


def do_place(p):
    """Put one file of ours into ``<state_dir>/placed/``, or remove it: atomic and checksummed
    like a bundle's files (temp beside the target, its sha256 checked, os.replace, fsync).

    Refused without an applied bundle (what reads the file is the bundle's plugin), while
    a deploy holds the lock or left a journal, and, when ``expect_sha`` is given, when the
    file is not what the controller last saw (a restore never overwrites someone else's
    change). Answers the path, the new sha256 and the previous content, so that the
    controller can put it back.
    """
    import base64

    sd = state_dir()
    name = p["name"]
    if not name or "/" in name or name.startswith("."):
        raise Refused("escape", "%r is not a plain file name" % (name,))
    _refuse_without_bundle(sd)  # before the lock too: a host without a bundle is refused untouched
    acquire_lock(p["holder"], None)
    try:
        if os.path.exists(os.path.join(sd, "journal.json")):
            raise Refused("journal", "a journal from an interrupted deploy is present; recover first")
        _refuse_without_bundle(sd)  # again under the lock: a rollback may have committed meanwhile
        folder = os.path.join(sd, PLACED_DIR)
        os.makedirs(folder, exist_ok=True)
        target = os.path.join(folder, name)
        if os.path.islink(target) or (os.path.exists(target) and not os.path.isfile(target)):
            raise Refused("escape", "%s is not a plain file; refusing to replace it" % target)
        current = sha256_file(target) if os.path.isfile(target) else None
        if "expect_sha" in p and current != p["expect_sha"]:
            raise Refused("changed", "%s changed since it was written (now %s, expected %s)"
                          % (target, current, p["expect_sha"]))
        previous = None
        if current is not None:
            with open(target, "rb") as fh:
                previous = base64.b64encode(fh.read()).decode()
        if p.get("content_b64") is None:
            unlink_quietly(target)
        else:
            temp = os.path.join(folder, TMP_PREFIX + p["txn"][:12] + "-" + name)
            try:
                with open(temp, "wb") as fh:
                    fh.write(base64.b64decode(p["content_b64"]))
                    fh.flush()
                    os.fsync(fh.fileno())
                os.chmod(temp, 0o644)
                got = sha256_file(temp)
                if got != p["new_sha"]:
                    raise Refused("io", "uploaded %s has sha256 %s, expected %s" % (target, got, p["new_sha"]))
                os.replace(temp, target)
            finally:
                unlink_quietly(temp if os.path.exists(temp) else None)
        fsync_dir(folder)
        now = sha256_file(target) if os.path.isfile(target) else None
        if now != p.get("new_sha"):
            raise Refused("verify", "%s has sha256 %s after writing, expected %s" % (target, now, p.get("new_sha")))
    finally:
        release_lock()
    return {"path": target, "sha256": now, "previous_sha": current, "previous_b64": previous}


STEPS = {"gather": do_gather, "prepare": do_prepare, "commit": do_commit, "recover": do_recover, "place": do_place}


def main(p):
    try:
        result = {"ok": True, "result": STEPS[p["step"]](p)}
    except Refused as exc:
        result = {"ok": False, "kind": exc.kind, "message": exc.message, "extra": exc.extra}
    except OSError as exc:
        where = exc.filename or ""
        message = "%s%s" % (exc.strerror or exc, (": " + str(where)) if where else "")
        result = {"ok": False, "kind": "io", "message": message}
    globals()["reply"](result)  # defined by the bootstrap (ddtree_ops/transport/hostprogram.py)


if __name__ == "__main__":
    main(globals()["PAYLOAD"])  # set by the bootstrap that runs this text (remote.py)
