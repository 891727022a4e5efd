from __future__ import annotations

import pytest

from checkpointless.errors import ConfigError
from checkpointless.testing import FaultSpec, parse_faults

pytestmark = pytest.mark.timeout(10)


def test_parse_specs() -> None:
    specs = parse_faults(
        ["kill:rank=1:step=20", "raise:rank=2:step=5:site=backward", "slow:step=3:seconds=1.5"], 4
    )
    assert specs[0] == FaultSpec("kill", 1, 20)
    assert specs[1].site == "backward"
    assert specs[2].rank is None and specs[2].seconds == 1.5


def test_random_specs_are_deterministic_and_in_range() -> None:
    a = parse_faults(["random:seed=7:count=4:kinds=raise,kill:steps=5-40"], 4)
    b = parse_faults(["random:seed=7:count=4:kinds=raise,kill:steps=5-40"], 4)
    assert a == b and len(a) == 4
    assert all(5 <= s.step <= 40 and 0 <= s.rank < 4 and s.kind in ("raise", "kill") for s in a)  # type: ignore[operator]


@pytest.mark.parametrize(
    "text,match",
    [
        ("explode:rank=1", "unknown fault kind 'explode'"),
        ("kill:rank=9:step=1", "targets rank 9"),
        ("kill:rank=x", "rank='x' is not an integer"),
        ("kill:when=3", "bad fault option 'when=3'"),
        ("raise:site=elsewhere", "unknown fault site 'elsewhere'"),
        # every field of a plain spec: empty, wrong type, negative, out of range, repeated, misplaced
        ("", "empty fault spec"),
        ("   ", "empty fault spec"),
        ("kill:rank=", "rank= has no value"),
        ("kill:rank", "bad fault option 'rank'"),
        ("kill::step=1", "bad fault option ''"),
        ("kill:rank=-1", "rank=-1 must be 0 or more"),
        ("kill:rank=4", "targets rank 4, but the job has 4 ranks"),
        ("kill:step=-3", "step=-3 must be 0 or more"),
        ("kill:step=1.5", "step='1.5' is not an integer"),
        ("kill:rank=1:rank=2", "gives rank= twice"),
        ("slow:seconds=x", "seconds='x' must be a finite number > 0"),
        ("slow:seconds=0", "seconds='0' must be a finite number > 0"),
        ("slow:seconds=nan", "seconds='nan' must be a finite number > 0"),
        ("slow:seconds=inf", "seconds='inf' must be a finite number > 0"),
        ("kill:seconds=2", "seconds= applies to slow faults only"),
        ("randomly:rank=1", "unknown fault kind 'randomly'"),
        # every field of a random spec
        ("random:seed=x", "seed='x' is not an integer"),
        ("random:seed=", "seed= has no value"),
        ("random:count=-1", "count=-1 must be 0 or more"),
        ("random:count=two", "count='two' is not an integer"),
        ("random:steps=40-5", "steps=40-5 is reversed"),
        ("random:steps=5-", "steps='5-' is not a range"),
        ("random:steps=-5", "steps='-5' is not a range"),
        ("random:steps=a-b", "steps='a' is not an integer"),
        ("random:ranks=0-9", "ranks=0-9 goes past 3"),
        ("random:ranks=2-1", "ranks=2-1 is reversed"),
        ("random:kinds=raise,boom", "unknown fault kind 'boom'"),
        ("random:kinds=", "kinds= has no value"),
        ("random:kinds=raise,", "unknown fault kind ''"),
        ("random:rank=1", "bad fault option 'rank=1'"),
        ("random:seed=1:seed=2", "gives seed= twice"),
    ],
)
def test_bad_specs_name_the_problem(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_faults([text], 4)


@pytest.mark.parametrize("text", ["random:seed=x", "kill:rank=x", "random:steps=40-5"])
def test_bad_specs_quote_the_whole_spec(text: str) -> None:
    # The user may pass several --inject flags: the message must say which one is wrong.
    with pytest.raises(ConfigError) as info:
        parse_faults(["kill:rank=1:step=2", text], 4)
    assert repr(text) in str(info.value)


def test_random_edge_values_are_accepted() -> None:
    assert parse_faults(["random:count=0"], 2) == []  # zero faults is a valid rehearsal
    one = parse_faults(["random:seed=3:count=5:steps=7:ranks=1"], 2)
    assert [(s.step, s.rank) for s in one] == [(7, 1)]  # count is capped by the steps available
    assert parse_faults([" kill : rank = 1 : step = 2 "], 2) == [FaultSpec("kill", 1, 2)]
