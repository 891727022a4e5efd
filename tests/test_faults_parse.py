from __future__ import annotations

import pytest

from checkpointless.errors import ConfigError
from checkpointless.faults.inject import FaultSpec, parse_faults

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
        ("kill:rank=x", "integers"),
        ("kill:when=3", "bad fault option"),
        ("raise:site=elsewhere", "unknown fault site"),
    ],
)
def test_bad_specs_name_the_problem(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_faults([text], 4)
