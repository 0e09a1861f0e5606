"""`ddtree-ops hosts [TARGET]`: what the inventory resolves to, before anything connects."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.text import Text

from ddtree_ops.cli.common import (
    WIDE_HELP,
    TableColumn,
    fitted_table,
    load_inventory_for,
    print_table,
    secret_mapping,
    set_json_data,
)
from ddtree_ops.cli.main import AppContext, app
from ddtree_ops.inventory.values import shown
from ddtree_ops.inventory_types import Host
from ddtree_ops.sshconfig import SshConfig, load_ssh_config, user_ssh_config_path


def _address(host: Host, aliases: SshConfig) -> str:
    if host.connection == "local":
        return "local"
    # Without ansible_host the name is the address (Ansible's rule): say how it resolves.
    # shown(): a value an inventory read by lookup('env') appears by where it came from.
    how = "ssh_config" if aliases.has_alias(host.name) else "DNS"
    where = shown(host.address) if host.address else f"{host.name} ({how})"
    user = f"{shown(host.user)}@" if host.user else ""
    port = f":{host.port}" if host.port else ""
    return f"{user}{where}{port}"


@app.command("hosts")
def hosts_cmd(
    ctx: typer.Context,
    target: str = typer.Argument("all", help="Group, host, 'all', or a comma list."),
    wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
) -> None:
    """List the resolved hosts and their settings (no connection is made; -v for every setting)."""
    obj: AppContext = ctx.obj
    inventory = load_inventory_for(obj)
    hosts = inventory.resolve(target)
    if obj.json:
        set_json_data(obj, [{"name": h.name, **_as_dict(h)} for h in hosts])
        return
    aliases = load_ssh_config(user_ssh_config_path())
    # Words wrap at spaces and never break; the model, then the groups go first when the
    # terminal is too narrow, and the caption says so.
    columns = (
        TableColumn("host"), TableColumn("groups", drop=2, wrap=True), TableColumn("connect", wrap=True),
        TableColumn("gpu"), TableColumn("server"), TableColumn("model", drop=3, wrap=True),
    )
    rows: list[list[str | Text]] = []
    for h in hosts:
        s = h.ddtree.server
        rows.append([  # Text cells: names and paths are data, never markup
            Text(h.name, style="bold"), ", ".join(h.groups), _address(h, aliases), shown(h.ddtree.gpu or "-"),
            f"{shown(s.bind_host)}:{s.port}", shown(s.model_path or "-"),
        ])
    # Which files this is: -i, else $DDTREE_OPS_INVENTORY, else ./inventories (README "Inventories").
    sources = ", ".join(str(s) for s in inventory.sources)
    print_table(obj.console, fitted_table(columns, rows, width=obj.console.width, wide=wide,
                                          title=f"hosts: {target}", caption=f"inventory: {sources}"))
    if obj.verbose:
        for h in hosts:
            s = h.ddtree.server
            obj.console.print(
                f"[bold]{escape(h.name)}[/] "
                + escape(
                    f"({h.source}): python={h.python!r} run_dir={h.ddtree.run_dir!r} "
                    f"command={s.command!r} draft={s.draft_model_path!r} "
                    f"extra_args={list(s.extra_args)} env={secret_mapping(s.env)} expected_load_s={s.expected_load_s:g}"
                ),
                highlight=False,
            )


def _as_dict(host: Host) -> dict[str, object]:
    from ddtree_ops.cli.common import to_jsonable

    data = to_jsonable(host)
    data.pop("name", None)
    return data
