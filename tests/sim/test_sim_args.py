"""Flag parsing and simulation settings (pure: no processes)."""

from __future__ import annotations

import pytest

from ddtree_ops.sim.args import SimSettingsError, parse_server_args, sim_settings_from_env
from ddtree_ops.sim.profiles import PROFILES


def _parse(*flags: str):
    return parse_server_args(["--model-path", "m", *flags])


def test_ddtree_defaults_and_flat_names() -> None:
    args, warnings = _parse("--speculative-algorithm", "ddtree")
    assert warnings == []
    assert args.speculative_algorithm == "DDTREE"
    assert (args.speculative_ddtree_budget, args.speculative_ddtree_topk) == (16, 4)
    assert args.speculative_num_draft_tokens == 16 and args.draft_depth == 15
    assert args.cuda_graph_backend_decode == "full" and args.decode_cuda_graph


def test_autoregressive_has_no_spec_fields() -> None:
    args, _ = _parse()
    assert not args.speculating
    assert args.speculative_num_draft_tokens is None and args.speculative_ddtree_budget is None


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
        ("--speculative-ddtree-budget", "8"),  # DDTree flags without DDTREE
        ("--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "0"),
    ],
)
def test_bad_flags_exit_2(flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(*flags)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


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
