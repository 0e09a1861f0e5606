"""`ddtree-ops ansible-collection build DIR`: the ddtree.ops Ansible collection of this release.

The collection's tasks call this ddtree-ops on the controller (the same release: its plugins
check it), so it is built from the installed package, as ``ansible-galaxy`` builds any
collection; ``ansible-galaxy collection install`` takes the tarball. The work is
:mod:`ddtree_ops.ansible.collection`'s; this module renders it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ddtree_ops.ansible.collection import build_collection
from ddtree_ops.cli.common import set_json_data
from ddtree_ops.cli.main import AppContext, app

collection_app = typer.Typer(
    help="The ddtree.ops Ansible collection: ddtree-ops' deploy, restart, gate and observation as Ansible tasks.",
    no_args_is_help=True,
)
app.add_typer(collection_app, name="ansible-collection")


@collection_app.command("build")
def build_cmd(
    ctx: typer.Context,
    directory: Path = typer.Argument(..., help="Where the collection's tarball is written (made if missing)."),
) -> None:
    """Build the ddtree.ops collection of this ddtree-ops release into DIR (ansible-galaxy collection build);
    install it with: ansible-galaxy collection install DIR/ddtree-ops-VERSION.tar.gz"""
    obj: AppContext = ctx.obj
    built = build_collection(directory)
    if obj.json:
        set_json_data(obj, {"collection": built.name, "version": built.version, "tarball": str(built.tarball),
                            "source": str(built.source)})
        return
    obj.console.print(f"built {built.name} {built.version}: {built.tarball}", markup=False, highlight=False,
                      soft_wrap=True)
    obj.console.print(f"install it with: ansible-galaxy collection install {built.tarball}", markup=False,
                      highlight=False, soft_wrap=True)
