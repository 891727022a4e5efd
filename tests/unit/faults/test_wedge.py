"""``wedge``: a fault that lives in the process. The rank raises at its step every time that
process runs it; a fresh process taking the rank (told the fault has fired) trains on."""

from __future__ import annotations

import pytest

from checkpointless.errors import ConfigError
from checkpointless.faults.inject import FaultSpec, InjectedFault, Injector, parse_faults

pytestmark = pytest.mark.timeout(10)


def test_a_wedge_needs_its_rank_and_step() -> None:
    assert parse_faults(["wedge:rank=1:step=8"], 2) == [FaultSpec("wedge", 1, 8)]
    for text in ("wedge:rank=1", "wedge:step=8", "wedge"):
        with pytest.raises(ConfigError, match=r"wedge needs rank= and step=.*wedge:rank=1:step=8") as e:
            parse_faults([text], 2)
        assert repr(text) in str(e.value), "the error quotes the spec"


def test_a_wedge_raises_on_every_retry_in_its_process_and_is_announced_once() -> None:
    [spec] = parse_faults(["wedge:rank=1:step=8"], 2)
    announced: list[tuple[str, int]] = []
    inj = Injector([spec], 1, set(), lambda s, step: announced.append((s.id, step)))
    for _ in range(4):  # the first try and three in-process retries
        with pytest.raises(InjectedFault, match="wedge:rank=1:step=8 at step 8"):
            inj.maybe_fire("step", 8)
    assert announced == [(spec.id, 8)]
    inj.maybe_fire("step", 9)  # other steps and other ranks are untouched
    Injector([spec], 0, set(), lambda s, step: None).maybe_fire("step", 8)


def test_a_fresh_process_told_it_fired_trains_on() -> None:
    [spec] = parse_faults(["wedge:rank=1:step=8"], 2)
    fresh = Injector([spec], 1, {spec.id}, lambda s, step: None)  # the launcher's fired list
    fresh.maybe_fire("step", 8)
