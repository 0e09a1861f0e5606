"""Prompt files: schema, line-numbered errors, deterministic workload and its hash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_ops.errors import SweepError
from ddtree_ops.shipped import PROJECT_PROMPTS
from ddtree_ops.workload.draw import Workload, build_workload
from ddtree_ops.workload.prompts import find_prompt_set, load_prompt_file


def test_shipped_sets_are_valid_and_categorised() -> None:
    files = find_prompt_set("mixed")
    assert {f.stem for f in files} >= {"code", "math", "chat"}
    for f in files:
        prompts = load_prompt_file(f)
        assert len(prompts) >= 10
        assert {p.category for p in prompts} == {f.stem}
    chat = load_prompt_file(PROJECT_PROMPTS / "chat.jsonl")
    assert any(p.messages for p in chat)
    assert all(p.text.endswith("assistant:") for p in chat if p.messages)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "not valid JSON"),
        ('{"promt": "x"}', "unknown key 'promt'"),
        ('{"prompt": ""}', "prompt must be a non-empty string"),
        ('{"prompt": "x", "messages": []}', "exactly one of"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0]"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_line_reports_its_number(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two"}\n' + line + "\n")
    with pytest.raises(SweepError) as info:
        load_prompt_file(path)
    assert f"{path}:4:" in str(info.value)
    assert needle in str(info.value)


def test_json_file_forms(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text(json.dumps([{"prompt": "x"}, {"prompt": "y", "category": "chat"}]))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"prompts": [{"prompt": "z"}]}))
    assert [p.text for p in load_prompt_file(a)] == ["x", "y"]
    assert [p.text for p in load_prompt_file(b)] == ["z"]
    c = tmp_path / "c.json"
    c.write_text(json.dumps([{"prompt": "x"}, {"bad": 1}]))
    with pytest.raises(SweepError, match=r"c\.json\[1\]: unknown key 'bad'"):
        load_prompt_file(c)


def test_workload_is_deterministic_and_hashed(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5)))
    w = Workload(prompt_files=(path,), num_prompts=12, max_new_tokens=16, seed=3)
    one, two = build_workload(w), build_workload(w)
    assert one == two and len(one.prompts) == 12
    # cycling covers the pool evenly before repeating any prompt
    assert {p.text for p in one.prompts[:5]} == {f"p{i}" for i in range(5)}
    other_seed = build_workload(Workload(prompt_files=(path,), num_prompts=12, max_new_tokens=16, seed=4))
    longer = build_workload(Workload(prompt_files=(path,), num_prompts=12, max_new_tokens=17, seed=3))
    assert len({one.workload_hash, other_seed.workload_hash, longer.workload_hash}) == 3


def test_dry_run_validates_prompt_files_line_by_line(cli, tmp_path: Path) -> None:
    """`bench --dry-run` reads the prompt files as the run does: a bad line is one error
    naming file:line (exit 2), not a plan that fails once the first server is up."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"promt": "typo"}\n')
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        "name: s\ntargets: [h]\ngrid: {budget: [4]}\nworkload: {prompt_files: [p.jsonl], num_prompts: 2}\n"
    )
    res = cli("bench", "--sweep", str(sweep), "--dry-run")
    assert res.exit_code == 2, res
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{prompts}:2: unknown key 'promt'" in lines[0], res.stderr
