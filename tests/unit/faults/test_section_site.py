"""The ``section`` fault site: parsed like the others, due only as a section returns at its boundary."""

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
