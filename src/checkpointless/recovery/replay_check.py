"""A replayed step checked against the attempt a fault interrupted: the run-time half of
``checkpointless audit`` (issue 38).

A step is a function of the state it starts from and its index; the recovery makes a replay
start from exactly the state the interrupted attempt started from (the replica's state, this
rank's own generators and loader positions). So a replay whose loss differs from the
interrupted attempt's means that something the step computes is not such a function: a data
order seeded from the time, a replacement's generator that no record restored, a kernel that is
not deterministic. Nothing fails, and the job would go on to a result that differs from the run
without the fault; this says so as it happens.

What is compared: the ``loss`` value the script gave ``job.record(loss=...)`` in the attempt a
fault interrupted on this rank (kept by ``StepRecord.interrupt``) and in the first replay of
that step here, as JSON (a float's every bit). Only a rank that lived through the fault has the
interrupted attempt's value: a replacement's predecessor took its own with it. So a replacement's
own divergence shows on the survivors when the recorded loss is one every rank shares (an
all-reduced loss); a per-rank loss shows a survivor's own. The check costs a dict lookup per
commit, and one JSON dump of one value per recovery.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["ReplayCheck", "ReplayVerdict", "loss_fingerprint"]


def loss_fingerprint(value: Any) -> str:
    """``value`` (a float, an int, a tensor's ``tolist()``-able value) as JSON: equal strings for
    equal values, bit for bit (floats go through ``repr``)."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):  # a tensor or NumPy value: its numbers, not its printout
        value = tolist()
    return json.dumps(value, sort_keys=True, default=repr)


@dataclass(frozen=True)
class ReplayVerdict:
    """Step ``step``'s replay next to the interrupted attempt: ``interrupted`` and ``replayed``
    are the two loss fingerprints."""

    step: int
    interrupted: str
    replayed: str

    @property
    def same(self) -> bool:
        return self.interrupted == self.replayed


class ReplayCheck:
    """The interrupted attempt's loss of the step a recovery replays on this rank, until that
    step commits."""

    def __init__(self) -> None:
        self._armed: tuple[int, str] | None = None  # (step, its interrupted attempt's loss)

    def arm(self, interrupted: tuple[int, dict[str, Any]] | None, target: int) -> None:
        """A recovery resumes at step ``target``; ``interrupted``: the step a fault interrupted
        here and the fields it had recorded (None: this rank was not in a step, or is new). A
        replay of that very step, with a ``loss`` recorded, is checked as it commits."""
        self._armed = None
        if interrupted is None:
            return
        index, fields = interrupted
        if index == target and "loss" in fields:
            self._armed = (index, loss_fingerprint(fields["loss"]))

    def check(self, index: int, fields: dict[str, Any]) -> ReplayVerdict | None:
        """Step ``index`` commits with ``fields`` recorded: the verdict if it is the replay armed
        for (and recorded a loss again), else None."""
        armed = self._armed
        if armed is None or armed[0] != index:
            return None
        self._armed = None
        if "loss" not in fields:
            return None
        return ReplayVerdict(index, armed[1], loss_fingerprint(fields["loss"]))
