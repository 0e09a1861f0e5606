"""`ddtree-ops hosts [TARGET]`: what the inventory resolves to, before anything connects."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from ddtree_ops.cli.common import load_hosts, set_json_data
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.inventory_types import Host
from ddtree_ops.sshconfig import SshConfig, load_ssh_config, user_ssh_config_path


def _address(host: Host, aliases: SshConfig) -> str:
    if host.connection == "local":
        return "local"
    # Without ansible_host the name is the address (Ansible's rule): say how it resolves.
    where = host.address or f"{host.name} ({'ssh_config' if aliases.has_alias(host.name) else 'DNS'})"
    user = f"{host.user}@" if host.user else ""
    port = f":{host.port}" if host.port else ""
    return f"{user}{where}{port}"


@app.command("hosts")
def hosts_cmd(
    ctx: typer.Context,
    target: str = typer.Argument("all", help="Group, host, 'all', or a comma list."),
) -> None:
    """List the resolved hosts and their settings (no connection is made; -v for every setting)."""
    obj: AppContext = ctx.obj
    hosts = load_hosts(obj, target)
    if obj.json:
        set_json_data(obj, [{"name": h.name, **_as_dict(h)} for h in hosts])
        return
    aliases = load_ssh_config(user_ssh_config_path())
    table = Table(title=escape(f"hosts: {target}"), title_justify="left")
    table.add_column("host", no_wrap=True, style="bold")
    for header in ("groups", "connect", "gpu", "server", "model"):
        table.add_column(header, overflow="fold")
    for h in hosts:
        s = h.ddtree.server
        cells = (
            h.name, ",".join(h.groups), _address(h, aliases), h.ddtree.gpu or "-", f"{s.bind_host}:{s.port}",
            s.model_path or "-",
        )
        table.add_row(*(escape(c) for c in cells))  # names and paths are data, never markup
    obj.console.print(table)
    if obj.verbose:
        for h in hosts:
            s = h.ddtree.server
            obj.console.print(
                f"[bold]{escape(h.name)}[/] "
                + escape(
                    f"({h.source}): python={h.python!r} run_dir={h.ddtree.run_dir!r} "
                    f"command={s.command!r} draft={s.draft_model_path!r} "
                    f"extra_args={list(s.extra_args)} env={dict(s.env)} expected_load_s={s.expected_load_s:g}"
                ),
                highlight=False,
            )


def _as_dict(host: Host) -> dict[str, object]:
    from ddtree_ops.cli.common import to_jsonable

    data = to_jsonable(host)
    data.pop("name", None)
    return data
