"""Pure tests of the launch spec and the version-aware eager-flag table."""

from __future__ import annotations

import shlex

import pytest

from ddtree_ops.errors import ConfigError
from ddtree_ops.inventory.schema import owned_flag_problem
from ddtree_ops.inventory_types import DdtreeSettings, Host, ServerSettings
from ddtree_ops.service.launch import RunConfig, build_launch_spec, eager_flags, parse_version


def make_host(**server: object) -> Host:
    settings = {"model_path": "/models/qwen", "draft_model_path": "/models/qwen-dflash", "port": 30100}
    settings.update(server)
    return Host(
        name="h1",
        connection="local",
        ddtree=DdtreeSettings(python="/opt/py/bin/python", server=ServerSettings(**settings)),
    )


@pytest.mark.parametrize(
    ("version", "flags"),
    [
        ("0.5.23", ("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")),
        ("0.5.23-sim", ("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")),
        ("0.6.0", ("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")),
        ("0.5.22", ("--disable-cuda-graph",)),
        ("0.4.9.post2", ("--disable-cuda-graph",)),
    ],
)
def test_eager_flags_follow_the_version_table(version: str, flags: tuple[str, ...]) -> None:
    assert eager_flags(version) == flags


def test_parse_version_rejects_garbage() -> None:
    assert parse_version("v0.5.23rc1") == (0, 5, 23)
    with pytest.raises(ConfigError, match="cannot read SGLang version"):
        parse_version("unknown")


def test_ddtree_argv_and_launch_command() -> None:
    spec = build_launch_spec(make_host(), RunConfig("DDTREE", budget=16, topk=4), "0.5.23", cuda_graph=True)
    assert spec.argv[:3] == ("/opt/py/bin/python", "-m", "sglang.launch_server")
    args = spec.server_args
    assert args[args.index("--speculative-algorithm") + 1] == "DDTREE"
    # DDTREE speaks SGLang's generic fields: the verify window is the root + the budget.
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "17"
    assert args[args.index("--speculative-eagle-topk") + 1] == "4"
    assert not any(a.startswith("--speculative-ddtree") for a in args)
    assert "--speculative-dflash-block-size" not in args  # the draft block comes from the draft model
    assert "--cuda-graph-backend-decode" not in args
    # SGLang reports " ".join(argv[1:]) of launch_server as launch_command.
    assert spec.launch_command == " ".join(spec.argv[3:])


def test_ddtree_budget_16_topk_4_is_17_draft_tokens_topk_4() -> None:
    spec = build_launch_spec(make_host(), RunConfig("DDTREE", budget=16, topk=4), "0.5.23", cuda_graph=True)
    assert spec.server_args[-8:] == (
        "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", "/models/qwen-dflash",
        "--speculative-num-draft-tokens", "17", "--speculative-eagle-topk", "4",
    )
    assert "--speculative-num-draft-tokens 17 --speculative-eagle-topk 4" in spec.launch_command


def test_dflash_budget_stays_the_draft_token_count() -> None:
    spec = build_launch_spec(make_host(), RunConfig("DFLASH", budget=16), "0.5.23", cuda_graph=True)
    assert spec.server_args[-2:] == ("--speculative-num-draft-tokens", "16")
    assert "--speculative-eagle-topk" not in spec.server_args


def test_eager_spec_uses_remote_version_flags() -> None:
    new = build_launch_spec(make_host(), RunConfig("DDTREE", budget=16, topk=4), "0.5.23", cuda_graph=False)
    old = build_launch_spec(make_host(), RunConfig("DDTREE", budget=16, topk=4), "0.5.10", cuda_graph=False)
    assert new.server_args[-4:] == (
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
    )
    assert old.server_args[-1] == "--disable-cuda-graph"
    assert new.argv_hash != old.argv_hash


def test_eager_without_version_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="h1: remote SGLang version unknown"):
        build_launch_spec(make_host(), RunConfig("AR"), None, cuda_graph=False)


def test_ar_has_no_speculative_flags_and_command_template_is_honoured() -> None:
    spec = build_launch_spec(
        make_host(command="{python} -m ddtree_ops.sim"), RunConfig("AR"), "0.5.23", cuda_graph=True
    )
    assert spec.argv[:3] == ("/opt/py/bin/python", "-m", "ddtree_ops.sim")
    assert not any(a.startswith("--speculative") for a in spec.argv)


