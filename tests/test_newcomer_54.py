"""A newcomer's first hour (issue 54): ``make demo``, then the README's commands as written.

- The default inventory (``inventories/``) is the demo fleet alone: the example real hosts
  (203.0.113.x, unreachable by design) live in ``examples/inventories/``.
- The README's "On the demo fleet" block runs as written, after ``make demo``'s own
  commands (read from the Makefile), on a demo fleet of this test's (each host a small
  real SGLang prefix, the simulator fast), every output at 80 columns without a broken word.
- Every table the CLI prints keeps its words whole at 80 columns (a word breaks only at a
  space, or after a path's "/" or a list's ","): :func:`broken_words` finds a word split
  across two lines of a table column or of a paragraph.
- ``bench --predict`` says which cells were predicted and which measured, and prints the
  cells it chose per (host, temperature, concurrency); ``--predict-top N`` sets how many.
- ``deploy --dry-run --diff`` piped is a patch that applies.
- One name for eager; wording that says what it means.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_json import json_data
from minisglang import expose_toolkit, make_prefix, purelib
from report.report_rows import make_row
from testports import free_port

from ddtree_ops.bench.ledger import append_row

REPO = Path(__file__).resolve().parents[1]
WIDTH = 80
# The simulator as fast as its safe range allows (sim/README.md): a simulated second is 100 ms.
FAST_SIM_ENV = {"SIM_LOAD_S": "1", "SIM_WARMUP_S": "0.5", "SIM_TIME_SCALE": "0.1", "SIM_SEED": "0"}

# --------------------------------------------------------------------- broken words

_VERTICAL = "│┃"
_BOX = re.compile(r"[│┃┏┓┗┛┡┩┣┫┳┻╇╋━─├┤┬┴┼└┘┌┐]")
_NUMBER = re.compile(r"[0-9.,:%x+-]+")


def word_pieces(word: str) -> list[str]:
    """``word`` cut after each "/" and ",": the places a line may break inside a word (a
    path, a list), as a reader expects. Written here, not imported: the checker must not
    share the code it checks."""
    return [piece for piece in re.split(r"(?<=[/,])", word) if piece]


def _pairs(lines: list[str]) -> Iterator[tuple[str, str]]:
    """Each (line, next line) of a paragraph and each (cell, cell below) of a table column."""
    for top, bottom in zip(lines, lines[1:], strict=False):
        if top[:1] in _VERTICAL and bottom[:1] in _VERTICAL:
            seps = [i for i, c in enumerate(top) if c in _VERTICAL]
            if seps != [i for i, c in enumerate(bottom) if c in _VERTICAL]:
                continue
            for a, b in zip(seps, seps[1:], strict=False):
                yield top[a + 1 : b], bottom[a + 1 : b]
        elif top[:1] not in _VERTICAL and bottom[:1] not in _VERTICAL and not _BOX.search(top + bottom):
            yield top, bottom


def _bare(piece: str) -> str:
    return piece.strip("/,.;:()[]'\"`")


def broken_words(out: str, vocabulary: Iterable[str] = ()) -> list[str]:
    """The words of ``out`` split across two lines (of a table column, or of a paragraph),
    shown as ``left│right``. A word is any whitespace-separated token of ``out`` itself (so
    "predict│ed" is caught where "predicted" is written whole elsewhere) or of
    ``vocabulary`` (the data: host names, paths, keys); a break after a "/" or "," is a
    line break a reader expects, not a broken word."""
    data = {_bare(p) for text in vocabulary for w in text.split() for p in word_pieces(w)}
    words = data | {_bare(p) for w in _BOX.sub(" ", out).split() for p in word_pieces(w)}
    words.discard("")
    broken = []
    for top, bottom in _pairs(out.splitlines()):
        left, right = top.split(), bottom.split()
        if not left or not right:
            continue
        a, b = word_pieces(left[-1])[-1], word_pieces(right[0])[0]
        if a[-1] in "/," or a.endswith("…"):
            continue
        joined = _bare(a + b)
        if not _bare(a) or not _bare(b) or joined in (_bare(a), _bare(b)):
            continue  # one side is only punctuation: "ddtree.py" above "../x", "lib" above "/python"
        if _NUMBER.fullmatch(a) and _NUMBER.fullmatch(b):
            continue  # a number above a number: two rows of a numeric column ("0.6" above "0")
        if len(joined) >= 3 and (joined in words or any(joined in w for w in words if len(w) > len(joined))):
            broken.append(f"{a}│{b}")
    # A word of the data cut short to fit ("sim-b3…"): the table squeezed its column.
    for token in _BOX.sub(" ", out).split():
        stem = _bare(word_pieces(token)[-1].removesuffix("…"))
        if token.endswith("…") and len(stem) >= 3 and any(w.startswith(stem) and w != stem for w in data):
            broken.append(token)
    return broken


def assert_fits(out: str, vocabulary: Iterable[str] = (), *, what: str = "") -> None:
    """Every table line within :data:`WIDTH` and no word broken. A line printed whole (a
    gate's verdict, a path) is one line when piped, as here: on a terminal the console wraps
    it at its words (test_a_long_line_wraps_at_words_on_a_terminal_and_stays_whole_piped)."""
    wide = [line for line in out.splitlines() if len(line) > WIDTH and _BOX.search(line)]
    assert not wide, f"{what}: lines wider than {WIDTH} columns:\n" + "\n".join(wide)
    broken = broken_words(out, vocabulary)
    assert not broken, f"{what}: words broken across lines: {broken}\n{out}"


def _table(*rows: tuple[str, ...]) -> str:
    """Body lines of a box table whose columns are as wide as their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("│" + "│".join(f" {c.ljust(w)} " for c, w in zip(r, widths, strict=True)) + "│" for r in rows)


def test_broken_words_finds_the_splits_the_issue_saw() -> None:
    """The checker itself: each split the issue quotes is found, the breaks a reader expects
    (spaces, after "/" or ",") are not."""
    assert broken_words(_table(("/work/demo-hosts/si",), ("m-ct200/lib",)), ["/work/demo-hosts/sim-ct200/lib"]) == [
        "si│m-ct200/"]
    assert broken_words(_table(("b4,8,16,32,48,6",), ("4-topk8",)), ["ddtree-states-b4,8,16,32,48,64-topk8"]) == [
        "6│4-topk8"]
    assert broken_words(_table(("sim-b30", "predict"), ("0", "ed only")) + "\nsim-b300 predicted") == [
        "sim-b30│0", "predict│ed"]
    assert broken_words("the server is predict\ned to be ready\npredicted") == ["predict│ed"]
    assert broken_words(_table(("sim-b3…", "availa…")), ["sim-b300"]) == ["sim-b3…"]
    fine = _table(("/work/demo-hosts/", "DDTREE b=16"), ("sim-ct200/lib", "k=4")) + "\nthe server is\nready now"
    assert broken_words(fine, ["/work/demo-hosts/sim-ct200/lib", "DDTREE"]) == []


# --------------------------------------------------------------------- the demo fleet


def demo_fleet(root: Path) -> tuple[Path, dict[str, Path]]:
    """The shipped ``inventories/local.yaml`` under ``root`` (same relative paths: each host's
    Python is ``root/.cache/demo-hosts/<host>``, a small real SGLang 0.5.23 prefix), on free
    ports and with the simulator fast. Returns the inventory and each host's prefix."""
    shipped = yaml.safe_load((REPO / "inventories" / "local.yaml").read_text())
    prefixes = {}
    for name, entry in shipped["all"]["children"]["local"]["hosts"].items():
        server = entry["ddtree"]["server"]
        count = int(server.get("slots", {}).get("count", 1))
        server["port"] = free_port(count)  # never `make demo`'s own (testports.RESERVED)
        server["env"] = {**server.get("env", {}), **FAST_SIM_ENV}
        python = Path(entry["ddtree"]["python"])
        prefix = (root / "inventories" / python).parent.parent
        prefix.parent.mkdir(parents=True, exist_ok=True)
        make_prefix(prefix)
        expose_toolkit(prefix)
        prefixes[name] = prefix.resolve()
    inventory = root / "inventories" / "local.yaml"
    inventory.parent.mkdir(exist_ok=True)
    inventory.write_text(yaml.safe_dump(shipped, sort_keys=False))
    return inventory, prefixes


def path_words(*paths: Path) -> list[str]:
    return [str(p) for p in paths] + [str(purelib(p) / "sglang") for p in paths]


def test_the_default_inventory_is_the_demo_fleet(
    cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `make demo`, `ddtree-ops status all` is the demo fleet: no example host
    (203.0.113.x: unreachable, 12 s of SSH timeouts and exit 3) merged into it. The
    examples still load, from where the README says they are."""
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    monkeypatch.chdir(REPO)
    hosts = cli("--json", "hosts", "all")
    assert hosts.exit_code == 0, hosts.stderr
    assert sorted(h["name"] for h in json_data(hosts.stdout)) == ["sim-b300", "sim-ct200"]
    examples = sorted((REPO / "examples" / "inventories").glob("*.yaml"))
    assert [p.name for p in examples] == ["b300.yaml", "ct200.yaml"]
    shown = cli("--json", "-i", str(examples[0]), "-i", str(examples[1]), "hosts", "all")
    assert shown.exit_code == 0, shown.stderr
    assert sorted(h["name"] for h in json_data(shown.stdout)) == ["b300-a", "ct200-a", "ct200-b"]


# --------------------------------------------------------------------- make demo, then the README


def _demo_recipe() -> list[list[str]]:
    """`make demo`'s ddtree-ops commands as the Makefile writes them (its other lines, the
    `rm -rf` of results/, are left out: this test's results/ starts empty)."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    ops = re.search(r"^DEMO_OPS\s*:=\s*\$\(VENV\)/bin/ddtree-ops(.*)$", text, re.M)
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", text, re.M)
    assert ops and recipe, "the Makefile's demo recipe moved"
    return [[*shlex.split(ops.group(1)), *shlex.split(line.strip().removeprefix("$(DEMO_OPS)"))]
            for line in recipe.group(1).splitlines() if line.strip().startswith("$(DEMO_OPS)")]


def _readme_demo_block() -> list[list[str]]:
    """The README's "On the demo fleet" commands, each as the shell would split it."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("**On the demo fleet**"))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("    ddtree-ops "))
    block = []
    for line in lines[first:]:
        if not line.startswith("    "):
            break
        block.append(shlex.split(line, comments=True))
    assert all(cmd[0] == "ddtree-ops" for cmd in block), block
    return [cmd[1:] for cmd in block]


def _short_demo_sweep(root: Path) -> None:
    """bench_configs/demo.yaml (targets, workload sources) with a grid and workload of seconds."""
    spec = yaml.safe_load((REPO / "bench_configs" / "demo.yaml").read_text())
    spec["baselines"] = ["autoregressive"]
    spec["grid"] = {"algorithm": ["ddtree"], "budget": [4, 16], "topk": [4], "temperature": [0.0], "concurrency": [1]}
    # Longer than the drafter's block (16): a predicted run can walk its responses.
    spec["workload"] = {**spec["workload"], "num_prompts": 2, "max_new_tokens": 24}
    spec.update(repeats=1, warmup=0, request_timeout_s=60)
    (root / "bench_configs").mkdir()
    (root / "bench_configs" / "demo.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


@pytest.fixture
def demo_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, dict[str, Path]]]:
    """A checkout as `make demo` sees it, in the tmp dir: inventories/local.yaml (the demo
    hosts' prefixes under .cache/demo-hosts, as `make demo-hosts` makes them), a fast
    bench_configs/demo.yaml, the default inventory. The finaliser stops every server."""
    monkeypatch.delenv("DDTREE_OPS_INVENTORY", raising=False)
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.chdir(tmp_path)
    inventory, prefixes = demo_fleet(tmp_path)
    _short_demo_sweep(tmp_path)
    try:
        yield inventory, prefixes
    finally:
        from ddtree_ops.inventory import load_inventory
        from ddtree_ops.service import lifecycle
        from ddtree_ops.transport.local import LocalTransport

        for server in (s for h in load_inventory([inventory]).resolve("local") for s in h.slot_hosts()):
            with LocalTransport(server.name) as t:
                lifecycle.stop(t, server, grace_s=5.0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_then_readme(
    demo_checkout: tuple[Path, dict[str, Path]], cli: Callable[..., Any], tmp_path: Path
) -> None:
    inventory, prefixes = demo_checkout
    vocabulary = [*prefixes, *path_words(*prefixes.values()), str(tmp_path), "sim-ct200/0", "sim-ct200/1",
                  "Blackwell", "Workstation", "predicted", "measured", "launches", "served", "eager", "graphs"]
    outputs: dict[str, str] = {}
    errors: dict[str, str] = {}
    for args in [*_demo_recipe(), *_readme_demo_block()]:
        what = "ddtree-ops " + " ".join(args)
        done = cli(*args)
        assert done.exit_code == 0, f"{what} exited {done.exit_code}:\n{done.stderr[-3000:]}\n{done.stdout[-3000:]}"
        assert "Traceback" not in done.stderr, what
        if args[0] != "logs":  # log lines are the server's, shown as they are
            assert_fits(done.stdout, vocabulary, what=what)
        outputs[what], errors[what] = done.stdout, done.stderr

    def out(start: str) -> str:
        return next(text for what, text in outputs.items() if what.startswith(f"ddtree-ops {start}"))

    # The demo fleet alone: no example host tried (status all of make demo's hosts, exit 0 above).
    assert "ct200-a" not in out("status all") and "sim-b300" in out("status all")
    # One name for eager, and its opposite: the column is "mode", never "graphs on" / "cuda graphs off".
    for text in outputs.values():
        assert "cuda graphs" not in text.lower() and "graph mode unknown" not in text
    # make demo's restart at budget 16: the b300 falls back to eager, the restart table says so.
    restarted = out("-i inventories/local.yaml restart local")
    assert re.search(r"│ sim-b300 +│ ok +│ .*│ eager +│", restarted) and "┃ mode " in restarted, restarted
    assert re.search(r"mode +eager", out("service-status")), out("service-status")
    # status observes each server of a host with GPU slots (its own port is slot 0's).
    status = out("status all")
    assert "sim-ct200/0:" in status and "sim-ct200/1:" in status, status
    assert "held by another process" not in status and "eager" in status and "graphs" in status, status
    # The predicted run says what was predicted and what measured, and what it chose.
    predicted = out("bench sim-b300")
    said = next(text for what, text in errors.items() if what.startswith("ddtree-ops bench sim-b300"))
    assert "skipped (resume)" not in predicted and "predicted only" in predicted, predicted
    assert "not predicted" not in predicted, said  # the predict phase worked (else its error: stderr)
    assert "Chosen by prediction: the top 1 per (host, temperature, concurrency)" in " ".join(predicted.split())


def test_a_long_line_wraps_at_words_on_a_terminal_and_stays_whole_piped() -> None:
    """A line the CLI prints whole (soft_wrap: a gate verdict, a policy file's path) is left
    to the terminal by rich, which folds it at the edge, mid-word. On a terminal the console
    wraps it at its words (a path after a "/"); piped it stays one line, to read or grep."""
    import io

    from ddtree_ops.cli.terminal import SafeConsole

    path = "/work/main/.cache/demo-hosts/sim-ct200/.ddtree-ops/placed/ddtree-policy.json"
    line = (f"sim-ct200/0: gate passed — greedy agreement 1.000, decode 1.14x before (291.4 -> 332.7 tok/s per "
            f"request), acceptance T=0 2.72 (floor 2.67); policy {path} (new, sha256 0d49354d34e4)")
    shown = {}
    for terminal in (True, False):
        buf = io.StringIO()
        console = SafeConsole(file=buf, width=WIDTH, force_terminal=terminal, color_system=None)
        console.print(line, markup=False, highlight=False, soft_wrap=True)
        shown[terminal] = buf.getvalue()
    assert shown[False] == line + "\n"
    lines = shown[True].splitlines()
    assert len(lines) > 2 and max(map(len, lines)) <= WIDTH, shown[True]
    assert broken_words(shown[True], [path, "sim-ct200/0", "agreement"]) == [], shown[True]
    assert " ".join(shown[True].split()) == " ".join(line.split()).replace("/ ", "/")


# --------------------------------------------------------------------- every table at 80 columns

GPUS = {"sim-ct200": "NVIDIA RTX PRO 6000 Blackwell Workstation Edition (simulated)",
        "sim-b300": "NVIDIA B300 SXM6 AC (simulated)"}


def predicted_ledger(path: Path) -> Path:
    """What `bench --predict` writes on the demo's two hosts: every DDTree cell of a grid of
    budgets 4..256 x top-k 2/4/8 predicted, the fastest per (temperature, concurrency)
    measured, the baselines measured; the b300 eager above budget 8."""
    rows = []
    for host, gpu in GPUS.items():
        for temperature in (0.0, 0.6):
            for concurrency in (1, 8):
                common = {"host": host, "gpu_name": gpu, "temperature": temperature, "concurrency": concurrency,
                          "sweep": "budgets-predicted"}
                rows.append(make_row(algorithm="AR", output_tok_s=100.0 * concurrency, **common))
                trees = [(b, k) for b in (4, 8, 16, 32, 64, 128, 256) for k in (2, 4, 8)]
                for i, (budget, topk) in enumerate(trees):
                    tok_s = 150.0 * concurrency + 10 * i - 40 * temperature
                    graphs = not (host == "sim-b300" and budget > 8)
                    rows.append(make_row(budget=budget, topk=topk, cuda_graph=graphs, output_tok_s=tok_s,
                                         accept_length=2 + i / 20, source="predicted", round_ms=12.5,
                                         overhead_ms=3.0, predicted_accept_naive=2.1, predicted_tok_s_naive=tok_s,
                                         **common))
                best = trees[-1]
                rows.append(make_row(budget=best[0], topk=best[1], cuda_graph=host != "sim-b300",
                                     output_tok_s=140.0 * concurrency, **common))
    for row in rows:
        append_row(path, row)
    return path


def demo_ledger(path: Path) -> Path:
    """`make demo`'s ledger shape: both hosts, baselines and six trees, two temperatures and
    concurrencies, one repeat; the b300's budget-16 cells eager."""
    for host, gpu in GPUS.items():
        configs = [("AR", None, None), ("DFLASH", None, None)] + [("DDTREE", b, k) for b in (4, 8, 16) for k in (2, 4)]
        for i, (algorithm, budget, topk) in enumerate(configs):
            for temperature in (0.0, 0.6):
                for concurrency in (1, 4):
                    append_row(path, make_row(
                        host=host, gpu_name=gpu, algorithm=algorithm, budget=budget, topk=topk,
                        cuda_graph=not (host == "sim-b300" and (budget or 0) > 8), temperature=temperature,
                        concurrency=concurrency, output_tok_s=123.4 + 9.7 * i + 11.1 * concurrency,
                        accept_length=2.0 + i / 10, sweep="demo"))
    return path


@pytest.fixture
def demo_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, Path]]:
    """The demo's inventory under a checkout path as long as a real one's, its hosts' SGLang
    prefixes without the bundle (deploy --dry-run plans every file); nothing runs."""
    root = tmp_path / "home" / "alice" / "src" / "ddtree-ops-checkout"
    inventory, prefixes = demo_fleet(root)
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    return inventory, prefixes


def test_every_table_keeps_its_words_whole_at_80_columns(
    demo_hosts: tuple[Path, dict[str, Path]], cli: Callable[..., Any], tmp_path: Path
) -> None:
    """doctor's paths, the dry run's server keys and slot lines, the predicted-vs-measured
    table, status, deploy's plan, service-status, hosts, report and tune: each at 80
    columns, no table line wider, no word of the data split across two lines (the issue saw
    `si│m-ct200`, `…,48,6│4-topk8`, `sim-b30│0`, `predict│ed only`)."""
    inventory, prefixes = demo_hosts
    inv = ("-i", str(inventory))
    # The predicted grid on the demo hosts: a launch key of 47 characters, slot lines, repeats.
    sweep = yaml.safe_load((REPO / "bench_configs" / "budgets_predicted.yaml").read_text())
    (tmp_path / "predicted.yaml").write_text(yaml.safe_dump({**sweep, "targets": ["local"], "repeats": 2}))
    key = "ddtree-states-b4,8,16,32,64,128,192,256-topk8"
    vocabulary = [*GPUS, "sim-ct200/0", "sim-ct200/1", key, "predicted", *path_words(*prefixes.values()),
                  "Blackwell", "Workstation", "measured"]
    commands = {
        "doctor": (*inv, "doctor", "local"),
        "status": (*inv, "status", "all"),
        "deploy --dry-run": (*inv, "deploy", "local", "--dry-run"),
        "service-status": (*inv, "service-status", "local"),
        "hosts": (*inv, "hosts", "all"),
        "bench --dry-run": (*inv, "bench", "--sweep", str(tmp_path / "predicted.yaml"), "--dry-run"),
        "report (predicted)": ("report", str(predicted_ledger(tmp_path / "predicted.jsonl")), "--min-repeats", "1"),
        "report (demo)": ("report", str(demo_ledger(tmp_path / "demo.jsonl")), "--min-repeats", "1"),
        "tune": ("tune", str(tmp_path / "demo.jsonl")),
    }
    outputs = {}
    for what, args in commands.items():
        done = cli(*args)
        assert done.exit_code in (0, 5, 7), f"{what}: exit {done.exit_code}\n{done.stderr}"  # no server: 5/7
        assert "Traceback" not in done.stderr, what
        assert_fits(done.stdout, vocabulary, what=what)
        outputs[what] = done.stdout
    # What each table showed whole (a check that the words were there to be broken).
    flat = {what: " ".join(out.split()) for what, out in outputs.items()}
    assert "/sim-ct200/" in flat["doctor"] and "site-packages/sglang" in flat["doctor"]
    assert "ddtree-states-b4,8,16,32,64,128," in flat["bench --dry-run"] and "192,256-topk8" in flat["bench --dry-run"]
    assert "predicted only" in flat["report (predicted)"] and "sim-b300" in outputs["report (predicted)"]
    assert "Hidden to fit 80 columns: accept meas" in flat["report (predicted)"]
    # A slot's share of a split launch names its pass over the cells as people count them.
    assert "repeats 0" not in flat["bench --dry-run"] and re.search(r"repeat [12] of 2", flat["bench --dry-run"])
    # One repeat: a runner-up too close to tell apart says so, not "inside what ... can tell apart".
    assert "too close for one measurement to tell apart" in flat["report (demo)"]
    assert "inside what one measurement" not in flat["report (demo)"]


@pytest.mark.parametrize(("sweep_predict", "flags", "top"), [
    (None, ("--predict",), 3),  # as before: the default
    (None, ("--predict-top", "5"), 5),  # N alone implies --predict
    ({"top": 2}, ("--predict",), 2),  # the sweep's N stays
    ({"top": 2, "probe_waves": 16}, ("--predict", "--predict-top", "7"), 7),  # the flag's wins
    ({"top": 2, "max_repeats": 3}, ("--predict",), 2),  # the measured phase's cap of passes
    ({"top": 2}, (), 2),
    (None, (), None),  # no prediction
])
def test_predict_top_sets_how_many_predicted_cells_are_measured(
    demo_hosts: tuple[Path, dict[str, Path]], cli: Callable[..., Any], tmp_path: Path,
    sweep_predict: dict[str, int] | None, flags: tuple[str, ...], top: int | None,
) -> None:
    inventory, _ = demo_hosts
    spec = yaml.safe_load((REPO / "bench_configs" / "demo.yaml").read_text())
    if sweep_predict is not None:
        spec["predict"] = sweep_predict
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    done = cli("--json", "-i", str(inventory), "bench", "--sweep", str(tmp_path / "s.yaml"), *flags, "--dry-run")
    assert done.exit_code == 0, done.stderr
    predict = json_data(done.stdout)["predict"]
    assert (predict and predict["top"]) == top
    if top is not None:  # six trees per (temperature, concurrency), four such groups
        assert predict["measured_ddtree_cells_per_host"] == min(top, 6) * 4
        # Measured until decided: at least the sweep's repeats (2 at least), at most the cap.
        assert predict["measured_repeats"] == [2, (sweep_predict or {}).get("max_repeats", 6)]


@pytest.mark.parametrize("value", ["0", "-1", "three", "٣", "1.5", "100001"])
def test_predict_top_refuses_what_is_not_a_count_of_cells(cli: Callable[..., Any], value: str) -> None:
    done = cli("bench", "--sweep", str(REPO / "bench_configs" / "demo.yaml"), "--predict-top", value, "--dry-run")
    assert done.exit_code == 2, (done.stdout, done.stderr)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in done.stderr and "--predict-top" in done.stderr, done.stderr
    assert len(lines) <= 3, done.stderr  # click's usage line, its hint, the error


# --------------------------------------------------------------------- deploy --dry-run --diff


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs patch(1)")
def test_deploy_diff_piped_is_a_patch_that_applies(
    demo_hosts: tuple[Path, dict[str, Path]], cli: Callable[..., Any], tmp_path: Path
) -> None:
    """`deploy --dry-run --diff > x.patch` (stdout not a terminal): every line as the diff
    has it, none wrapped at 80 columns (a wrapped line loses its `+`), so that patch(1) and
    `git apply` take it against a copy of the host's site-packages and leave the bundle's
    files there. The tables around it are text patch(1) skips."""
    from ddtree_ops.patching.bundle import load_bundle
    from ddtree_ops.shipped import DEFAULT_BUNDLE

    inventory, prefixes = demo_hosts
    done = cli("-i", str(inventory), "deploy", "sim-b300", "--dry-run", "--diff")
    assert done.exit_code == 0, done.stderr
    diff = tmp_path / "x.patch"
    diff.write_text(done.stdout)
    assert any(len(line) > WIDTH and line.startswith("+") for line in done.stdout.splitlines())  # long lines whole
    site = tmp_path / "site-packages"
    shutil.copytree(purelib(prefixes["sim-b300"]), site)
    checked = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(site), "-i", str(diff)], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    if shutil.which("git"):
        subprocess.run(["git", "init", "-q", str(site)], check=True)
        applies = subprocess.run(["git", "apply", "--check", "-p1", str(diff)], cwd=site, capture_output=True,
                                 text=True)
        assert applies.returncode == 0, applies.stderr
    subprocess.run(["patch", "-p1", "-s", "-d", str(site), "-i", str(diff)], check=True)
    bundle = load_bundle(DEFAULT_BUNDLE)
    placed = {p.relative_to(site).as_posix(): p.read_bytes() for p in site.rglob("*") if p.is_file()}
    for f in bundle.files:
        name = os.path.normpath(os.path.join("sglang", f.path))
        assert placed.get(name) == f.content, name
