"""Data never drives the terminal: control characters in what the CLI prints arrive escaped."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.progress import Progress, TextColumn
from rich.table import Table
from rich.text import Text

from ddtree_ops.cli.terminal import SafeConsole, escape_controls

CLEAR = "\x1b[2J"


def test_escape_controls_writes_each_control_as_its_escape() -> None:
    assert escape_controls(f"a{CLEAR}b\r\x00\x9b\u202e\n") == "a\\x1b[2Jb\\r\\x00\\x9b\\u202e\n"
    assert escape_controls("plain ünïcode ✓") == "plain ünïcode ✓"


def test_tables_text_and_markup_escape_data_and_read_no_emoji() -> None:
    buf = io.StringIO()
    console = SafeConsole(file=buf, width=120, force_terminal=True, color_system="truecolor")
    table = Table(title=f"title{CLEAR}")
    table.add_column("host", style="bold red")
    table.add_row(f"evil{CLEAR}name")
    console.print(table)
    console.print(Text(f"text object {CLEAR} :end:"))
    console.print(f"error: unknown target 'x:end:{CLEAR}'", markup=False)
    with Progress(TextColumn("{task.description}", markup=False), console=console) as bar:
        bar.add_task(f"cell {CLEAR}")
    out = buf.getvalue()
    # Every ESC left is rich's own styling or cursor code: never the data's "ESC [ 2 J".
    assert CLEAR not in out
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # rich's codes out: what a reader sees
    assert "\x1b" not in shown
    assert shown.count("\\x1b[2J") == 4
    assert "evil\\x1b[2Jname" in shown  # laid out whole: the column is as wide as the escape
    assert "text object \\x1b[2J" in shown  # a Text laid out whole as well
    # A Text a table measures itself (a progress column) keeps its raw width: cut, never raw.
    assert "cell \\x…" in shown
    assert ":end:" in shown and "🔚" not in shown  # rich's emoji code for :end: is 🔚


def test_the_cli_prints_hostile_names_and_errors_escaped(cli, clean_home: Path, tmp_path: Path) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text('all:\n  hosts:\n    "evil\\e(2Jname": {ansible_connection: local}\n')
    # A host name with a control character is refused, and the refusal shows it escaped.
    res = cli("-i", str(inv), "hosts")
    assert res.exit_code == 2, res.stderr
    assert "\x1b" not in res.stderr and "evil\\x1b(2Jname" in res.stderr.replace("\n", "")
    inv.write_text("all:\n  hosts:\n    fine: {ansible_connection: local}\n")
    res = cli("-i", str(inv), "doctor", f"x:end:{CLEAR}")
    assert res.exit_code == 2
    assert "\x1b" not in res.stderr and "'x:end:\\x1b[2J'" in res.stderr and "🔚" not in res.stderr
