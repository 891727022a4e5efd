"""Worker heartbeats through shared memory, gathered by the host's agent: the record's format.

Shared by both ends, so it lives below them: the worker writes the record (:class:`BeatWriter`,
from ``recovery/link.py``) and its host's agent reads it (:class:`BeatReader`, ``agent/agent.py``);
:func:`beats_message` and :func:`beats_of` are the rows as the agent forwards them to the
coordinator.

A worker that heartbeats the coordinator over its own connection every 0.25 s costs the
coordinator one sealed frame to verify and decode per beat: at 10k hosts x 8 ranks that is ~4
cores. Instead each worker writes its beat (step, progress age, in-collective, step time, and the
CLOCK_MONOTONIC time it wrote it) into a 64-byte record in the job's private shared-memory
directory, which the host's agent created (``<job shm dir>/beats/w<worker id>``). The agent reads
every record of its host with no socket and no syscall per beat (the records are mapped), and
sends one ``AgentHeartbeat`` per interval carrying the rows that changed since the last one, each
with its *age*. The coordinator then treats each row as that worker's own ``Heartbeat``,
received ``age`` seconds ago, so the hang and stall rules see what they saw before. A stopped
worker writes nothing: its row stops coming, and its silence grows as it did.

The record is a seqlock: the writer makes the sequence odd, writes the body, makes it even; a
reader that sees an odd or changed sequence skips the record until the next read. The worker
falls back to socket heartbeats when it cannot create its record.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from checkpointless.protocol.agent_link import AgentHeartbeat
from checkpointless.protocol.base import ProtocolError
from checkpointless.protocol.worker_link import Heartbeat

__all__ = [
    "BEAT_ENV",
    "RECORD_BYTES",
    "BeatReader",
    "BeatWriter",
    "WorkerBeat",
    "beats_message",
    "beats_of",
    "make_beat_dir",
]

BEAT_ENV = "CHECKPOINTLESS_BEAT_FILE"  # the record a worker writes (set by its agent)
RECORD_BYTES = 64
_SEQ = struct.Struct("<Q")
# step (-1: none), written at (monotonic s), progress age (NaN: none), step time (NaN: none),
# busy time (NaN: none; the step less its waits in collectives: the straggler rule's input),
# in collective, rank (-1: none), done (the loop finished: what the agent tells a successor
# coordinator of a rank that has left, coordinator/rules/rebuild.py)
_BODY = struct.Struct("<qddddBiB")


@dataclass(slots=True)  # not frozen: an agent's frame makes 8 of these, and frozen __init__ is slow
class WorkerBeat:
    """One worker's beat as its agent forwards it: ``age`` seconds old when the agent read it."""

    worker_id: int
    age: float
    step: int | None
    progress_age: float | None
    in_collective: bool
    step_time: float | None
    busy_time: float | None = None


def make_beat_dir(path: Path) -> Path:
    """Create (or check) the private directory the records live in; OSError if it is not ours."""
    for d in (path.parent, path):
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
        # /dev/shm is writable by everyone: a directory planted by another user would let them
        # feed the agent forged beats (keep a hung rank looking alive)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise OSError(f"{d} is not a private directory of this user; remove it")
    return path


def _none_if_nan(x: float) -> float | None:
    return None if math.isnan(x) else x


