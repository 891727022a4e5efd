"""Every rank's own global generators, kept outside its process, so a replacement resumes them.

The global generators (torch CPU and CUDA, Python's ``random``, NumPy's) are per-rank state:
a script seeded ``1337 + rank`` draws its batches from them, rank 0 alone may draw evaluation
batches from them, and ``nn.Dropout`` draws its masks from them. They are not replica state,
so a replacement must not take them from the peer that sends it the model: it must resume the
very streams of the rank it replaces, as they stood when the step it re-runs first began.

Where they are kept, and why there: each rank writes its generators into the job's private
shared-memory directory (``<job shm>/rng/rank<k>.<slot>``), outside its process, at every point
a recovery may resume from: as a step issues its first collective after its forward (a gradient
bucket's all-reduce: its draws are done, and no peer can commit the step before this rank has
taken part; where the next step starts, and where a recovery that rolls the step forward
resumes), as its update begins (a check that nothing drew since, without a capture; kept again
if something did), as it commits (a check of torch's generators only, unless no update ran), as
a section begins, and as a step begins (a compare of the state captured there anyway, written
only if something drew since the last record). The write is synchronous (one ``pwritev`` of
~12.7 KB; the cost is measured by ``benchmarks/rank_rng.py``), so the record of a point exists
before the rank can take part in any collective after it, and no peer can pass that point while
the keeper still holds an older record. The directory is the one the snapshots and the
same-host buddy copies use: the launcher's and the reaper's clean-up remove it, even after a
SIGKILL. Each record carries its step, the section it began (if any), its length and a digest
(a write cut short by a SIGKILL is refused, never restored; the bytes: rng_record.py); two slots (by the step's parity)
keep the newest two steps, since a recovery may settle on the step before the newest record (a
rank that committed a step its peers did not reach).

Every record written also goes to the rank's keeper on another host (``mirror``, set to
``rank_rng_peer.PeerRecords.send``; sent on this thread before the write returns), so a
replacement for a rank whose host was lost, which finds no record on its own host, asks the
keeper for it (recovery/rank_rng_peer.py).

The record also carries the rank's per-rank data positions (``data``: the positions of the
``StatefulDataLoader`` objects registered through ``job.loader()``, recovery/rank_data.py), the one
per-rank data state that is not a function of the step: a ``DataLoader`` under ``job.loader()``
and a ``BatchLoader`` find a step's batch by arithmetic, while a ``StatefulDataLoader``'s state
(a sampler's generator drawn from the per-rank global seed, a per-rank file offset) is its own.
A rank that receives its replica's state would otherwise take the sender's positions.

A record of a section's boundary also carries, once the section's work is done, how it closed
on this rank (``closing``: its end generators, held lines and pass, recovery/section_closing.py),
so that a lost host's section still counts as passed and its lines are shown once.

The limits. A replacement that finds no record of its step anywhere (its keeper was lost too,
no key servers with ``--rendezvous tcp``, a host lost before the kernel sent the newest frame)
resumes the generators sent with the replica's state, and says so: a warning, an ``Inexact``
message to the coordinator, an ``inexact`` event and ``job_end``'s account (on a sharded mesh a
buddy copy carries its owner's own, so that case is exact). A rank lost in a section after its
peers completed it (every rank leaves a section together, driver.close_section: only one lost as
the closing barrier completes) is not redone there: its replacement resumes the generators as
the section left them, kept before that barrier (``keep_section_end`` on this host, and in the
step's record's ``closing`` with the keeper on another); without either, what it drew there is
lost, and is reported the same way. A draw from Python's or NumPy's generator after the update, by a rank
lost before the next step began, is not seen by the commit's check (torch's only); nor is any
draw between the step's first collective and its update by a rank lost before the update
began while a peer committed the step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from checkpointless.data.shm_cache import job_cache_dir
from checkpointless.recovery.rng_compare import same_rng, torch_unchanged, unchanged
from checkpointless.recovery.rng_record import (
    RngRecord,
    decode_record,
    encode_parts,
    encode_record,
    record_point,
)
from checkpointless.state.shm_dir import private_dir
from checkpointless.state.snapshot import RngState, capture_rng

__all__ = [
    "RankRngKeeper",
    "RngRecord",
    "decode_record",
    "encode_parts",
    "encode_record",
    "rank_rng_dir",
    "record_point",
    "same_rng",
]


def rank_rng_dir(job_id: str) -> Path:
    """The job's directory of per-rank generator records (private, in its shared memory)."""
    path = job_cache_dir(job_id) / "rng"
    private_dir(path)
    return path


