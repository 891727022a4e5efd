"""The replica keeper: every copy of this rank's state that a recovery may restore from.

Rank 0's shared-memory snapshots and durable (DCP) checkpoints on an unsharded job; on a sharded
mesh each rank's own snapshots and checkpoints, its buddy copies kept on another host and its
undo copies kept in memory (``state/buddy.py``); this rank's own generators, kept in shared memory
for its replacement (``rank_rng.py``); and a spare's paged-in room for the state it will receive
(``state/arena.py``). :class:`ReplicaKeeper` owns them: it is configured from the
launcher's assignment, starts the copies as a step begins, holds an update until no copy still
reads the tensors it changes, and says what it holds when the rank reports for a recovery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkpointless.events import get_logger
from checkpointless.protocol import Assign
from checkpointless.recovery.rank_rng import RankRngKeeper, rank_rng_dir
from checkpointless.recovery.rank_rng_peer import PeerRecords
from checkpointless.recovery.sharded import buddies_wanted
from checkpointless.state.arena import Arena
from checkpointless.state.buddy import BuddyCopies
from checkpointless.state.buddy_ring import buddy_of, owners_of
from checkpointless.state.durable import CheckpointWriter, list_checkpoints, parse_every, preload
from checkpointless.state.shm_dir import buddy_copy_dir, list_snapshots, rank_snapshot_dir, snapshot_dir
from checkpointless.state.shm_snapshot import SnapshotWriter
from checkpointless.state.snapshot import RngState, Stateful, collect_state
from checkpointless.state.staging import guarded_pointers, staged_layout
from checkpointless.state.stream import StreamRoute

__all__ = ["ReplicaKeeper"]

log = get_logger()


class ReplicaKeeper:
    """This rank's snapshots, checkpoints, buddy and undo copies, and a spare's room."""

    def __init__(self) -> None:
        self.snapshots: SnapshotWriter | None = None  # rank 0's (or, sharded, this rank's) snapshots
        self.checkpoints: CheckpointWriter | None = None  # the durable DCP checkpoints this rank writes
        self.checkpoint_dir: Path | None = None  # every rank reads it to report and restore
        self.snapshot_every = 0
        self.checkpoint_every = parse_every("0")
        self.own_snapshots: Path | None = None  # a sharded mesh: this rank's own snapshot directory
        # own states (snapshots, undo copies) of this step or earlier are not offered to a plan:
        # the rank was found divergent then, so they may hold its divergent state (commit.py)
        self.own_states_after = -1
        self.buddy_mode = "off"  # --buddy-copies: auto | on | off
        self.buddy_every = 1  # --buddy-every: steps between copies
        self.buddies: BuddyCopies | None = None  # this rank's copies, kept on another host
        self.arena: Arena | None = None  # a spare's paged-in room for the state it will receive
        self.rank_rng = RankRngKeeper()  # this rank's own generators, for its replacement
        self.rank_rng_peer = PeerRecords()  # ... kept on another host too, and its owners' kept here
        self.rank_rng.mirror = self.rank_rng_peer.send

    # -- set-up --------------------------------------------------------------------------------
    def configure(self, msg: Assign, rank: int, job_id: str) -> None:
        """What the launcher's assignment asks for (``--snapshot-every``, ``--checkpoint-dir``, ...)."""
        every = self.snapshot_every = msg.snapshot_every
        self.buddy_mode = msg.buddy_copies
        self.buddy_every = msg.buddy_every
        self.rank_rng.configure(rank_rng_dir(job_id), rank)
        per_host = msg.local_world_size if msg.local_world_size > 0 else msg.world_size
        self.rank_rng_peer.place(rank, buddy_of(rank, msg.world_size, per_host))
        if every and rank == 0:
            # One copy per host is enough (replicas are identical after each commit), and the
            # launcher runs every rank on one host, so its lowest rank, 0, writes. A fixed writer
            # rather than a rotation keeps "one writer at a time" true, which pruning relies on.
            self.snapshots = SnapshotWriter(snapshot_dir(job_id), every)
        if msg.checkpoint_dir:
            self.checkpoint_dir = Path(msg.checkpoint_dir)
            ckpt_every = self.checkpoint_every = parse_every(msg.checkpoint_every)
            if not ckpt_every.off:
                preload()  # every rank may have to load one after a loss of every replica
            if rank == 0 and not ckpt_every.off:
                # one writer, as for snapshots: replicas are identical after each commit
                self.checkpoints = CheckpointWriter(self.checkpoint_dir, ckpt_every)

    def prepare(self, state_bytes: int) -> None:
        """As a spare: page in room for a replica's state now, not during a recovery."""
        want = int(state_bytes * 1.01) + (1 << 20)  # alignment padding, a little growth
        if self.arena is not None and self.arena.size >= want:
            return
        t0 = time.monotonic()
        self.arena = None  # the old one goes first: never hold two
        self.arena = Arena(want)
        log.info("paged in %.1f MB for a replica's state in %.2f s", want / 1e6, time.monotonic() - t0)

    def shard(
        self,
        rank: int,
        world_size: int,
        per_host: int,
        shape: tuple[int, int],
        timeout: float,
        job_id: str | None,
    ) -> None:
        """On a mesh with S > 1 each rank holds a different shard: snapshots become per-rank
        (every rank its own file in the job's shm directory), buddy copies start
        (docs/architecture.md). ``job_id`` is None when run without the launcher."""
        if self.checkpoint_dir is not None:
            # every rank its own DCP checkpoint of its own shard, in a directory of its own
            self.checkpoint_dir = self.checkpoint_dir / f"rank{rank}"
            off = self.checkpoint_every.off
            self.checkpoints = (
                None if off else CheckpointWriter(self.checkpoint_dir, self.checkpoint_every, aligned=True)
            )
        if job_id is None:
            self.snapshots = None
            return
        buddies = buddies_wanted(self.buddy_mode, shape)
        # With buddy copies each rank also keeps its own two newest step states in process
        # memory (its undo copies, state/buddy_owner.py), what a survivor rolls back from when
        # the lost rank kept its copy; the shared-memory snapshots stay at their cadence, for a
        # replacement on the same host whose keeper was lost too.
        every = self.snapshot_every
        self.snapshots = None
        if every:
            self.own_snapshots = rank_snapshot_dir(job_id, rank)
            self.snapshots = SnapshotWriter(self.own_snapshots, every)
        if buddies:
            self.buddies = BuddyCopies(
                rank,
                buddy_of(rank, world_size, per_host),
                owners_of(rank, world_size, per_host),
                timeout,
                shm_dir=buddy_copy_dir(job_id),
                every=self.buddy_every,
            )

    # -- the step ------------------------------------------------------------------------------
    def begin_step(
        self,
        index: int,
        objects: dict[str, Stateful],
        optimizers: list[torch.optim.Optimizer],
        rng: RngState,
        now: float,
    ) -> None:
        """Start the copies due as step ``index`` begins, from the state as it begins; keep this
        rank's generators ``rng`` (as the step begins) for its replacement."""
        self.rank_rng.at_entry(index, rng)
        snap = self.snapshots is not None and self.snapshots.due(index)
        copy = self.buddies is not None and self.buddies.due(index)
        if snap or copy:
            t0 = time.thread_time()
            # The state as this step begins (its RNG included), copied while forward/backward
            # run. Collected and laid out once for the snapshot and the buddy copy alike: on a
            # sharded job, walking the optimizer's DTensors is a main-thread cost on every step.
            state = collect_state(objects, index, rng)
            guarded = guarded_pointers(optimizers)
            staged = staged_layout(state, guarded)
            if snap and self.snapshots is not None:
                self.snapshots.start(index, state, guarded, staged)
            if copy and self.buddies is not None:  # sent while forward/backward run; the update waits
                self.buddies.start(index, state, guarded, staged)
                self.buddies.cpu_s["stage"] += time.thread_time() - t0
        if self.checkpoints is not None and self.checkpoints.due(index, now):
            state = collect_state(objects, index, rng)
            try:
                self.checkpoints.start(index, state, guarded_pointers(optimizers))
            except Exception as e:  # the disk's trouble must not fail a training step
                log.warning("checkpoint of step %d not started: %s", index, e)

    def wait_read(self, timeout: float, aborted: Callable[[], str | None]) -> None:
        """Before an update: wait until no copy still reads the tensors it changes (a snapshot's
        copy, DCP's staging, the buddy copy's stream); a buddy copy abandoned by an abort
        (``aborted`` says why) raises CommAborted."""
        if self.snapshots is not None:
            self.snapshots.wait_copied(timeout)
        if self.checkpoints is not None:
            self.checkpoints.wait_staged(timeout)
        if self.buddies is not None:
            self.buddies.wait_sent(timeout, aborted)

    def published(self) -> dict[str, Any]:
        """The commit event's fields for the copies this step published."""
        record: dict[str, Any] = {}
        published = self.snapshots.take_published() if self.snapshots is not None else None
        if published is not None:
            record["snapshot"] = published.to_json()  # size and bound of the snapshot memory
        if self.buddies is not None and self.buddies.last_send:
            b = self.buddies
            record["buddy"] = {
                **b.last_send,
                "wait_s": b.last_wait,
                "keeps": b.kept_copies,  # copies held for other ranks
                "transport": b.transport,  # "file": a same-host keeper, the bytes in shared memory
                "keeps_bytes": b.extra_bytes,
                "undo_bytes": b.undo_bytes,
                "file_bytes": b.file_bytes,  # shared memory of this rank's copy files (undo + a spare)
                "cpu_s": dict(b.cpu_s),  # so far, this process: laying out, sending, keeping
            }
        saved = self.checkpoints.take_published() if self.checkpoints is not None else None
        if saved is not None:
            record["checkpoint"] = saved.to_json()
        return record

    def wait_written(self, timeout: float) -> None:
        """Wait (bounded) until the snapshot and checkpoint in flight are written: a killall
        fault (faults/inject.py) lets every rank die only once the copies its step began exist."""
        if self.snapshots is not None:
            self.snapshots.wait_idle(timeout)
        if self.checkpoints is not None:
            self.checkpoints.wait_idle(timeout)

    def finish(self, timeout: float) -> None:
        """At the end of the loop: the last checkpoint written (the process leaves with
        os._exit, and a save still running would be cut off as a .tmp)."""
        if self.checkpoints is not None and not self.checkpoints.wait_idle(timeout):
            log.warning("the last checkpoint was still being written after %.0f s", timeout)

    # -- recovery ------------------------------------------------------------------------------
    def stop(self, timeout: float) -> None:
        """As a recovery begins: a snapshot copy must end before a transfer overwrites state,
        nor may DCP still be staging tensors; only verified buddy copies are reported and kept."""
        if self.snapshots is not None:
            self.snapshots.wait_copied(timeout)
        if self.checkpoints is not None:
            self.checkpoints.wait_staged(timeout)
        if self.buddies is not None:
            self.buddies.stop(timeout)

    def checkpoint_steps(self) -> list[int]:
        return list_checkpoints(self.checkpoint_dir) if self.checkpoint_dir is not None else []

    def copies(self) -> list[list[int]]:
        """The buddy copies this rank keeps for others, as (owner, step) pairs."""
        return [list(c) for c in self.buddies.held()] if self.buddies else []

    def own_states(self) -> list[int]:
        """Steps this rank can restore its own state of: its per-rank shared-memory snapshots
        and, with buddy copies, the undo copies in its memory (plan kind ``own_snapshot``)."""
        steps = set(list_snapshots(self.own_snapshots)) if self.own_snapshots else set()
        if self.buddies is not None:
            steps.update(self.buddies.undo_steps())
        return sorted(s for s in steps if s > self.own_states_after)

    def after_round(self, target: int, generation: int, route: StreamRoute | None) -> None:
        """A generation formed at step ``target``: copies of later steps are void, and buddy
        copies resume on the new generation's route, and so do this rank's generator records."""
        self.rank_rng_peer.resume(generation, route)
        if self.buddies is not None:
            self.buddies.forget_after(target)
            self.buddies.resume(generation, route)
