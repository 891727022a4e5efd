"""Degraded mode: the global generators of each slot this process holds for a lost rank.

The global generators (torch's, Python's, NumPy's) are per-rank state (recovery/rank_rng.py): a
script that seeds them per rank, or draws dropout masks from them, draws different numbers on
each rank. A holder that ran a held slot's pass on its own generators would draw the holder's
numbers for the lost rank's micro-batch, and its own next step would start further along its
stream: neither as without the fault. So each held slot has generators of its own, swapped in
for its pass and out after it:

- They start where the lost rank left them: its record of the step the job resumes at, in the
  job's shared memory (the ``rank<k>`` files its own keeper wrote, read by a keeper of that
  rank in this process), else, when the lost rank's host is gone with its files, the record the
  lost rank kept with its keeper on another host (recovery/rank_rng_peer.py), fetched as the
  degraded generation forms (:meth:`HeldGenerators.missing`, :meth:`HeldGenerators.provide`).
  Without either, the pass starts from the holder's generators and the run is reported inexact,
  as a replacement without its record is.
- The records the holder keeps for a held slot also go to the slot's keeper (:meth:`mirror`),
  as its own rank's would: the spare that takes the slot back, on whatever host, asks its keeper
  for the record of the step it resumes at.
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

from checkpointless.recovery.rank_rng import RankRngKeeper, RngRecord, rank_rng_dir
from checkpointless.recovery.rank_rng_peer import PeerRecords
from checkpointless.recovery.replicas import ReplicaKeeper
from checkpointless.state.snapshot import RngState, capture_rng, restore_rng
from checkpointless.state.transfer import StreamRoute

__all__ = ["HeldGenerators"]


class HeldGenerators:
    """The held slots' generators and record keepers (empty at full width)."""

    def __init__(self) -> None:
        self._keepers: dict[int, RankRngKeeper] = {}
        self._fetched: dict[int, RngRecord] = {}  # slot -> its record from its keeper elsewhere
        self._peers: dict[int, PeerRecords] = {}  # slot -> what sends its records to its keeper
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
        keeper = self._keeper(slot, job_id)
        own = capture_rng()
        record = keeper.load(index)
        fetched = self._fetched.pop(slot, None)
        if record is None and fetched is not None and fetched.step == index:
            record = fetched
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

    def missing(self, slots: list[int], index: int, job_id: str | None) -> list[int]:
        """Those of ``slots`` (held by this process) whose record of step ``index`` is not on
        this host: their lost ranks' hosts are gone with their files."""
        return [s for s in slots if self._keeper(s, job_id).load(index) is None and s not in self._fetched]

    def provide(self, slot: int, record: RngRecord) -> None:
        """``slot``'s record from its keeper on another host, for its next pass of that step."""
        self._fetched[slot] = record

    def mirror(
        self, keepers: dict[int, int | None], job_id: str | None, generation: int, route: StreamRoute
    ) -> None:
        """A generation formed with this process holding the slots in ``keepers`` (slot -> the
        rank that keeps its records): each slot's records go to its keeper from now on."""
        for slot, keeper in keepers.items():
            peer = self._peers.get(slot)
            if peer is None:
                peer = self._peers[slot] = PeerRecords()
            peer.place(slot, keeper)
            peer.resume(generation, route, held=True)
            self._keeper(slot, job_id).mirror = peer.send

    def _keeper(self, slot: int, job_id: str | None) -> RankRngKeeper:
        keeper = self._keepers.get(slot)
        if keeper is None:
            keeper = self._keepers[slot] = RankRngKeeper()
            keeper.configure(rank_rng_dir(job_id) if job_id else None, slot)
        return keeper

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
        for slot in set(self._fetched) - set(keep):
            del self._fetched[slot]
        for slot in set(self._peers) - set(keep):
            self._peers.pop(slot).close()  # the spare's own records go to the keeper now
