"""Degraded mode: the global generators of each slot this process holds for a lost rank.

The global generators (torch's, Python's, NumPy's) are per-rank state (recovery/rank_rng.py): a
script that seeds them per rank, or draws dropout masks from them, draws different numbers on
each rank. A holder that ran a held slot's pass on its own generators would draw the holder's
numbers for the lost rank's micro-batch, and its own next step would start further along its
stream: neither as without the fault. So each held slot has generators of its own, swapped in
for its pass and out after it:

- They start where the lost rank left them: its record of the step the job resumes at, in the
  job's shared memory (the ``rank<k>`` files its own keeper wrote, read by a keeper of that
  rank in this process). Without one (the lost rank's host is gone with its files; a keeper on
  another host is not asked here), the pass starts from the holder's generators and the run is
  reported inexact, as a replacement without its record is.
- During the pass the job's record keeping is the slot's (``member.replicas.rank_rng`` is that
  keeper): where the slot's next step starts is written to the slot's files as the pass's
  collectives and update begin, as its own rank would have, so a replay of the step restarts
  the pass from the step's start, and the spare that takes the slot back resumes the slot's
  generators, not the holder's.
- The holder's own record of where its next step starts is kept as its own pass ends (its
  update and first collective come in the last pass, under the slot's keeper).
"""

from __future__ import annotations

from collections.abc import Callable

from checkpointless.recovery.rank_rng import RankRngKeeper, rank_rng_dir
from checkpointless.recovery.replicas import ReplicaKeeper
from checkpointless.state.snapshot import RngState, capture_rng, restore_rng

__all__ = ["HeldGenerators"]


class HeldGenerators:
    """The held slots' generators and record keepers (empty at full width)."""

    def __init__(self) -> None:
        self._keepers: dict[int, RankRngKeeper] = {}
        # while a held slot's pass runs: this rank's own keeper and generators, put back after it
        self._own: tuple[RankRngKeeper, RngState] | None = None

    def own_pass_ended(self, replicas: ReplicaKeeper, index: int) -> None:
        """This rank's own pass of a degraded step ended cleanly: its generators now stand where
        its step ``index + 1`` starts (no update of its own runs before the last pass)."""
        replicas.rank_rng.keep(index + 1, capture_rng())

    def enter(
        self,
        replicas: ReplicaKeeper,
        job_id: str | None,
        slot: int,
        index: int,
        inexact: Callable[[str], None],
    ) -> None:
        """Before held slot ``slot``'s pass of step ``index``: its generators and keeper in.
        ``inexact(detail)`` reports a pass that starts without the slot's own generators."""
        keeper = self._keepers.get(slot)
        if keeper is None:
            keeper = self._keepers[slot] = RankRngKeeper()
            keeper.configure(rank_rng_dir(job_id) if job_id else None, slot)
        own = capture_rng()
        record = keeper.load(index)
        if record is not None:
            rng = record.rng
        else:
            rng = own
            inexact(
                f"no record of slot {slot}'s own generators for step {index} on this host: its "
                "pass runs on the holder's (a script that draws per-rank random numbers from the "
                "global generators may now differ from the run without the fault)"
            )
        keeper.at_entry(index, rng)  # a replay of the step restarts the pass from here
        self._own = (replicas.rank_rng, own)
        replicas.rank_rng = keeper
        restore_rng(rng)

    def leave(self, replicas: ReplicaKeeper) -> None:
        """After a held slot's pass (clean or not): this rank's own generators and keeper back."""
        if self._own is None:
            return
        keeper, rng = self._own
        self._own = None
        replicas.rank_rng = keeper
        restore_rng(rng)

    def release(self, keep: list[int]) -> None:
        """Forget the slots not in ``keep`` (spares took them back): their files are theirs."""
        for slot in set(self._keepers) - set(keep):
            self._keepers.pop(slot).configure(None, -1)
