"""The ``section`` and ``closed`` fault sites: parsed like the others, due only at their boundary
(``section`` as a section returns, ``closed`` as the rank passes its closing barrier)."""

from __future__ import annotations

import pytest

from checkpointless.faults.inject import InjectedFault, Injector
from checkpointless.testing import SITES, FaultSpec, parse_faults

pytestmark = pytest.mark.timeout(10)


def test_a_section_fault_is_parsed_and_written_back_as_given() -> None:
    (spec,) = parse_faults(["raise:rank=0:step=5:site=section"], 2)
    assert "section" in SITES and spec == FaultSpec("raise", 0, 5, "section")
    assert spec.to_text() == "raise:rank=0:step=5:site=section"


def test_a_section_fault_fires_at_its_boundary_only_and_once() -> None:
    announced: list[tuple[str, int]] = []
    injector = Injector(
        parse_faults(["raise:rank=0:step=5:site=section"], 2),
        0,
        set(),
        lambda s, at: announced.append((s.id, at)),
    )
    for site in ("step", "forward", "allreduce", "optimizer"):
        injector.maybe_fire(site, 5)  # the step's own sites at the same index: not this fault
    injector.maybe_fire("section", 4)  # another boundary
    assert not announced
    with pytest.raises(InjectedFault):
        injector.maybe_fire("section", 5)
    injector.maybe_fire("section", 5)  # a redone section does not fire it again
    assert announced == [("raise:rank=0:step=5:site=section", 5)]


def test_a_closed_fault_is_its_own_site_at_its_boundary_only_and_once() -> None:
    (spec,) = parse_faults(["kill:rank=1:step=5:site=closed"], 2)
    assert "closed" in SITES and spec == FaultSpec("kill", 1, 5, "closed")
    assert spec.to_text() == "kill:rank=1:step=5:site=closed"
    announced: list[tuple[str, int]] = []
    injector = Injector(
        parse_faults(["raise:rank=0:step=5:site=closed"], 2),
        0,
        set(),
        lambda s, at: announced.append((s.id, at)),
    )
    injector.maybe_fire("section", 5)  # the section returning, before its closing barrier: not this one
    injector.maybe_fire("closed", 4)
    assert not announced
    with pytest.raises(InjectedFault):
        injector.maybe_fire("closed", 5)
    injector.maybe_fire("closed", 5)  # the same boundary after the recovery: once
    assert announced == [("raise:rank=0:step=5:site=closed", 5)]
