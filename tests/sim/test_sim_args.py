"""Flag parsing and simulation settings (pure: no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_ops.sim.args import DDTreeConfig, SimSettingsError, parse_server_args, sim_settings_from_env
from ddtree_ops.sim.profiles import PROFILES


def _parse(*flags: str):
    return parse_server_args(["--model-path", "m", *flags])


def test_ddtree_defaults_and_flat_names() -> None:
    # No tree flags: the verify window is the draft block (16), i.e. budget 15; top-k 4.
    args, warnings = _parse("--speculative-algorithm", "ddtree")
    assert warnings == []
    assert args.speculative_algorithm == "DDTREE"
    assert args.ddtree == DDTreeConfig(budget=15, topk=4, draft_block_size=16)
    assert (args.speculative_num_draft_tokens, args.speculative_eagle_topk) == (16, 4)
    assert (args.speculative_dflash_block_size, args.speculative_num_steps) == (16, 1)
    assert args.draft_depth == 15 and args.draft_positions == 16
    assert args.cuda_graph_backend_decode == "full" and args.decode_cuda_graph
    assert "ddtree" not in args.as_dict()  # reported as its own object, not as a flat field


def test_ddtree_generic_fields_have_eagle_meaning() -> None:
    args, _ = _parse("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "17",
                     "--speculative-eagle-topk", "4")
    tree = args.ddtree
    assert tree is not None
    assert (tree.budget, tree.topk, tree.draft_block_size) == (16, 4, 16)
    assert (tree.verify_width, tree.max_depth) == (17, 15)
    assert (args.speculative_num_draft_tokens, args.speculative_eagle_topk, args.speculative_num_steps) == (17, 4, 1)
    # The block never follows the budget: a small tree still drafts the whole block.
    small, _ = _parse("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "5")
    assert small.ddtree is not None
    assert (small.ddtree.budget, small.ddtree.max_depth, small.draft_depth) == (4, 4, 15)
    big, _ = _parse("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "257")
    assert big.ddtree is not None and big.ddtree.budget == 256


def test_ddtree_draft_block_comes_from_the_draft_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained = tmp_path / "draft-b8"
    trained.mkdir()
    (trained / "config.json").write_text(json.dumps({"dflash_config": {"block_size": 8}}))
    args, _ = _parse("--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(trained))
    assert args.ddtree == DDTreeConfig(budget=7, topk=4, draft_block_size=8)
    same, _ = _parse("--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(trained),
                     "--speculative-dflash-block-size", "8")
    assert same.ddtree == args.ddtree
    with pytest.raises(SystemExit) as exc:
        _parse("--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(trained),
               "--speculative-dflash-block-size", "16")
    assert exc.value.code == 2
    assert (
        "error: --speculative-dflash-block-size 16 differs from the draft model's trained block_size 8"
        in capsys.readouterr().err
    )

    untrained = tmp_path / "draft-no-block"
    untrained.mkdir()
    (untrained / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    given, _ = _parse("--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(untrained),
                      "--speculative-dflash-block-size", "12")
    assert given.ddtree is not None and given.ddtree.draft_block_size == 12
    with pytest.raises(SystemExit):
        _parse("--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(untrained))
    assert "config has no block_size; pass --speculative-dflash-block-size" in capsys.readouterr().err


def test_dflash_forces_the_eagle_fields_to_1_with_sglangs_warning() -> None:
    args, warnings = _parse("--speculative-algorithm", "DFLASH", "--speculative-eagle-topk", "4")
    assert (args.speculative_eagle_topk, args.speculative_num_steps, args.ddtree) == (1, 1, None)
    assert warnings == ["DFLASH only supports speculative_eagle_topk == 1; overriding speculative_eagle_topk=4 to 1."]


def test_autoregressive_has_no_spec_fields() -> None:
    args, _ = _parse()
    assert not args.speculating
    assert args.speculative_num_draft_tokens is None and args.ddtree is None
    assert args.speculative_eagle_topk is None and args.draft_positions == 0


def test_dflash_block_size_is_an_alias_of_num_draft_tokens() -> None:
    args, _ = _parse("--speculative-algorithm", "DFLASH", "--speculative-dflash-block-size", "8")
    assert args.speculative_num_draft_tokens == 8
    with pytest.raises(SystemExit) as exc:
        _parse("--speculative-algorithm", "DFLASH", "--speculative-dflash-block-size", "8",
               "--speculative-num-draft-tokens", "4")
    assert exc.value.code == 2


def test_disable_cuda_graph_is_deprecated_and_disables_both_phases() -> None:
    args, warnings = _parse("--disable-cuda-graph")
    assert (args.cuda_graph_backend_decode, args.cuda_graph_backend_prefill) == ("disabled", "disabled")
    assert len(warnings) == 1 and "'--disable-cuda-graph' is deprecated" in warnings[0]


@pytest.mark.parametrize(
    "flags",
    [
        ("--cuda-graph-max-bs", "8"),  # removed in 0.5.23: ambiguous between the per-phase flags
        ("--no-such-flag",),
        ("--cuda-graph-backend-decode", "sometimes"),
        ("--speculative-algorithm", "MEDUSA"),
        ("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "0"),
        ("--speculative-algorithm", "DDTREE", "--speculative-num-draft-tokens", "258"),
        ("--speculative-algorithm", "DDTREE", "--speculative-eagle-topk", "0"),
        ("--speculative-algorithm", "DDTREE", "--speculative-num-steps", "3"),
        ("--speculative-algorithm", "DFLASH", "--speculative-num-draft-tokens", "0"),
    ],
)
def test_bad_flags_exit_2(flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(*flags)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--speculative-ddtree-budget", "--speculative-ddtree-topk"])
def test_old_ddtree_flags_are_unknown_like_real_sglang(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The plugin cannot add flags: SGLang's parser refuses them before any DDTREE code runs.
    with pytest.raises(SystemExit) as exc:
        _parse("--speculative-algorithm", "DDTREE", flag, "8")
    assert exc.value.code == 2
    assert f"error: unrecognized arguments: {flag} 8" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--speculative-num-draft-tokens", "1"),
            "--speculative-num-draft-tokens is the DDTREE verify window (root + budget nodes)"
            " and must be in 2..257, got 1.",
        ),
        (("--speculative-eagle-topk", "0"), "--speculative-eagle-topk must be >= 1, got 0."),
    ],
)
def test_ddtree_range_errors_are_one_line_naming_the_flag(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse("--speculative-algorithm", "DDTREE", *flags)
    assert exc.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [f"python -m ddtree_ops.sim: error: {message}"]


def test_settings_from_env_and_errors_name_the_variable() -> None:
    s = sim_settings_from_env({"SIM_GPU": "b300", "SIM_LOAD_S": "360", "SIM_TIME_SCALE": "0.01", "SIM_SEED": "9"})
    assert (s.gpu, s.load_s, s.seed) == ("b300", 360.0, 9)
    assert s.scaled(360.0) == pytest.approx(3.6)
    for env, name in [({"SIM_GPU": "a100"}, "SIM_GPU"), ({"SIM_LOAD_S": "soon"}, "SIM_LOAD_S"),
                      ({"SIM_TIME_SCALE": "-1"}, "SIM_TIME_SCALE"), ({"SIM_SEED": "x"}, "SIM_SEED")]:
        with pytest.raises(SimSettingsError, match=name):
            sim_settings_from_env(env)


def test_cost_model_shape() -> None:
    p = PROFILES["b300"]
    ar = p.step_ms(batch=1, verify_tokens=1, draft_positions=0)
    # Memory-bound: a 17-token tree verify costs little more than one token ...
    small = p.step_ms(batch=1, verify_tokens=17, draft_positions=0)
    assert ar < small < ar * 1.05
    # ... but past the knee every extra token costs the slope.
    big = p.step_ms(batch=8, verify_tokens=65, draft_positions=0)
    bigger = p.step_ms(batch=8, verify_tokens=66, draft_positions=0)
    assert bigger - big == pytest.approx(8 * (p.attn_ms_per_token + p.slope_ms_per_token))
    assert p.step_ms(batch=1, verify_tokens=17, draft_positions=16) > small
    assert p.step_ms(batch=0, verify_tokens=0, draft_positions=0) == 0.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, tuple(range(8))),
        ("", ()),
        ("3", (3,)),
        ("2,3", (2, 3)),
        (" 6 , 7 ", (6, 7)),
        ("1,9,2", (1,)),  # CUDA stops at the first invalid index
        ("1,1,2", (1,)),  # and at a repeated one
        ("GPU-0a1b", ()),
        ("-1,0", ()),
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value: str | None, expected: tuple[int, ...]) -> None:
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert sim_settings_from_env(env).visible_gpus(8) == expected
