"""The run-time replay check (recovery/replay_check.py): only the first replay of the very step a
fault interrupted, with a loss recorded in both, is compared, bit for bit; the commit event says
which, and a difference goes to the coordinator as ``ReplayDiffers``."""

from __future__ import annotations

import pytest
import torch

from checkpointless.protocol import Message, ReplayDiffers
from checkpointless.recovery.commit import check_replay
from checkpointless.recovery.job import Job
from checkpointless.recovery.replay_check import ReplayCheck, loss_fingerprint

pytestmark = pytest.mark.timeout(30)


def test_fingerprints_are_exact_and_read_tensors_as_numbers() -> None:
    assert loss_fingerprint(0.1) == loss_fingerprint(0.1)
    assert loss_fingerprint(0.1) != loss_fingerprint(0.1 + 2**-55)  # one bit apart
    assert loss_fingerprint(torch.tensor(0.5)) == loss_fingerprint(0.5)
    assert loss_fingerprint(torch.tensor([0.5, 1.0])) == loss_fingerprint([0.5, 1.0])


def test_only_the_replay_of_the_interrupted_step_is_checked_once() -> None:
    check = ReplayCheck()
    check.arm((7, {"loss": 1.5}), 8)  # rolled forward: step 7 committed, 8 is not a replay
    assert check.check(8, {"loss": 2.0}) is None
    check.arm((7, {"batch": "x"}), 7)  # no loss recorded before the fault: nothing to compare
    assert check.check(7, {"loss": 2.0}) is None
    check.arm(None, 7)  # a replacement, or a rank that was between steps
    assert check.check(7, {"loss": 2.0}) is None
    check.arm((7, {"loss": 1.5}), 7)
    assert check.check(6, {"loss": 1.5}) is None  # another step leaves it armed
    verdict = check.check(7, {"loss": 1.5})
    assert verdict is not None and verdict.same
    assert check.check(7, {"loss": 9.0}) is None  # once: the first replay only
    check.arm((7, {"loss": 1.5}), 7)
    verdict = check.check(7, {"loss": 1.25})
    assert (
        verdict is not None
        and not verdict.same
        and (verdict.interrupted, verdict.replayed) == ("1.5", "1.25")
    )


def test_a_commit_marks_the_replay_and_reports_a_difference() -> None:
    m = Job(None).internals
    sent: list[Message] = []
    m.recovery.send = sent.append  # type: ignore[method-assign]
    m.replay.arm((3, {"loss": 0.75}), 3)
    m.record.fields = {"loss": 0.75}
    check_replay(m, 3)
    assert m.record.fields["replay_loss"] == "same" and not sent
    m.replay.arm((5, {"loss": 0.75}), 5)
    m.record.fields = {"loss": 0.5}
    check_replay(m, 5)
    assert m.record.fields["replay_loss"] == "differs"
    assert sent == [ReplayDiffers(step=5, interrupted="0.75", replayed="0.5", generation=m.generation)]
