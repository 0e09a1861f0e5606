"""The rollout plan: batches, the canary, the stop rule (pure)."""

from __future__ import annotations

import pytest

from ddtree_ops.errors import ConfigError
from ddtree_ops.rollout.plan import Serial, parse_canary, plan_rollout

HOSTS = ["a", "b", "c", "d", "e"]


def test_without_serial_or_canary_every_host_is_one_batch_as_before() -> None:
    plan = plan_rollout(HOSTS)
    assert plan.batches == (tuple(HOSTS),)
    assert not plan.rolling


@pytest.mark.parametrize(("text", "sizes"), [
    ("1", [1, 1, 1, 1, 1]), ("2", [2, 2, 1]), ("5", [5]), ("9", [5]),
    # Ansible's rule: a share rounds down, at least one host.
    ("40%", [2, 2, 1]), ("10%", [1, 1, 1, 1, 1]), ("100%", [5]),
])
def test_serial_batches_in_target_order(text: str, sizes: list[int]) -> None:
    plan = plan_rollout(HOSTS, serial=Serial.parse(text))
    assert [len(b) for b in plan.batches] == sizes
    assert plan.hosts == tuple(HOSTS)


@pytest.mark.parametrize("text", ["0", "-1", "abc", "0%", "101%", "1.5", ""])
def test_a_bad_serial_is_one_line_naming_the_option(text: str) -> None:
    with pytest.raises(ConfigError, match="--serial"):
        Serial.parse(text)


def test_the_canary_is_a_batch_of_its_own_first() -> None:
    plan = plan_rollout(HOSTS, serial=Serial.parse("2"), canary=parse_canary("c", HOSTS))
    assert plan.batches == (("c",), ("a", "b"), ("d", "e"))
    assert plan.canary == ("c",) and plan.rolling
    assert plan.batch_of("d") == 3
    assert plan.lines()[0] == "batch 1 (canary): c"


def test_canary_n_takes_the_first_n_targets_and_the_rest_goes_at_once_without_serial() -> None:
    plan = plan_rollout(HOSTS, canary=parse_canary("2", HOSTS))
    assert plan.batches == (("a", "b"), ("c", "d", "e"))


def test_a_canary_that_is_not_a_target_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="'zz' is not one of the targets"):
        parse_canary("zz", HOSTS)
    with pytest.raises(ConfigError, match="--canary 9"):
        parse_canary("9", HOSTS)


def test_a_host_named_like_a_number_is_a_host() -> None:
    assert parse_canary("2", ["1", "2", "3"]) == ("2",)


def test_max_fail_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="--max-fail"):
        plan_rollout(HOSTS, max_fail=-1)
