"""Degraded mode's held slots when a spare takes one back (issue 39): the slot's groups are
aborted and put aside on the recovery's path, never destroyed there. Destroying a gloo group
whose collective the grow round cut off joins gloo's threads, which wait out that collective's
timeout: the holder then reached the new generation's formation 60 s late and every member
waited for it (seen in 2 of 7 runs of examples/train_gpt.py whose spare was ready at once).
Their parked groups are dropped later, by ``release()``, off the training thread."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from checkpointless.comm.communicator import Communicator
from checkpointless.recovery.slots import HeldSlots

pytestmark = pytest.mark.timeout(30)


class Slow(Communicator):
    """A held slot's communicator whose groups' destruction would block (gloo's threads waiting
    out a cut-off collective); records what the slots did with it."""

    def __init__(self, slot: int) -> None:
        super().__init__(slot, 4, datetime.timedelta(seconds=60), backend="gloo")
        self.aborted_for: str | None = None
        self.released = threading.Event()

    def abort(self, reason: str) -> int:
        self.aborted_for = reason
        return 1

    def close(self) -> None:
        time.sleep(60)  # what destroying a group whose collective was cut off costs

    def release_graveyard(self) -> None:
        self.released.set()


def test_a_slot_taken_back_is_aborted_and_set_aside_not_destroyed_on_the_recovery_s_path() -> None:
    held = HeldSlots()
    comm = Slow(2)
    held.slots = [2]
    held._comms[2] = comm  # what an earlier generation's start_forming left
    t0 = time.monotonic()
    threads = held.start_forming(
        [], 4, 5, lambda slot: dist.HashStore(), Slow(0), None, time.monotonic() + 5, threading.Event()
    )
    assert time.monotonic() - t0 < 1.0, "the recovery's path waited on a retired slot's groups"
    assert threads == [] and held.slots == [] and held.comms(Slow(0)) == []
    assert comm.aborted_for is not None and "slot 2" in comm.aborted_for
    assert held.abort("a later fault") == 0, "a retired slot is no longer aborted with the held ones"
    held.release()
    assert comm.released.is_set(), "release() drops the retired slot's parked groups"
