"""The ``p2p`` fault site: parsed like the others, and fired by a send or a receive only.

A pipeline stage's sends and receives reach the job through the process group's
``before_collective`` hook as "send" and "recv" (comm/process_group.py; that they do, through
torch's ``batch_isend_irecv``, is checked on real processes in tests/unit/comm/test_p2p_abort.py);
the step's hooks turn them into the ``p2p`` site and nothing else.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from checkpointless.faults.inject import InjectedFault, Injector
from checkpointless.recovery.guard import UpdateGuard
from checkpointless.testing import SITES, FaultSpec, parse_faults

pytestmark = pytest.mark.timeout(10)


def test_a_p2p_fault_is_parsed_and_written_back_as_given() -> None:
    (spec,) = parse_faults(["kill:rank=2:step=4:site=p2p"], 4)
    assert "p2p" in SITES and spec == FaultSpec("kill", 2, 4, "p2p")
    assert spec.to_text() == "kill:rank=2:step=4:site=p2p"


def _guard(step: int, faults: list[str]) -> tuple[UpdateGuard, list[tuple[str, int]]]:
    """A step's hooks at ``step`` with ``faults`` to fire (a clock stand-in: outside any section)."""
    clock: Any = SimpleNamespace(step_index=step, in_section=None, batch_s=None)
    guard = UpdateGuard(clock, replicas=None, groups=None, timeout=1.0, lockstep=lambda: False)  # type: ignore[arg-type]
    announced: list[tuple[str, int]] = []
    guard.injector = Injector(parse_faults(faults, 2), 1, set(), lambda s, at: announced.append((s.id, at)))
    return guard, announced


@pytest.mark.parametrize("kind", ["send", "recv"])
def test_a_send_or_receive_fires_a_p2p_fault_of_its_step_once(kind: str) -> None:
    guard, announced = _guard(4, ["raise:rank=1:step=4:site=p2p"])
    guard.on_collective("reduce_scatter")  # backward's site, and allreduce's: not this fault
    guard.on_collective("allreduce")
    assert not announced
    with pytest.raises(InjectedFault, match="site=p2p at step 4"):
        guard.on_collective(kind)
    guard.on_collective(kind)  # the replay's send or receive does not fire it again
    assert announced == [("raise:rank=1:step=4:site=p2p", 4)]


def test_a_send_or_receive_is_no_other_site() -> None:
    guard, announced = _guard(4, ["raise:rank=1:step=4:site=allreduce", "raise:rank=1:step=4:site=backward"])
    guard.on_collective("send")
    guard.on_collective("recv")
    assert not announced
    other, _ = _guard(3, ["raise:rank=1:step=4:site=p2p"])
    other.on_collective("send")  # another step's send: not yet
