"""On-host load generation end to end: a sweep whose client runs on the host, over the
local transport and over real SSH, against the simulator bound to loopback."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from minisglang import deployed_python

from ddtree_ops.bench.lifetime import SweepOptions
from ddtree_ops.bench.onhost import client_mode
from ddtree_ops.bench.prepare import prepare_sweep
from ddtree_ops.bench.runner import Progress, SweepRunner
from ddtree_ops.bench.services import default_services
from ddtree_ops.inventory_types import Host
from ddtree_ops.report import build_report
from ddtree_ops.sim.server import chat_template_text
from ddtree_ops.sim.text import tokenize
from ddtree_ops.workload.draw import build_workload
from ddtree_ops.workload.prompt import chat_messages

from .test_runner import local_host, rows_of, sim_server, stop_all, sweep

GRID = {"algorithm": ["ddtree"], "budget": [4], "topk": [2], "temperature": [0.0], "concurrency": [2]}


def with_bind(host: Host, bind_host: str) -> Host:
    server = dataclasses.replace(host.ddtree.server, bind_host=bind_host)
    return dataclasses.replace(host, ddtree=dataclasses.replace(host.ddtree, server=server))


def test_default_is_host_for_a_loopback_server_and_the_sweep_can_override() -> None:
    h = Host(name="h")
    assert client_mode(h, None) == "host"  # the default bind is 127.0.0.1
    assert client_mode(with_bind(h, "::1"), None) == "host"
    assert client_mode(with_bind(h, "localhost"), None) == "host"
    assert client_mode(with_bind(h, "0.0.0.0"), None) == "local"
    assert client_mode(with_bind(h, "10.0.0.5"), None) == "local"
    assert client_mode(h, "local") == "local" and client_mode(with_bind(h, "0.0.0.0"), "host") == "host"


def test_sweep_with_client_host_writes_ok_rows_measured_on_the_host(tmp_path: Path) -> None:
    host = local_host(tmp_path, "sim-h")
    spec = sweep(tmp_path, baselines=[], grid=GRID, client="host")
    out = tmp_path / "ledger.jsonl"
    events: list[Progress] = []
    try:
        outcome = SweepRunner(prepare_sweep(spec, [host]), build_workload(spec.workload), ledger_path=out,
                              options=SweepOptions(smoke=False), on_progress=events.append).run()
    finally:
        stop_all([host])
    rows = rows_of(out)
    assert not outcome.failed, rows
    assert [(r["status"], r["client"]) for r in rows] == [("ok", "host")]
    # Each request's record reached the controller as it finished, before the row was written.
    phases = [(e.phase, e.message) for e in events if e.phase in ("running", "row")]
    assert phases[-5:] == [("running", f"{k}/4 requests") for k in range(1, 5)] + [("row", "")]
    row = rows[0]
    assert row["completed"] == 4 and row["total_output_tokens"] == 4 * 16
    assert row["itl_ms_mean"] > 0 and row["ttft_ms_mean"] > 0
    # /server_info was read through the host client too: the simulator's version is on the row.
    assert row["sglang_version"] == "0.5.23-sim"


@pytest.mark.fleet
def test_sweep_over_ssh_measures_a_loopback_server_from_the_host(ssh_fleet, tmp_path: Path) -> None:
    fleet_host = ssh_fleet.hosts[0]
    h = ssh_fleet.load().hosts[fleet_host.name]
    server = sim_server(fleet_host.gpu, port=fleet_host.server_port)
    # An interpreter with the DDTree bundle deployed (the fleet hosts' own have none).
    host = dataclasses.replace(h, ddtree=dataclasses.replace(h.ddtree, python=deployed_python(), server=server))
    assert host.ddtree.server.bind_host == "127.0.0.1"
    spec = sweep(tmp_path, baselines=[], grid=GRID)  # no client key: loopback -> host
    out = tmp_path / "ledger.jsonl"
    try:
        outcome = SweepRunner(prepare_sweep(spec, [host]), build_workload(spec.workload), ledger_path=out,
                              options=SweepOptions(smoke=False),
                              services=default_services(host_key_policy="strict")).run()
    finally:
        stop_all([host])
    rows = rows_of(out)
    assert not outcome.failed, rows
    assert [(r["status"], r["client"]) for r in rows] == [("ok", "host")]
    assert rows[0]["completed"] == 4 and rows[0]["sglang_version"] == "0.5.23-sim"


@pytest.mark.parametrize("client", ["local", "host"])
def test_a_data_set_mix_is_sent_through_the_served_models_template_and_broken_down(
    tmp_path: Path, client: str
) -> None:
    questions = tmp_path / "question.jsonl"
    questions.write_text(
        '{"question_id": 81, "category": "writing", "turns": ["Write a haiku about the sea.", "Now in French."]}\n'
        '{"question_id": 111, "category": "math", "turns": ["Solve 3 * x + 7 = 22 for x.", "And for 25?"]}\n'
    )
    host = local_host(tmp_path, f"sim-{client}")
    workload = {"datasets": [{"name": "mtbench", "path": str(questions)}, "humaneval"], "num_prompts": 4,
                "max_new_tokens": 8}
    spec = sweep(tmp_path, baselines=["autoregressive"], grid=GRID, client=client, workload=workload)
    wl = build_workload(spec.workload)
    out = tmp_path / "ledger.jsonl"
    try:
        outcome = SweepRunner(prepare_sweep(spec, [host]), wl, ledger_path=out, options=SweepOptions(smoke=False)).run()
    finally:
        stop_all([host])
    ar, row = rows_of(out)
    assert ar["algorithm"] == "AR" and row["algorithm"] == "DDTREE"
    assert not outcome.failed and row["status"] == "ok", row
    assert row["workload_name"] == "mtbench+humaneval" and row["workload_prompt_format"] == "chat-template+text"
    # The server counted the prompts it was sent: chat prompts as its own template renders
    # them (the simulator's `role: content` lines and `assistant:`), HumanEval as its text;
    # each MT-Bench question's second turn as the conversation with the model's answer in it
    # (so more than the same conversation with an empty answer).
    first_turns = sum(len(tokenize(chat_template_text(chat_messages(p.messages)) if p.chat else p.text))
                      for p in wl.prompts)
    without_answers = sum(
        len(tokenize(chat_template_text(chat_messages((*p.messages, ("assistant", ""), ("user", q))))))
        for p in wl.prompts for q in p.followups)
    followups = sum(len(p.followups) for p in wl.prompts)
    assert followups == 2  # both questions drawn, one follow-up each
    assert (row["completed"], row["failed"]) == (4 + followups, 0)
    assert row["total_input_tokens"] > first_turns + without_answers
    groups = [g["group"] for g in row["categories"]]
    assert groups == sorted({p.group for p in wl.prompts})
    assert {g.split("/")[0] for g in groups} == {"mtbench", "humaneval"}
    assert sum(g["requests"] for g in row["categories"]) == 4 + followups
    for g in row["categories"]:
        assert g["completed"] == g["requests"] and g["output_tokens"] == 8 * g["requests"]
        assert g["accept_length"] >= 1.0 and g["user_tok_s"] > 0
    # T = 0: the tree's outputs are the target's own, turn for turn (a second turn carries
    # the first turn's answer, so a lossy first turn changes both), and the report says so.
    assert len(row["output_hashes"]) == 4 + followups and None not in row["output_hashes"]
    assert row["output_hashes"] == ar["output_hashes"]
    tidy = build_report([out]).tidy
    (cell,) = tidy[tidy["algorithm"] == "DDTREE"].itertuples()
    assert (cell.t0_prompts, cell.t0_match_frac) == (4 + followups, 1.0)
