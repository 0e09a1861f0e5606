"""The per-batch-size policy ``tune`` writes: which tree per machine type and concurrency,
eager and CUDA-graph cells kept apart, and the refusals, on hand-built ledgers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from report_rows import make_row

from ddtree_ops.bench.ledger import append_row
from ddtree_ops.errors import BenchError, ConfigError
from ddtree_ops.report.policy import Policy, policy_file_name, tune_ledgers

CT200 = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
B300 = "NVIDIA B300 SXM6 AC"


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    for row in rows:
        append_row(path, row)
    return path


def cells(rows: dict[tuple[int, int, int], float], **fields: Any) -> list[dict[str, Any]]:
    """One ok row per ((budget, topk, concurrency) -> output tok/s)."""
    return [
        make_row(budget=b, topk=k, concurrency=c, output_tok_s=tok_s, **fields)
        for (b, k, c), tok_s in rows.items()
    ]


def only(policies: tuple[Policy, ...], machine: str) -> Policy:
    (policy,) = [p for p in policies if p.machine == machine]
    return policy


def test_best_tree_per_concurrency_becomes_the_contract_file(tmp_path: Path) -> None:
    ledger = write(tmp_path / "l.jsonl", [
        *cells({(8, 4, 1): 300.0, (16, 4, 1): 340.0, (16, 2, 1): 320.0,
                (8, 4, 8): 900.0, (16, 4, 8): 700.0, (4, 2, 8): 880.0}, host="ct-a", gpu_name=CT200),
        make_row(algorithm="AR", concurrency=1, output_tok_s=100.0, host="ct-a", gpu_name=CT200),
        make_row(algorithm="AR", concurrency=8, output_tok_s=400.0, host="ct-a", gpu_name=CT200),
    ])
    tuning = tune_ledgers([ledger])
    policy = only(tuning.policies, CT200)
    assert [(e.concurrency, e.budget, e.topk) for e in policy.entries] == [(1, 16, 4), (8, 8, 4)]
    assert policy.budgets == (8, 16) and policy.topk_max == 4 and policy.cuda_graph
    assert (policy.launch.budget, policy.launch.topk) == (16, 4)
    assert json.loads(policy.render()) == {"ddtree": {
        "budgets": [8, 16], "topk_max": 4,
        "policy": {"1": {"budget": 16, "topk": 4}, "8": {"budget": 8, "topk": 4}},
    }}
    assert policy.entries[1].runner_up == "DDTREE b=4 k=2 (-2.2%)"
    assert policy.entries[0].speedup_vs_ar == pytest.approx(3.4)
    assert tuning.host_machines == {"ct-a": CT200} and policy.hosts == ("ct-a",)
    assert policy_file_name(policy.machine) == "nvidia-rtx-pro-6000-blackwell-workstation-edition.json"


def test_one_policy_per_machine_type_pooling_its_hosts(tmp_path: Path) -> None:
    ledger = write(tmp_path / "l.jsonl", [
        *cells({(16, 4, 1): 340.0, (8, 4, 1): 300.0}, host="ct-a", gpu_name=CT200, repeat=0),
        *cells({(16, 4, 1): 330.0, (8, 4, 1): 310.0}, host="ct-b", gpu_name=CT200, repeat=0),
        *cells({(4, 2, 1): 500.0, (8, 2, 1): 450.0}, host="b3", gpu_name=B300),
    ])
    tuning = tune_ledgers([ledger])
    assert [p.machine for p in tuning.policies] == sorted([B300, CT200])
    ct = only(tuning.policies, CT200)
    assert ct.hosts == ("ct-a", "ct-b") and ct.entries[0].budget == 16
    assert ct.entries[0].output_tok_s == 335.0  # the median of both hosts' rows
    assert only(tuning.policies, B300).policy_map() == {"1": {"budget": 4, "topk": 2}}
    # --machine narrows to one machine type
    assert [p.machine for p in tune_ledgers([ledger], machines=[B300]).policies] == [B300]


def test_eager_cells_are_left_out_where_graph_cells_exist(tmp_path: Path) -> None:
    # The B300 story: budget 16 fell back to eager and measured higher than any graph
    # cell would be compared to; it must not win against the graph cells.
    ledger = write(tmp_path / "l.jsonl", [
        *cells({(4, 2, 1): 300.0, (8, 2, 1): 320.0}, gpu_name=B300),
        *cells({(16, 2, 1): 900.0}, gpu_name=B300, cuda_graph=False),
    ])
    policy = only(tune_ledgers([ledger]).policies, B300)
    assert policy.cuda_graph and policy.policy_map() == {"1": {"budget": 8, "topk": 2}}
    assert policy.budgets == (8,)
    assert any("1 eager cell(s) left out (DDTREE b=16 k=2 eager)" in note for note in policy.notes)


def test_a_machine_with_only_eager_cells_is_tuned_among_them_and_says_so(tmp_path: Path) -> None:
    ledger = write(tmp_path / "l.jsonl", cells({(4, 2, 1): 300.0, (16, 2, 1): 320.0}, cuda_graph=False))
    policy = tune_ledgers([ledger]).policies[0]
    assert not policy.cuda_graph and policy.launch.budget == 16
    assert policy.notes == ("no CUDA-graph DDTREE cells: chosen among eager cells",)


def test_a_concurrency_measured_only_eager_beside_graph_ones_is_refused(tmp_path: Path) -> None:
    ledger = write(tmp_path / "l.jsonl", [
        *cells({(4, 2, 1): 300.0}, gpu_name=B300),
        *cells({(16, 2, 8): 900.0}, gpu_name=B300, cuda_graph=False),
    ])
    with pytest.raises(ConfigError, match=r"concurrency 8 has only eager DDTREE cells") as info:
        tune_ledgers([ledger])
    assert str(ledger) in str(info.value) and info.value.exit_code == 2


def test_temperature_is_chosen_by_flag_and_greedy_by_default(tmp_path: Path) -> None:
    ledger = write(tmp_path / "l.jsonl", [
        *cells({(16, 4, 1): 340.0, (8, 4, 1): 300.0}, temperature=0.0),
        *cells({(16, 4, 1): 200.0, (8, 4, 1): 250.0}, temperature=0.6),
    ])
    assert tune_ledgers([ledger]).policies[0].launch.budget == 16
    sampled = tune_ledgers([ledger], temperature=0.6).policies[0]
    assert sampled.launch.budget == 8 and sampled.temperature == 0.6


def test_refusals_name_the_ledger_and_what_is_missing(tmp_path: Path) -> None:
    ledger = write(tmp_path / "l.jsonl", [
        *cells({(16, 4, 1): 340.0}, gpu_name=CT200, temperature=0.6),
        make_row(algorithm="AR", gpu_name=B300),
    ])
    with pytest.raises(ConfigError) as no_temperature:
        tune_ledgers([ledger], machines=[CT200])
    assert str(no_temperature.value) == (
        f"{ledger}: machine type {CT200}: no DDTREE rows at temperature 0 (DDTREE rows at: 0.6); "
        "choose one with --temperature"
    )
    with pytest.raises(ConfigError) as no_trees:
        tune_ledgers([ledger], temperature=0.6)
    assert str(no_trees.value) == f"{ledger}: machine type {B300}: no DDTREE rows (only AR); nothing to tune"
    with pytest.raises(ConfigError, match=r"no rows for machine type 'H200' \(the ledger has: NVIDIA B300"):
        tune_ledgers([ledger], machines=["H200"])
    # one line each: the CLI prints it as it is
    assert "\n" not in str(no_temperature.value) + str(no_trees.value)


def test_a_concurrency_whose_every_tree_was_refused_is_a_bench_error(tmp_path: Path) -> None:
    rows = [make_row(budget=8, repeat=i, output_tok_s=500.0) for i in range(3)]
    rows += [make_row(budget=8, concurrency=4, repeat=i, output_tok_s=900.0, failed=1) for i in range(3)]
    ledger = write(tmp_path / "l.jsonl", rows)
    with pytest.raises(BenchError, match=r"concurrency 4: every one of its 1 DDTREE cell\(s\) was refused "
                                         r"\(first: 3 failed request\(s\); min repeats 3\)") as info:
        tune_ledgers([ledger])
    assert info.value.exit_code == 6


def test_cells_under_several_workloads_are_refused(tmp_path: Path) -> None:
    ledger = write(tmp_path / "l.jsonl", [
        *cells({(16, 4, 1): 340.0}, workload_hash="w1"),
        *cells({(8, 4, 1): 300.0}, workload_hash="w2"),
    ])
    with pytest.raises(ConfigError, match=r"under 2 different settings of workload_hash"):
        tune_ledgers([ledger])


def test_an_empty_or_missing_ledger_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such ledger file"):
        tune_ledgers([tmp_path / "absent.jsonl"])
    (tmp_path / "empty.jsonl").write_text("not json\n")
    with pytest.raises(ConfigError, match=r"empty.jsonl: no valid ledger rows in 1 file"):
        tune_ledgers([tmp_path / "empty.jsonl"])


def test_tune_without_out_or_deploy_says_nothing_was_written(tmp_path: Path, cli) -> None:
    ledger = write(tmp_path / "l.jsonl", cells({(8, 4, 1): 300.0, (16, 4, 1): 340.0}, host="ct-a", gpu_name=CT200))
    res = cli("tune", str(ledger))
    assert res.exit_code == 0, res.stderr
    tail = " ".join(res.stdout.split()[-24:])
    assert tail.endswith("Nothing written: --out DIR writes these files, --deploy TARGETS puts each machine type's on "
                         "its hosts and restarts them with it."), tail
    assert not list(tmp_path.glob("*.json"))
