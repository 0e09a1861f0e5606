"""Grid expansion, grouping into launches (live switching or one launch per tree) and
restart-minimising order (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_ops.bench.plan import Cell, LaunchConfig, Sampling, ServerConfig, estimate_seconds, expand_cells, plan_sweep
from ddtree_ops.bench.sweep import parse_sweep
from ddtree_ops.errors import SweepError


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
    # every baseline runs the same sampling x concurrency grid as the DDTree cells; DFlash
    # once per verify width of the budgets 4, 8, 16 (root + budget), up to its block of 16
    assert len(base) == (1 + 3) * 2 * 2
    assert {c.server for c in base} == {ServerConfig("autoregressive"), ServerConfig("dflash", 5),
                                        ServerConfig("dflash", 9), ServerConfig("dflash", 16)}
    assert len({c.key for c in cells}) == len(cells)
    assert {c.server.key for c in base} == {"autoregressive", "dflash-n5", "dflash-n9", "dflash-n16"}


def test_dflash_baseline_widths_follow_the_budgets_up_to_the_drafter_block(tmp_path: Path) -> None:
    def widths(**extra) -> list[int | None]:
        cells = expand_cells(spec(tmp_path, baselines=["dflash"], **extra))
        return sorted({c.server.budget for c in cells if c.server.algorithm == "dflash"}, key=lambda w: w or 0)

    assert widths(dflash_block=8) == [5, 8]  # budgets 8 and 16 both meet the longest chain, 8
    assert widths(grid={"budget": [2, 3], "topk": [2]}) == [3, 4]
    # No DDTree cell to match: DFlash at the drafter's own block (no --speculative-num-draft-tokens).
    assert widths(grid={"algorithm": ["autoregressive"]}) == [None]
    with pytest.raises(SweepError, match=r"s\.yaml: dflash_block: .*2"):
        spec(tmp_path, baselines=["dflash"], dflash_block=1)


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


def test_relaunch_always_is_one_launch_per_server_config_in_order(tmp_path: Path) -> None:
    plan = plan_sweep(spec(tmp_path, baselines=["dflash", "autoregressive"], repeats=2, relaunch="always"))
    launches = [g.launch for g in plan.groups]
    assert len(launches) == len(set(launches)) == plan.restarts == 3 * 2 + 1 + 3
    assert [lc.server for lc in launches[:4]] == [ServerConfig("autoregressive"), ServerConfig("dflash", 5),
                                                  ServerConfig("dflash", 9), ServerConfig("dflash", 16)]
    assert launches[4:] == sorted(launches[4:], key=lambda s: (s.budget, s.topk))
    assert not any(lc.live for lc in launches) and plan.switches == 0
    assert plan.runs == len(plan.cells) * 2
    # within a group, sampling changes are ordered and never interleave server configs
    for g in plan.groups:
        assert all(c.server == g.launch.server and not c.switched for c in g.cells)
        temps = [c.sampling.temperature for c in g.cells]
        assert temps == sorted(temps)


def test_live_switching_puts_the_whole_ddtree_grid_on_one_launch(tmp_path: Path) -> None:
    s = spec(tmp_path, baselines=["dflash", "autoregressive"], repeats=2)
    assert s.relaunch == "never"  # the default
    plan = plan_sweep(s)
    # AR, DFLASH per verify width, and ONE DDTree launch holding every budget, top-k up to
    # the largest asked.
    assert plan.restarts == 5
    ar, *dflash, tree = (g.launch for g in plan.groups)
    assert ar.server == ServerConfig("autoregressive")
    assert [d.server for d in dflash] == [ServerConfig("dflash", w) for w in (5, 9, 16)]
    assert not ar.live and not any(d.live for d in dflash)
    assert tree.live and tree.budgets == (4, 8, 16) and tree.topk_max == 4
    assert (tree.budget, tree.topk) == (4, 2)  # launched at the first tree it measures
    cells = plan.groups[-1].cells
    assert len(cells) == 3 * 2 * 2 * 2 and all(c.switched and c.launch == tree for c in cells)
    # Cells go tree by tree (a switch only where the tree changes), sampling ordered within.
    trees = [(c.server.budget, c.server.topk) for c in cells]
    assert trees == sorted(trees)
    assert plan.switches == len(cells) * 2  # every run is switched and proven, repeats too
    # The same cells as relaunching, keyed the same: a ledger of one mode resumes the other.
    always = plan_sweep(s, relaunch="always")
    assert {c.key for c in always.cells} == {c.key for c in plan.cells}


def test_the_budgets_sweep_is_6_launches_per_host_live_and_35_relaunching() -> None:
    from ddtree_ops.bench.sweep import load_sweep

    s = load_sweep(Path(__file__).resolve().parents[2] / "bench_configs" / "budgets.yaml")
    live, old = plan_sweep(s), plan_sweep(s, relaunch="always")
    # AR, DFlash at widths 5, 9, 13 and 16 (budgets 16 and up meet the block), DDTree.
    assert (live.restarts, old.restarts) == (1 + 4 + 1, 1 + 4 + 30)
    assert live.groups[-1].launch.budgets == (4, 8, 12, 16, 24, 32, 48, 64)
    assert live.groups[-1].launch.topk_max == 8
    assert len(live.cells) == len(old.cells) == (1 + 4 + 30) * 9


def test_a_ddtree_only_sweep_and_one_tree_sweeps(tmp_path: Path) -> None:
    one = plan_sweep(spec(tmp_path, grid={"budget": [8], "topk": [4]}))
    # One tree is still a live launch (its cells are switched and proven like any other).
    assert one.restarts == 1 and one.groups[0].launch.budgets == (8,) and one.groups[0].launch.live
    ar_only = plan_sweep(spec(tmp_path, grid={"algorithm": ["autoregressive"]}))
    assert ar_only.restarts == 1 and not ar_only.groups[0].launch.live and ar_only.switches == 0


def test_launch_serves_only_its_algorithm_budgets_and_topks(tmp_path: Path) -> None:
    tree = plan_sweep(spec(tmp_path)).groups[0].launch
    assert tree.serves(ServerConfig("ddtree", 8, 4)) and tree.serves(ServerConfig("ddtree", 16, 1))
    assert not tree.serves(ServerConfig("ddtree", 12, 4))  # not a state of the set
    assert not tree.serves(ServerConfig("ddtree", 8, 8))  # above topk_max
    assert not tree.serves(ServerConfig("dflash"))
    with pytest.raises(ValueError, match="relaunch must be one of never, always"):
        plan_sweep(spec(tmp_path), relaunch="sometimes")


def test_current_server_first_and_done_cells_skipped(tmp_path: Path) -> None:
    s = spec(tmp_path, relaunch="always")
    current = LaunchConfig("ddtree", 16, 4)
    first = plan_sweep(s, current=current)
    assert first.groups[0].launch == current
    done = {c.key for c in first.groups[0].cells} | {first.groups[1].cells[0].key}
    resumed = plan_sweep(s, current=current, done=done)
    assert current not in {g.launch for g in resumed.groups}
    assert len(resumed.cells) == len(first.cells) - len(done)
    # Live: resuming keeps the one launch with the whole set, fewer cells on it.
    live = plan_sweep(spec(tmp_path), done=done)
    assert live.restarts == 1 and live.groups[0].launch.budgets == (4, 8, 16)
    assert len(live.cells) == len(first.cells) - len(done)


def test_estimate_grows_with_restarts_and_load_time(tmp_path: Path) -> None:
    plan = plan_sweep(spec(tmp_path, relaunch="always"))
    small = estimate_seconds(plan, load_s=10, num_prompts=8, max_new_tokens=32, s_per_step=0.01)
    large = estimate_seconds(plan, load_s=360, num_prompts=8, max_new_tokens=32, s_per_step=0.01)
    assert large - small == pytest.approx((360 - 10) * plan.restarts)
    waves = sum((-(-8 // c.concurrency)) + 1 for c in plan.cells)
    assert small == pytest.approx(10 * plan.restarts + waves * 32 * 0.01)


def test_live_estimate_pays_one_load_and_a_switch_per_run(tmp_path: Path) -> None:
    s = spec(tmp_path, repeats=2)
    live, old = plan_sweep(s), plan_sweep(s, relaunch="always")
    kw = {"load_s": 360, "num_prompts": 8, "max_new_tokens": 32, "s_per_step": 0.01}
    measuring = estimate_seconds(old, **kw) - 360 * old.restarts
    assert estimate_seconds(live, **kw, switch_s=0.5) == pytest.approx(360 + measuring + 0.5 * live.switches)
    assert estimate_seconds(live, **kw) < estimate_seconds(old, **kw) / 4


def test_cell_ids_name_the_tree_top_k_and_the_sampling_top_k_apart() -> None:
    """A cell id says which top-k is the tree's and which the sampler's (the sweep's own key
    names), and a live launch's budgets never read as a decimal ("b4.8.16")."""
    cell = Cell(ServerConfig("ddtree", 16, 4), Sampling(0.7, 0.95, 20), 8)
    assert cell.key == "ddtree-b16-topk4|t0.7-top_p0.95-top_k20|c8"
    live = LaunchConfig("ddtree", 4, 4, budgets=(4, 8, 16), topk_max=4)
    assert live.key == "ddtree-states-b4,8,16-topk4"
