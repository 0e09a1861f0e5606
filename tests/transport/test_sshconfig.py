"""ddtree_ops.sshconfig: Include as OpenSSH reads it, on real files; one real sshd connect."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fleetlib import Fleet

from ddtree_ops.errors import ConfigError, ConnectError
from ddtree_ops.inventory_types import DdtreeSettings, Host
from ddtree_ops.sshconfig import MAX_INCLUDE_DEPTH, SshConfig, load_ssh_config
from ddtree_ops.transport.ssh import SSHTransport, _parse_jump


@pytest.fixture
def ssh_dir(clean_home: Path) -> Path:
    return clean_home / ".ssh"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_missing_config_is_empty(ssh_dir: Path) -> None:
    cfg = load_ssh_config()
    assert cfg.files == () and cfg.lookup("h")["hostname"] == "h" and not cfg.has_alias("h")


def test_relative_include_is_relative_to_dot_ssh_even_when_nested(ssh_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # conf.d/a includes "more/b": ~/.ssh/more/b, not ~/.ssh/conf.d/more/b (ssh_config(5)).
    write(ssh_dir / "config", "Include conf.d/a\n")
    write(ssh_dir / "conf.d" / "a", "Include more/b\nHost gpu7\n  HostName 10.0.0.7\n")
    write(ssh_dir / "more" / "b", "Host gpu8\n  HostName 10.0.0.8\n")
    write(ssh_dir / "conf.d" / "more" / "b", "Host gpu8\n  HostName WRONG\n")
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    cfg = load_ssh_config()
    assert cfg.lookup("gpu7")["hostname"] == "10.0.0.7"
    assert cfg.lookup("gpu8")["hostname"] == "10.0.0.8"
    assert cfg.files == (ssh_dir / "config", ssh_dir / "conf.d" / "a", ssh_dir / "more" / "b")
    # The same Include after "Host gpu7" would sit in gpu7's block: gpu8 could never match.
    (ssh_dir / "conf.d" / "a").write_text("Host gpu7\n  HostName 10.0.0.7\nInclude more/b\n")
    assert load_ssh_config().lookup("gpu8")["hostname"] == "gpu8"


def test_absolute_and_tilde_includes_and_several_on_one_line(ssh_dir: Path, tmp_path: Path) -> None:
    absolute = write(tmp_path / "elsewhere" / "fleet.conf", "Host a\n  Port 2201\n")
    write(ssh_dir / "tilde.conf", "Host b\n  Port 2202\n")
    # A missing file and a glob matching nothing are skipped, as OpenSSH does.
    write(ssh_dir / "config", f"Include {absolute} ~/.ssh/tilde.conf missing.conf nothing/*.conf\n")
    cfg = load_ssh_config()
    assert (cfg.lookup("a")["port"], cfg.lookup("b")["port"]) == ("2201", "2202")


def test_glob_reads_files_in_sorted_order_first_value_wins(ssh_dir: Path) -> None:
    write(ssh_dir / "config", "Include conf.d/*.conf\nHost *\n  User fallback\n")
    write(ssh_dir / "conf.d" / "20-late.conf", "Host gpu*\n  User late\n  Port 2020\n")
    write(ssh_dir / "conf.d" / "10-early.conf", "Host gpu*\n  User early\n")
    write(ssh_dir / "conf.d" / "notes.txt", "Host gpu*\n  User never\n")
    cfg = load_ssh_config()
    found = cfg.lookup("gpu1")
    assert (found["user"], found["port"]) == ("early", "2020")
    assert cfg.lookup("other")["user"] == "fallback"


def test_include_inside_a_host_block_applies_within_it(ssh_dir: Path) -> None:
    write(
        ssh_dir / "config",
        "Host web\n  User webuser\n  Include web.conf\n  Compression no\n"
        "Host *\n  User fallback\n  Port 22\n",
    )
    # Lines before any Host count for the enclosing block only; a Host inside narrows it.
    write(ssh_dir / "web.conf", "Port 8022\nHost web-*\n  IdentityFile ~/never\nHost *\n  ForwardAgent yes\n")
    cfg = load_ssh_config()
    web = cfg.lookup("web")
    assert (web["user"], web["port"], web["forwardagent"], web["compression"]) == ("webuser", "8022", "yes", "no")
    assert "identityfile" not in web
    other = cfg.lookup("web-1")  # "Host web-*" sits inside "Host web": it can never match web-1
    assert (other["user"], other["port"]) == ("fallback", "22")
    assert "identityfile" not in other and "forwardagent" not in other
    assert not cfg.has_alias("web-1")


def test_include_inside_a_match_block(ssh_dir: Path) -> None:
    write(ssh_dir / "config", "Match originalhost db*\n  Include db.conf\n")
    write(ssh_dir / "db.conf", "User dba\nHost *-replica\n  Port 5433\n")
    cfg = load_ssh_config()
    assert cfg.lookup("db1")["user"] == "dba" and "port" not in cfg.lookup("db1")
    assert cfg.lookup("db1-replica")["port"] == "5433"
    assert "user" not in cfg.lookup("web-replica") and "port" not in cfg.lookup("web-replica")


def test_match_inside_an_included_block_narrows_it(ssh_dir: Path) -> None:
    # "Match all" inside "Host web" still means "web only"; other criteria must hold too.
    write(ssh_dir / "config", "Host web\n  Include web.conf\nHost *\n  User fallback\n")
    write(ssh_dir / "web.conf", "Match all\n  User webuser\nMatch originalhost db\n  Port 1\n"
          "Match host web\n  Port 2\n")
    cfg = load_ssh_config()
    assert (cfg.lookup("web")["user"], cfg.lookup("web")["port"]) == ("webuser", "2")
    assert cfg.lookup("db")["user"] == "fallback" and "port" not in cfg.lookup("db")


def test_match_criteria_paramiko_cannot_evaluate_never_apply(ssh_dir: Path) -> None:
    # paramiko would take "localnetwork" as holding and use the bastion for every host.
    write(ssh_dir / "config", "Match localnetwork 10.0.0.0/8\n  ProxyJump bastion\nMatch !tagged x host h\n  Port 3\n")
    cfg = load_ssh_config()
    assert "proxyjump" not in cfg.lookup("h") and "port" not in cfg.lookup("h")


def test_nested_includes_and_env_and_home_tokens(ssh_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_CONF", "fleet")
    write(ssh_dir / "config", "Include ${FLEET_CONF}/top\n")
    write(ssh_dir / "fleet" / "top", "Include %d/.ssh/fleet/mid\n")
    write(ssh_dir / "fleet" / "mid", "Include fleet/leaf\n")
    write(ssh_dir / "fleet" / "leaf", "Host deep\n  HostName 10.9.9.9\n")
    assert load_ssh_config().lookup("deep")["hostname"] == "10.9.9.9"


def test_include_cycle_is_refused_naming_the_chain(ssh_dir: Path) -> None:
    write(ssh_dir / "config", "Include a\n")
    write(ssh_dir / "a", "Include b\n")
    write(ssh_dir / "b", "Host x\n  Port 1\nInclude a\n")
    with pytest.raises(ConfigError, match=r"b:3: Include cycle: .*/\.ssh/a -> .*/\.ssh/b -> .*/\.ssh/a$"):
        load_ssh_config()


def test_include_depth_is_limited(ssh_dir: Path) -> None:
    write(ssh_dir / "config", "Include f0\n")
    for i in range(MAX_INCLUDE_DEPTH + 2):
        write(ssh_dir / f"f{i}", f"Include f{i + 1}\n")
    with pytest.raises(ConfigError, match=f"nested deeper than {MAX_INCLUDE_DEPTH} files"):
        load_ssh_config()
    # Exactly at the limit is fine.
    (ssh_dir / f"f{MAX_INCLUDE_DEPTH - 1}").write_text("Host ok\n  Port 2\n")
    assert load_ssh_config().lookup("ok")["port"] == "2"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Include fleet/%h.conf\n", r"config:1: Include 'fleet/%h.conf': token %h is not supported here"),
        ("Include ${NO_SUCH_VAR_X}/x\n", r"config:1: Include .*NO_SUCH_VAR_X is not set"),
        ("Host a\n  Port\n", r"config:2: cannot parse ssh_config line 'Port'"),
        ("Match host\n", r"config:1: Match 'host' needs an argument"),
        ("Include conf.d\n", r"config:1: Include .*conf\.d is a directory \(use .*conf\.d/\* for its files\)"),
    ],
)
def test_bad_config_is_one_line_naming_file_and_line(ssh_dir: Path, text: str, message: str) -> None:
    (ssh_dir / "conf.d").mkdir()
    write(ssh_dir / "config", text)
    with pytest.raises(ConfigError, match=message) as info:
        load_ssh_config()
    assert "\n" not in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file")
def test_unreadable_include_is_an_error(ssh_dir: Path) -> None:
    write(ssh_dir / "config", "Include secret\n")
    write(ssh_dir / "secret", "Host a\n").chmod(0)
    with pytest.raises(ConfigError, match=r"config:1: cannot read included .*secret: Permission denied"):
        load_ssh_config()


def test_has_alias_sees_included_hosts(ssh_dir: Path) -> None:
    write(ssh_dir / "config", "Include hosts.d/*\nHost *\n  ServerAliveInterval 30\n")
    write(ssh_dir / "hosts.d" / "gpus", "Host gpu-* !gpu-bad\n  User root\nHost b300\n  HostName 10.1.1.1\n")
    write(ssh_dir / "hosts.d" / "corp", "Host *.corp\n  User me\nHost *\n  Port 22\n")
    cfg = load_ssh_config()
    assert cfg.has_alias("b300") and cfg.has_alias("gpu-7") and cfg.has_alias("x.corp")
    assert not cfg.has_alias("gpu-bad")  # negated on its Host line
    assert not cfg.has_alias("elsewhere")  # only wildcard-only patterns (Host *) match it
    # A HostName that a wildcard block derives from the name makes every name an alias.
    assert SshConfig.from_text("Host *\n  HostName %h.example.net\n").has_alias("anything")


def test_included_user_port_identity_reach_the_transport(ssh_dir: Path) -> None:
    write(ssh_dir / "config", "Include fleet.conf\n")
    write(ssh_dir / "fleet.conf", "Host gpu7\n  HostName 10.0.0.7\n  Port 2207\n  User ops\n  IdentityFile ~/.ssh/k7\n")
    ep = SSHTransport(Host("gpu7")).endpoint()
    assert (ep.hostname, ep.port, ep.user, ep.key_files) == ("10.0.0.7", 2207, "ops", (str(ssh_dir / "k7"),))


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("jump", (None, "jump", None)),
        ("me@jump:2222", ("me", "jump", 2222)),
        ("[::1]:2200", (None, "::1", 2200)),
        ("ssh://me@bastion:22", ("me", "bastion", 22)),
    ],
)
def test_parse_jump(spec: str, expected: tuple[str | None, str, int | None]) -> None:
    assert _parse_jump(spec, host="h1") == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("jump:abc", r"^h1: ProxyJump hop 'jump:abc': port 'abc' is not a number from 1 to 65535$"),
        ("jump:70000", r"^h1: ProxyJump hop 'jump:70000': port '70000'"),
        ("[::1:22", r"^h1: ProxyJump hop '\[::1:22': unbalanced"),
        ("me@", r"^h1: ProxyJump hop 'me@': expected \[user@\]host\[:port\]$"),
    ],
)
def test_bad_proxy_jump_is_one_connect_error_naming_host_and_hop(spec: str, message: str) -> None:
    with pytest.raises(ConnectError, match=message):
        _parse_jump(spec, host="h1")


def test_bad_proxy_jump_from_config_fails_the_connect(ssh_dir: Path) -> None:
    write(ssh_dir / "config", "Host h1\n  HostName 127.0.0.1\n  ProxyJump bastion:port\n")
    with pytest.raises(ConnectError, match=r"^h1: ProxyJump hop 'bastion:port': port 'port' is not a number"):
        SSHTransport(Host("h1")).run(["true"])


@pytest.mark.fleet
def test_connect_through_an_alias_defined_in_an_included_file(ssh_fleet: Fleet, ssh_dir: Path) -> None:
    fh = ssh_fleet.hosts[1]
    write(ssh_dir / "config", "Host *\n  Include fleet.d/*.conf\n")
    write(
        ssh_dir / "fleet.d" / "b300.conf",
        f"Host gpu-b300-inc\n  HostName 127.0.0.1\n  Port {fh.port}\n  User root\n"
        f"  IdentityFile {ssh_fleet.client_key}\n",
    )
    assert load_ssh_config().has_alias("gpu-b300-inc")
    host = Host("gpu-b300-inc", ddtree=DdtreeSettings(known_hosts=str(ssh_fleet.known_hosts)))
    with SSHTransport(host) as t:
        assert t.run(["sh", "-c", "echo $HOME"]).stdout.strip() == str(fh.server.home)
