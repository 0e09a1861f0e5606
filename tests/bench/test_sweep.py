"""Sweep-file validation: every bad input names the file and the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from ddtree_ops.bench.sweep import check_targets, load_sweep
from ddtree_ops.errors import SweepError, TargetError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, doc: dict, *, prompts: bool = True) -> Path:
    if prompts:
        (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n')
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def base() -> dict:
    return {
        "name": "t",
        "targets": ["local"],
        "grid": {"budget": [4, 8], "temperature": [0.0, 0.6]},
        "workload": {"prompt_files": ["p.jsonl"], "num_prompts": 4},
    }


def test_shipped_sweeps_load() -> None:
    demo = load_sweep(REPO / "bench_configs" / "demo.yaml")
    budgets = load_sweep(REPO / "bench_configs" / "budgets.yaml")
    assert demo.targets == ("local",)
    assert budgets.grid["budget"] == (4, 8, 12, 16, 24, 32, 48, 64)
    assert budgets.grid["temperature"] == (0.0, 0.6, 1.0)
    assert set(budgets.baselines) == {"autoregressive", "dflash"}


def test_defaults_and_relative_prompt_file(tmp_path: Path) -> None:
    spec = load_sweep(write(tmp_path, base()))
    assert spec.grid["topk"] == (4,) and spec.grid["concurrency"] == (1,)
    assert spec.workload.prompt_files == ((tmp_path / "p.jsonl").resolve(),)
    assert spec.repeats == 1 and spec.api == "generate"
    assert spec.client is None  # decided per host by the server's bind address
    assert load_sweep(write(tmp_path, base() | {"client": "host"})).client == "host"
    assert spec.relaunch == "never"  # live switching unless the sweep asks for relaunches
    assert load_sweep(write(tmp_path, base() | {"relaunch": "always"})).relaunch == "always"


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.update(budgte=[1]), "budgte: unknown key"),
        (lambda d: d["grid"].update(bugdet=[1]), "grid.bugdet: unknown axis (did you mean 'budget'?;"),
        (lambda d: d.update(grid={}), "grid: is empty"),
        (lambda d: d["grid"].update(budget=[]), "grid.budget: is an empty list"),
        (lambda d: d["grid"].update(budget=[8, 0]), "grid.budget: must be an integer from 1 to 256, got 0"),
        (lambda d: d["grid"].update(budget=[-4]), "grid.budget: must be an integer from 1 to 256"),
        # The CLI's bounds (restart --budget refuses > 256), and sane loads.
        (lambda d: d["grid"].update(budget=[1000]), "grid.budget: must be an integer from 1 to 256, got 1000"),
        (lambda d: d["grid"].update(budget=["1e30"]), "grid.budget: must be an integer from 1 to 256, got '1e30'"),
        (lambda d: d["grid"].update(budget=[1e30]), "grid.budget: must be an integer from 1 to 256"),
        (lambda d: d["grid"].update(topk=[100000]), "grid.topk: must be an integer from 1 to 256, got 100000"),
        (lambda d: d["grid"].update(concurrency=[10**7]), "grid.concurrency: must be an integer from 1 to 4096"),
        (lambda d: d["workload"].update(max_new_tokens=10**8), "workload.max_new_tokens: must be an integer from 1"),
        (lambda d: d["workload"].update(num_prompts=10**9), "workload.num_prompts: must be an integer from 1"),
        (lambda d: d.update(repeats=10**6), "repeats: must be an integer from 1 to 1000"),
        # NaN and infinities are numbers to YAML, never to a sweep.
        (lambda d: d["grid"].update(temperature=[float("nan")]), "grid.temperature: must be a finite number, got nan"),
        (lambda d: d["grid"].update(temperature=[float("inf")]), "grid.temperature: must be a finite number, got inf"),
        (lambda d: d["grid"].update(top_p=[float("nan")]), "grid.top_p: must be a finite number"),
        (lambda d: d.update(request_rate=float("nan")), "request_rate: must be a positive finite number"),
        (lambda d: d.update(request_rate=float("inf")), "request_rate: must be a positive finite number"),
        (lambda d: d.update(request_timeout_s=float("nan")), "request_timeout_s: must be a positive finite number"),
        (lambda d: d.update(request_timeout_s=float("inf")), "request_timeout_s: must be a positive finite number"),
        # The name names the ledger file.
        (lambda d: d.update(name="a\0b"), "name: must have no '/' and no control characters"),
        (lambda d: d.update(name="a\x1b[2Jb"), "name: must have no '/' and no control characters"),
        (lambda d: d.update(name="a/b"), "name: must have no '/'"),
        (lambda d: d.update(name="n" * 300), "name: is longer than 200 bytes"),
        (lambda d: d["grid"].update(temperature=[-0.1]), "grid.temperature: must be >= 0"),
        (lambda d: d["grid"].update(top_p=[1.5]), "grid.top_p: must be in (0, 1]"),
        (lambda d: d["grid"].update(algorithm=["eagle"]), "unknown algorithm 'eagle'"),
        (lambda d: d.update(baselines=["ddtree"]), "baselines: unknown baseline 'ddtree'"),
        (lambda d: d["workload"].update(prompt_files=["missing.jsonl"]), "prompt file not found"),
        (lambda d: d["workload"].update(num_promts=3), "workload.num_promts: unknown key"),
        (lambda d: d.update(baselines=["eagle"]), "baselines: unknown algorithm 'eagle'"),
        (lambda d: d.update(exclude=[{"budget": 4, "colour": 1}]), "exclude[0].colour: unknown axis"),
        (lambda d: d.update(repeats=0), "repeats: must be an integer from 1 to 1000, got 0"),
        (lambda d: d.update(targets=[]), "targets: must be a non-empty list"),
        (lambda d: d["workload"].update(prompt_set="nosuchset"), "unknown prompt set 'nosuchset'"),
        (lambda d: d.update(client="remote"), "client: must be one of local, host, got 'remote'"),
        (lambda d: d.update(relaunch="sometimes"), "relaunch: must be one of never, always"),
        (lambda d: d.update(relaunch=True), "relaunch: must be one of never, always"),
    ],
)
def test_bad_sweeps_name_file_and_key(tmp_path: Path, mutate, needle: str) -> None:
    doc = base()
    mutate(doc)
    path = write(tmp_path, doc)
    with pytest.raises(SweepError) as info:
        load_sweep(path)
    assert str(path) in str(info.value)
    assert needle in str(info.value)


def test_algorithms_take_either_spelling(tmp_path: Path) -> None:
    doc = base() | {"baselines": ["AR", "DFLASH"]}
    doc["grid"]["algorithm"] = ["DDTree"]
    spec = load_sweep(write(tmp_path, doc))
    assert spec.baselines == ("autoregressive", "dflash") and spec.grid["algorithm"] == ("ddtree",)


def test_invalid_yaml_reports_line(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: x\ngrid: [1, 2\n")
    with pytest.raises(SweepError, match=r"s\.yaml:\d+: not valid YAML"):
        load_sweep(path)


def test_missing_sweep_file(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match="sweep file not found"):
        load_sweep(tmp_path / "nope.yaml")


def test_a_sweep_that_is_not_a_text_file_is_one_error(tmp_path: Path) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(bytes(range(128, 256)) * 3)
    with pytest.raises(SweepError, match=r"bin\.yaml: not a UTF-8 text file \(byte 0\)"):
        load_sweep(binary)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # nothing ever writes to it: reading it would block for ever
    with pytest.raises(SweepError, match=r"fifo\.yaml: cannot read sweep file: not a regular file"):
        load_sweep(fifo)
    with pytest.raises(SweepError, match=r": cannot read sweep file: is a directory"):
        load_sweep(tmp_path)
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(SweepError, match=r"deep\.yaml: nested too deeply to be a config file"):
        load_sweep(deep)


def test_unknown_target(tmp_path: Path) -> None:
    doc = base()
    doc["targets"] = ["local", "ct9000"]
    spec = load_sweep(write(tmp_path, doc))

    def resolve(name: str) -> list[str]:
        if name == "local":
            return ["sim-a"]
        raise TargetError(f"unknown target {name!r}; known groups: local")

    # The resolver's own message, said once (it used to be nested in a second "unknown target").
    with pytest.raises(SweepError, match=r"targets: unknown target 'ct9000'; known groups: local$"):
        check_targets(spec, resolve)
    check_targets(load_sweep(write(tmp_path, base())), resolve)


def test_sweep_hash_is_the_parsed_content_not_the_file(tmp_path: Path) -> None:
    from ddtree_ops.bench.sweep import sweep_hash

    first = sweep_hash(load_sweep(write(tmp_path, base())))
    assert len(first) == 64 and int(first, 16) >= 0
    # Reflowed YAML, reordered lists, 0 for 0.0, other name/description/targets: same sweep.
    path = tmp_path / "sweep.yaml"
    path.write_text(
        "# same sweep, written differently\n"
        "workload:   {num_prompts: 4, prompt_files: [p.jsonl]}\n"
        "grid:\n  temperature: [0.6, 0]\n  budget: [8, 4]\n  topk: [4]\n"
        "name: renamed\ndescription: hello\ntargets: [elsewhere]\nrequest_timeout_s: 5\n"
    )
    assert sweep_hash(load_sweep(path)) == first
    # What is measured changes the hash.
    for change in ({"grid": {"budget": [4, 16], "temperature": [0.0, 0.6]}}, {"repeats": 2},
                   {"workload": {"prompt_files": ["p.jsonl"], "num_prompts": 8}}, {"baselines": ["dflash"]}):
        assert sweep_hash(load_sweep(write(tmp_path, base() | change))) != first, change


def test_an_unknown_top_key_is_said_with_the_closest_valid_one(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "grid": {"algorithm": ["autoregressive"]}, "repeates": 2}))
    with pytest.raises(SweepError, match=r"repeates: unknown key \(did you mean 'repeats'\?; expected one of api"):
        load_sweep(path)