class BeatWriter:
    """A worker's record: created here (never an existing file), written in place."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, RECORD_BYTES)
            self._map = mmap.mmap(fd, RECORD_BYTES)
        finally:
            os.close(fd)
        self.path = path
        self._seq = 0

    def write(self, hb: Heartbeat, at: float, rank: int = -1, done: bool = False) -> None:
        """One writer at a time (the seqlock has one writer): the caller serialises."""
        body = _BODY.pack(
            -1 if hb.step is None else hb.step,
            at,
            math.nan if hb.progress_age is None else hb.progress_age,
            math.nan if hb.step_time is None else hb.step_time,
            math.nan if hb.busy_time is None else hb.busy_time,
            1 if hb.in_collective else 0,
            rank,
            1 if done else 0,
        )
        self._seq += 1
        self._map[0:8] = _SEQ.pack(self._seq)  # odd: being written
        self._map[8 : 8 + len(body)] = body
        self._seq += 1
        self._map[0:8] = _SEQ.pack(self._seq)

    def close(self) -> None:
        self._map.close()


class BeatReader:
    """The agent's view of its host's records; one reader thread only."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._maps: dict[int, mmap.mmap] = {}
        self._seen: dict[int, int] = {}  # worker id -> the sequence last forwarded

    def path(self, worker_id: int) -> Path:
        return self.directory / f"w{worker_id}"

    def _open(self, worker_id: int) -> mmap.mmap | None:
        try:
            fd = os.open(self.path(worker_id), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None  # not written yet (the worker is still starting)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_size != RECORD_BYTES:
                return None
            return mmap.mmap(fd, RECORD_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def read(self, workers: list[int], now: float) -> list[WorkerBeat]:
        """Beats written since the last read, of ``workers`` (the live processes of this host)."""
        live = set(workers)
        for wid in [w for w in self._maps if w not in live]:
            self._maps.pop(wid).close()
            self._seen.pop(wid, None)
        out: list[WorkerBeat] = []
        for wid in workers:
            m = self._maps.get(wid)
            if m is None:
                m = self._open(wid)
                if m is None:
                    continue
                self._maps[wid] = m
            seq = _SEQ.unpack_from(m, 0)[0]
            step, at, progress, step_time, busy, coll, _, _ = _BODY.unpack_from(m, 8)
            if seq % 2 or seq == 0 or _SEQ.unpack_from(m, 0)[0] != seq or self._seen.get(wid) == seq:
                continue  # being written, never written, or nothing new
            self._seen[wid] = seq
            out.append(
                WorkerBeat(
                    wid,
                    max(0.0, now - at),
                    None if step < 0 else step,
                    _none_if_nan(progress),
                    bool(coll),
                    _none_if_nan(step_time),
                    _none_if_nan(busy),
                )
            )
        return out

    def finished_rank(self, worker_id: int) -> int | None:
        """The rank a worker that has exited last said it finished its loop as, or None (it had
        not, or wrote no record). Read before the record is removed."""
        m = self._maps.get(worker_id) or self._open(worker_id)
        if m is None:
            return None
        try:
            for _ in range(3):  # the writer is gone: a torn record stays torn, so a few tries
                seq = _SEQ.unpack_from(m, 0)[0]
                *_, rank, done = _BODY.unpack_from(m, 8)
                if seq and not seq % 2 and _SEQ.unpack_from(m, 0)[0] == seq:
                    return rank if done and rank >= 0 else None
            return None
        finally:
            if worker_id not in self._maps:
                m.close()

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


def beats_message(beats: list[WorkerBeat], wall: float) -> AgentHeartbeat:
    return AgentHeartbeat(
        time=wall,
        workers=[b.worker_id for b in beats],
        ages=[b.age for b in beats],
        steps=[-1 if b.step is None else b.step for b in beats],
        progress_ages=[-1.0 if b.progress_age is None else b.progress_age for b in beats],
        in_collective=[b.in_collective for b in beats],
        step_times=[-1.0 if b.step_time is None else b.step_time for b in beats],
        busy_times=[-1.0 if b.busy_time is None else b.busy_time for b in beats],
    )


def beats_of(msg: AgentHeartbeat) -> list[WorkerBeat]:
    """The rows of an agent's heartbeat; :class:`ProtocolError` if its columns disagree."""
    n = len(msg.workers)
    lengths = [
        len(msg.ages),
        len(msg.steps),
        len(msg.progress_ages),
        len(msg.in_collective),
        len(msg.step_times),
    ]
    if any(k != n for k in lengths) or len(msg.busy_times) not in (0, n):
        raise ProtocolError(
            f"agent_heartbeat: {n} workers but columns of lengths {lengths} and {len(msg.busy_times)} busy times"
        )
    busy = msg.busy_times or [-1.0] * n
    return [
        WorkerBeat(
            w,
            max(0.0, age),
            None if step < 0 else step,
            None if prog < 0 else prog,
            coll,
            None if st < 0 else st,
            None if bt < 0 else bt,
        )
        for w, age, step, prog, coll, st, bt in zip(
            msg.workers,
            msg.ages,
            msg.steps,
            msg.progress_ages,
            msg.in_collective,
            msg.step_times,
            busy,
            strict=True,
        )
    ]