class RankRngKeeper:
    """This rank's generator records: the newest two steps in memory and, under the launcher,
    in the job's shared memory, where a replacement of this rank reads them."""

    def __init__(self) -> None:
        self.directory: Path | None = None  # None: not under the launcher, memory only
        self.rank = -1
        self._slots: dict[int, RngRecord] = {}  # step % 2 -> the newest record of that parity
        self._files: dict[int, int] = {}  # step % 2 -> its open file (one write per record)
        # every record written also goes to this rank's keeper on another host (its step, the
        # encoded record; recovery/rank_rng_peer.py): None keeps them on this host only
        self.mirror: Callable[[int, bytes], None] | None = None
        self._early: int | None = None  # the step whose first collective kept the next one's record
        # this rank's per-rank data positions, taken with each record (rank_data.py): None
        # while the script has registered no loader whose position is its own state
        self.positions: Callable[[], bytes | None] | None = None

    def configure(self, directory: Path | None, rank: int) -> None:
        """Keep this rank's records in ``directory`` (a spare learns its rank at assignment)."""
        for fd in self._files.values():
            os.close(fd)
        self._files = {}
        self.directory = directory
        self.rank = rank

    @property
    def began(self) -> bool:
        """Whether this process has recorded a point of its own (it has begun a step here)."""
        return bool(self._slots)

    def keep(self, step: int, rng: RngState, section: str | None = None) -> None:
        """Record the generators ``rng`` as they stand at step ``step``'s boundary (the commit of
        step ``step - 1``, the start of ``section`` or of the step): a step's newest record wins."""
        data = self.positions() if self.positions is not None else None
        kept = self._slots.get(step % 2)
        if (
            kept is not None
            and kept.step == step
            and kept.section == section
            and kept.data == data
            and kept.closing is None  # a section's closing of an older attempt is not carried on
            and same_rng(kept.rng, rng)
        ):
            return  # nothing drew or read since the commit kept it: the usual step entry costs a compare
        self._write(RngRecord(step, rng, section, data))

    def attach(self, step: int, closing: bytes) -> bool:
        """Write step ``step``'s newest record again with ``closing`` (how its section closed,
        section_closing.py) carried in it, here and to the keeper on another host; False if this
        process holds no record of ``step``."""
        kept = self._slots.get(step % 2)
        if kept is None or kept.step != step:
            return False
        self._write(dataclasses.replace(kept, closing=closing))
        return True

    def _write(self, record: RngRecord) -> None:
        step = record.step
        self._slots[step % 2] = record
        if self.directory is None:
            return
        fd = self._files.get(step % 2)
        if fd is None:
            fd = self._files[step % 2] = os.open(self._path(step), os.O_RDWR | os.O_CREAT, 0o600)
        # one write, in place: a record is self-delimiting (an older, longer one's tail is
        # ignored) and checked by its digest (a write cut short by a SIGKILL is refused)
        parts = encode_parts(record)
        os.pwritev(fd, parts, 0)
        if self.mirror is not None:
            self.mirror(step, b"".join(parts))

    def at_entry(self, index: int, rng: RngState) -> None:
        """Step ``index`` begins with the generators ``rng`` (its first attempt or a replay)."""
        self._early = None
        self.keep(index, rng)

    def at_collective(self, index: int | None) -> None:
        """Step ``index`` issues its first collective (a gradient bucket's all-reduce, as its
        backward runs): its forward has drawn (batches, dropout), and no peer can commit the
        step before this rank has taken part. The generators as they stand are kept now as where
        step ``index + 1`` starts, so the record is with this rank's keeper on another host
        before any peer can settle a recovery on that step (rank_rng_peer.py); the update checks
        it, and keeps a newer one if something drew in between."""
        if index is None or self.directory is None or self._early == index:
            return
        self._early = index
        self.keep(index + 1, capture_rng())

    def at_update(self, index: int | None) -> None:
        """Step ``index``'s update begins (the optimizer's pre-hook): its draws are done, and the
        generators as they stand are where step ``index + 1`` starts. Kept now, not at the
        commit: a rank lost inside its update leaves a peer that has updated, the recovery
        rolls the step forward, and its replacement resumes from this record."""
        if index is None or self.directory is None:
            return
        kept = self._slots.get((index + 1) % 2)
        if (
            self._early == index
            and kept is not None
            and kept.step == index + 1
            and unchanged(kept.rng)
            and (self.positions is None or kept.data == self.positions())
        ):
            return  # kept as the step's first collective began, and nothing drew or read since
        self.keep(index + 1, capture_rng())

    def at_commit(self, index: int) -> None:
        """Step ``index`` committed: if its update kept a record, a check of torch's generators
        (what a draw after the update most likely used) is enough; otherwise (no update ran: a
        skipped GradScaler step) the generators are kept now."""
        if self.directory is None:
            return
        kept = self._slots.get((index + 1) % 2)
        if kept is None or kept.step != index + 1 or not torch_unchanged(kept.rng):
            self.keep(index + 1, capture_rng())

    def load(self, step: int) -> RngRecord | None:
        """This rank's record of step ``step``, if one is kept (in this process, else in shared
        memory by whoever held the rank before); else None."""
        mine = self._slots.get(step % 2)
        if mine is not None and mine.step == step:
            return mine
        if self.directory is None:
            return None
        try:
            record = decode_record(self._path(step).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return record if record.step == step else None

    def keep_section_end(self, step: int, rng: RngState, section: str) -> None:
        """Record the generators ``rng`` as ``section`` at step ``step``'s boundary has done its
        work, before its closing barrier (recovery/driver.py): a rank lost as its peers pass that
        barrier is not redone there, and its replacement resumes from this, not from the
        section's start (still the step's record, which a redone section needs). One record of
        its own on this host (the section's ends are rare); the keeper on another host has it
        in the step's record's ``closing`` (section_closing.py)."""
        if self.directory is None:
            return
        fd = os.open(self._end_path(), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwritev(fd, encode_parts(RngRecord(step, rng, section)), 0)
        finally:
            os.close(fd)

    def load_section_end(self, step: int, section: str) -> RngRecord | None:
        """The record :meth:`keep_section_end` kept for ``section`` at step ``step``'s boundary
        (by this process or its predecessor on this host), else None."""
        if self.directory is None:
            return None
        try:
            record = decode_record(self._end_path().read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return record if (record.step, record.section) == (step, section) else None

    def _end_path(self) -> Path:
        assert self.directory is not None
        return self.directory / f"rank{self.rank}.end"

    def _path(self, step: int) -> Path:
        assert self.directory is not None
        return self.directory / f"rank{self.rank}.{step % 2}"