def test_hostile_extra_args_stay_single_argv_entries() -> None:
    hostile = ("--served-model-name", "x; touch /tmp/pwned $(id) `id`", "--tokenizer-path", "' \" \\n")
    spec = build_launch_spec(
        make_host(extra_args=("--log-level", "info")), RunConfig("AR", extra_args=hostile), "0.5.23", cuda_graph=True
    )
    assert spec.argv[-4:] == hostile
    assert spec.argv[-6:-4] == ("--log-level", "info")
    # The shell rendering (for display only) round-trips to the same list.
    assert tuple(shlex.split(spec.display())) == spec.argv


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"algorithm": "EAGLE"}, "algorithm must be one of"),
        ({"algorithm": "AR", "budget": 4}, "budget/topk only apply"),
        ({"algorithm": "DDTREE", "budget": 0, "topk": 4}, "budget must be a positive integer"),
        ({"algorithm": "DDTREE", "budget": 257, "topk": 4}, "budget must be at most 256 for DDTREE"),
        ({"algorithm": "DDTREE", "budget": 16, "topk": 1000}, "topk must be at most 256"),
        ({"algorithm": "DFLASH", "budget": 8, "topk": 2}, "topk only applies to DDTREE"),
        ({"algorithm": "AR", "cuda_graph": "maybe"}, "cuda_graph must be"),
    ],
)
def test_run_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig(**kwargs)  # type: ignore[arg-type]


def test_missing_model_or_draft_names_the_key() -> None:
    with pytest.raises(ConfigError, match="model_path is not set"):
        build_launch_spec(make_host(model_path=None), RunConfig("AR"), "0.5.23", cuda_graph=True)
    with pytest.raises(ConfigError, match="draft_model_path"):
        build_launch_spec(
            make_host(draft_model_path=None), RunConfig("DDTREE", budget=8, topk=2), "0.5.23", cuda_graph=True
        )
    with pytest.raises(ConfigError, match="DDTREE needs both"):
        build_launch_spec(make_host(), RunConfig("DDTREE", budget=8), "0.5.23", cuda_graph=True)


def test_adaptive_config_is_one_argv_element_after_the_launch_state() -> None:
    path = "/run/ddtree states/adaptive.json"  # a space must not split it
    run = RunConfig("DDTREE", budget=4, topk=2, adaptive_config=path)
    spec = build_launch_spec(make_host(), run, "0.5.23", cuda_graph=True)
    args = spec.server_args
    assert args[args.index("--speculative-adaptive-config") + 1] == path
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "5"
    assert tuple(shlex.split(spec.display())) == spec.argv
    plain = build_launch_spec(make_host(), RunConfig("DDTREE", budget=4, topk=2), "0.5.23", cuda_graph=True)
    assert "--speculative-adaptive-config" not in plain.server_args
    assert spec.argv_hash != plain.argv_hash
    assert "adaptive_config=" in run.describe()
    with pytest.raises(ConfigError, match="only applies to DDTREE"):
        RunConfig("DFLASH", budget=16, adaptive_config=path)
    with pytest.raises(ConfigError, match="must be a path on the host"):
        RunConfig("DDTREE", budget=4, topk=2, adaptive_config=" ")


def test_an_algorithm_is_named_either_way_and_printed_one_way() -> None:
    from ddtree_ops.service.launch import parse_algorithm

    for text, name in (("AR", "AR"), ("autoregressive", "AR"), ("Ar", "AR"), ("dflash", "DFLASH"),
                       (" DDTree ", "DDTREE")):
        assert parse_algorithm(text) == name
    with pytest.raises(ConfigError, match="unknown algorithm 'eagle' .*expected AR, DFLASH or DDTREE"):
        parse_algorithm("eagle")


@pytest.mark.parametrize(
    ("run", "version"),
    [
        (RunConfig("AR"), "0.5.23"),
        (RunConfig("DFLASH", budget=8), "0.5.22"),
        (RunConfig("DDTREE", budget=16, topk=4, adaptive_config="/run/states.json"), "0.5.23"),
    ],
)
def test_every_flag_ddtree_ops_launches_with_is_refused_as_an_extra_arg(run: RunConfig, version: str) -> None:
    # The list the inventory and --extra-arg check against must name every flag the
    # launch builder sets (graphs on and off), or an extra arg could override it.
    for cuda_graph in (True, False):
        args = build_launch_spec(make_host(), run, version, cuda_graph=cuda_graph).server_args
        flags = [a for a in args if a.startswith("--")]
        assert flags and all(owned_flag_problem(flag) for flag in flags), flags
        with pytest.raises(ConfigError, match=f"--extra-arg {flags[-1]}: ddtree-ops sets {flags[-1]} itself"):
            RunConfig("AR", extra_args=("--log-level", "info", flags[-1], "x"))
