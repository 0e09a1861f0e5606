"""Grid expansion and restart-minimising order (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_ops.bench.plan import ServerConfig, estimate_seconds, expand_cells, plan_sweep
from ddtree_ops.bench.sweep import parse_sweep


def spec(tmp_path: Path, **extra):
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    doc = {
        "name": "t",
        "targets": ["local"],
        "grid": {"budget": [16, 4, 8], "topk": [2, 4], "temperature": [0.6, 0.0], "concurrency": [1, 8]},
        "workload": {"prompt_files": ["p.jsonl"]},
    } | extra
    return parse_sweep(doc, tmp_path / "s.yaml")


def test_grid_product_and_baselines(tmp_path: Path) -> None:
    cells = expand_cells(spec(tmp_path, baselines=["autoregressive", "dflash"]))
    ddtree = [c for c in cells if c.server.algorithm == "ddtree"]
    base = [c for c in cells if c.baseline]
    assert len(ddtree) == 3 * 2 * 2 * 2
    # every baseline runs the same sampling x concurrency grid as the DDTree cells
    assert len(base) == 2 * 2 * 2
    assert {c.server for c in base} == {ServerConfig("autoregressive"), ServerConfig("dflash")}
    assert len({c.key for c in cells}) == len(cells)


def test_exclude_and_include(tmp_path: Path) -> None:
    s = spec(
        tmp_path,
        baselines=["autoregressive"],
        exclude=[{"budget": [4, 8], "topk": 4}, {"concurrency": 8, "temperature": 0.6}],
        include=[{"budget": 64, "topk": 8}],
    )
    cells = expand_cells(s)
    servers = {c.server for c in cells}
    assert ServerConfig("ddtree", 4, 4) not in servers and ServerConfig("ddtree", 8, 4) not in servers
    assert ServerConfig("ddtree", 16, 4) in servers
    assert not any(c.concurrency == 8 and c.sampling.temperature == 0.6 for c in cells)
    # include fills unspecified axes with the first grid value
    extra = [c for c in cells if c.server == ServerConfig("ddtree", 64, 8)]
    assert len(extra) == 1 and extra[0].sampling.temperature == 0.6 and extra[0].concurrency == 1
    # budget/topk rules never remove baseline cells
    assert any(c.server.algorithm == "autoregressive" and c.concurrency == 1 for c in cells)


def test_one_restart_per_server_config_in_order(tmp_path: Path) -> None:
    plan = plan_sweep(spec(tmp_path, baselines=["dflash", "autoregressive"], repeats=2))
    servers = [g.server for g in plan.groups]
    assert len(servers) == len(set(servers)) == plan.restarts == 3 * 2 + 2
    assert servers[:2] == [ServerConfig("autoregressive"), ServerConfig("dflash")]
    assert servers[2:] == sorted(servers[2:], key=lambda s: (s.budget, s.topk))
    assert plan.runs == len(plan.cells) * 2
    # within a group, sampling changes are ordered and never interleave server configs
    for g in plan.groups:
        assert all(c.server == g.server for c in g.cells)
        temps = [c.sampling.temperature for c in g.cells]
        assert temps == sorted(temps)


def test_current_server_first_and_done_cells_skipped(tmp_path: Path) -> None:
    s = spec(tmp_path)
    current = ServerConfig("ddtree", 16, 4)
    first = plan_sweep(s, current=current)
    assert first.groups[0].server == current
    done = {c.key for c in first.groups[0].cells} | {first.groups[1].cells[0].key}
    resumed = plan_sweep(s, current=current, done=done)
    assert current not in {g.server for g in resumed.groups}
    assert len(resumed.cells) == len(first.cells) - len(done)


def test_estimate_grows_with_restarts_and_load_time(tmp_path: Path) -> None:
    plan = plan_sweep(spec(tmp_path))
    small = estimate_seconds(plan, load_s=10, num_prompts=8, max_new_tokens=32, s_per_step=0.01)
    large = estimate_seconds(plan, load_s=360, num_prompts=8, max_new_tokens=32, s_per_step=0.01)
    assert large - small == pytest.approx((360 - 10) * plan.restarts)
    waves = sum((-(-8 // c.concurrency)) + 1 for c in plan.cells)
    assert small == pytest.approx(10 * plan.restarts + waves * 32 * 0.01)
