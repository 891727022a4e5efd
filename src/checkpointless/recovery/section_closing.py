"""How a protected section closed on a rank, carried inside the rank's generator record of that
boundary, so that it goes wherever that record goes: to the job's shared memory on the rank's
host and to its keeper one host over (recovery/rank_rng.py, rank_rng_peer.py).

What a replacement needs of a lost rank's section is kept on the rank's host (section_pass.py's
mark, held_lines.py's lines, rank_rng.py's ``keep_section_end``), and a host lost takes it all:
the section was then redone on every rank (its ``section`` event and lines twice) and the lost
rank's held lines never shown. So each rank also writes, as step ``s``'s record again with a
:class:`Closing` in it (``RankRngKeeper.attach``): before the closing barrier, the generators as
the section's work left them and what it holds to show; just after the barrier, that it passed;
after ``closed`` showed the lines, that they were shown. The record of step ``s`` is the one a
replacement resuming at ``s`` asks the keeper for, and the next step's entry writes it anew
without this (the section is behind the rank by then).

Two readers. The keeper, a live peer in the recovery, reports the sections its owners passed
at the boundary it stopped at beside its own (``owners_passed``, section_pass.py): the rule of
coordinator/rules/sections.py then counts them though the owner and its host are gone. A
replacement that fetched its predecessor's record from the keeper writes what it carries into
its own host's files (``adopt``): the step loop then finds the section's end generators and
held lines there, as it would have on the lost host.

The cap. Held lines above :data:`HELD_CAP` bytes (a huge log line, a long tracker record) are
not carried: they stay whole in the host's own file, and a replacement on another host that
finds only their size says so (a warning and an ``Inexact`` message, ``what="lines"``); it never
shows a cut line.

The owner's barrier may complete milliseconds after the keeper's failed (seen: 6 ms on two
loaded cores), so a keeper that stops at a boundary where an owner entered the closing barrier
and has said neither that it passed nor that its barrier failed (``carry_left``) waits for it, up
to :data:`WAIT_S` (the cost, where it applies: a rank lost just before its barrier completes,
and a recovery that keeps a section closed on host loss). The limits: an owner whose pass
reaches its keeper later than that, or whose host went before the kernel sent the frame, is not
counted, and the section is redone on every rank as before (the ranks still agree).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from collections.abc import Collection
from dataclasses import dataclass

from checkpointless.events import get_logger
from checkpointless.recovery.held_lines import HeldLinesFile
from checkpointless.recovery.member import Member
from checkpointless.recovery.rank_rng import RngRecord, decode_record, encode_record
from checkpointless.state.snapshot import RngState

__all__ = [
    "HELD_CAP",
    "WAIT_S",
    "Closing",
    "adopt",
    "carry_end",
    "carry_left",
    "carry_pass",
    "carry_shown",
    "decode_closing",
    "encode_closing",
    "own_left",
    "owners_closings",
    "owners_passed",
]

log = get_logger()

# how long a keeper waits for an owner that entered a closing barrier to say whether it passed
WAIT_S = 0.5
HELD_CAP = 64 << 10  # held lines up to this many bytes travel with the record; more stay on the host
_MAGIC = b"CLCLOS01"
_LEAD = struct.Struct("<8sIII")  # magic, the header's, the end record's and the lines' lengths


@dataclass(frozen=True)
class Closing:
    """Section ``section`` at the boundary after ``step`` steps, as it closed on one rank."""

    step: int
    section: str
    passed: bool = False  # the rank passed the closing barrier
    left: bool = False  # its closing barrier failed here (the rank recovers from there)
    end: bytes | None = None  # the generators as its work left them (an encoded RngRecord)
    held: bytes | None = None  # the lines it holds to show (``held.encode()``), if carried
    held_size: int = 0  # their length: above HELD_CAP they are not carried (``held`` None)

    @property
    def held_left_behind(self) -> bool:
        """Lines were held, but too long to carry (they are on the rank's own host only)."""
        return self.held is None and self.held_size > 0


def closing_of(step: int, section: str, end: RngState, held: bytes | None) -> Closing:
    """What a rank carries as the section's work is done, before its closing barrier: lines
    over :data:`HELD_CAP` by their size only."""
    size = 0 if held is None else len(held)
    carried = held if held is not None and size <= HELD_CAP else None
    return Closing(
        step, section, end=encode_record(RngRecord(step, end, section)), held=carried, held_size=size
    )


def encode_closing(closing: Closing) -> bytes:
    """``closing`` as bytes (the record that carries it has the digest)."""
    head = json.dumps(
        {
            "step": closing.step,
            "section": closing.section,
            "passed": closing.passed,
            "left": closing.left,
            "end": closing.end is not None,
            "held": closing.held is not None,
            "held_size": closing.held_size,
        }
    ).encode()
    end, held = closing.end or b"", closing.held or b""
    return _LEAD.pack(_MAGIC, len(head), len(end), len(held)) + head + end + held


def decode_closing(data: bytes) -> Closing:
    """The :class:`Closing` in ``data``.

    Raises:
        ValueError: ``data`` is not one whole closing (named in the message)."""
    try:
        magic, n_head, n_end, n_held = _LEAD.unpack_from(data)
    except struct.error as e:
        raise ValueError(f"not a section's closing: {len(data)} bytes") from e
    if magic != _MAGIC or len(data) != _LEAD.size + n_head + n_end + n_held:
        raise ValueError(f"not a section's closing: magic {magic!r}, {len(data)} bytes")
    at = _LEAD.size
    try:
        head = json.loads(data[at : at + n_head])
        step, section, passed, left = head["step"], head["section"], head["passed"], head["left"]
        has_end, has_held, held_size = head["end"], head["held"], head["held_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"a section's closing with a malformed header: {e}") from e
    if type(step) is not int or not isinstance(section, str) or type(held_size) is not int:
        raise ValueError(f"a section's closing with a malformed header: {head!r}")
    at += n_head
    end, held = data[at : at + n_end], data[at + n_end :]
    end_or_none, held_or_none = (end if has_end else None), (held if has_held else None)
    return Closing(step, section, bool(passed), bool(left), end_or_none, held_or_none, held_size)


def _attach(member: Member, closing: Closing) -> None:
    if not member.replicas.rank_rng.attach(closing.step, encode_closing(closing)):
        log.debug("no record of step %d to carry section %r's closing", closing.step, closing.section)


def _carried(member: Member, step: int, section: str) -> Closing:
    kept = member.replicas.rank_rng.load(step)
    if kept is not None and kept.closing is not None:
        try:
            closing = decode_closing(kept.closing)
        except ValueError:
            closing = None
        if closing is not None and (closing.step, closing.section) == (step, section):
            return closing
    return Closing(step, section)


def carry_end(member: Member, step: int, section: str, end: RngState, held: bytes | None) -> None:
    """Before the closing barrier: the generators as the section's work left them, and the lines
    it holds (those over the cap by their size, said where a replacement misses them)."""
    _attach(member, closing_of(step, section, end, held))


def carry_pass(member: Member, step: int, section: str) -> None:
    """Just after the closing barrier: this rank passed it."""
    _attach(member, dataclasses.replace(_carried(member, step, section), passed=True))


def carry_left(member: Member, step: int, section: str) -> None:
    """The closing barrier failed here, the section's work done: a keeper waiting to learn
    whether this rank passed (``owners_passed``) need wait no longer."""
    _attach(member, dataclasses.replace(_carried(member, step, section), left=True))


def carry_shown(member: Member, step: int, section: str) -> None:
    """``closed`` showed the held lines: a replacement must not show them again."""
    _attach(member, dataclasses.replace(_carried(member, step, section), held=None, held_size=0))


def own_left(member: Member, step: int) -> list[str]:
    """The sections whose closing barrier this rank entered at the boundary after ``step`` steps
    and failed (``carry_left``): every rank must have entered it for any to pass, so only then
    can a lost peer have passed it (coordinator/rules/sections.py ``doubtful_sections``)."""
    kept = member.replicas.rank_rng.load(step)
    closing = None if kept is None else _closing_in(kept)
    if closing is None or closing.step != step or not closing.left:
        return []
    return [closing.section]


def owners_passed(
    member: Member, step: int, known: Collection[str] = (), wait_s: float = WAIT_S
) -> list[str]:
    """As the keeper of other ranks' records: the sections an owner passed the closing barrier
    of at the boundary after ``step`` steps (sorted), by the newest record it sent
    (``owners_closings``, the owners left undecided dropped)."""
    return owners_closings(member, step, known, wait_s)[0]


def owners_closings(
    member: Member, step: int, known: Collection[str] = (), wait_s: float = WAIT_S
) -> tuple[list[str], dict[str, list[int]]]:
    """As the keeper of other ranks' records: (the sections an owner passed the closing barrier
    of at the boundary after ``step`` steps, sorted; section -> the owners that entered its
    closing barrier and said neither that they passed nor that it failed, by the time the wait
    ran out).

    An owner whose record says it entered the closing barrier of a section not in ``known``
    (those this rank passed itself) and has neither passed nor left it may pass it as this
    rank reports: its barrier can complete some milliseconds after this rank's failed, and the
    frame saying so is on its way. For that one case this waits up to ``wait_s`` for the
    record to say which (an owner alive says ``left`` as its own barrier fails; one lost
    before it passed says nothing, and the wait runs out). Those still undecided then are
    reported as such: the plan cannot count the section as done, and says that redoing it may
    show twice what the owner did past the barrier (coordinator/rules/sections.py)."""
    deadline = time.monotonic() + wait_s
    while True:
        passed, pending = _owners_closings(member, step)
        undecided = {name: sorted(owners) for name, owners in pending.items() if name not in passed}
        if not set(undecided) - set(known) or time.monotonic() >= deadline:
            return sorted(passed), {k: v for k, v in sorted(undecided.items()) if k not in known}
        time.sleep(0.005)


def _owners_closings(member: Member, step: int) -> tuple[set[str], dict[str, set[int]]]:
    """(passed, section -> owners that entered it and are still undecided) of this rank's
    owners at ``step``."""
    peer = member.replicas.rank_rng_peer
    passed: set[str] = set()
    pending: dict[str, set[int]] = {}
    for owner in range(member.world_size):
        if owner == member.rank:
            continue
        for record in peer.held(owner):
            closing = _closing_in(record)
            if closing is None or not closing.step == step == record.step:
                continue
            if closing.passed:
                passed.add(closing.section)
            elif not closing.left and closing.end is not None:
                pending.setdefault(closing.section, set()).add(owner)
    return passed, pending


def _closing_in(record: RngRecord) -> Closing | None:
    if record.closing is None:
        return None
    try:
        return decode_closing(record.closing)
    except ValueError:
        return None


def adopt(member: Member, record: RngRecord) -> str | None:
    """As a replacement that fetched its predecessor's ``record`` from the keeper on another
    host: write the section's end generators and held lines it carries into this host's files,
    where the step loop looks for them. Returns why held lines cannot be shown (they were over
    the cap), for the caller to report; else None."""
    closing = _closing_in(record)
    if closing is None or closing.step != record.step:
        return None
    keeper = member.replicas.rank_rng
    if closing.end is not None:
        try:
            end = decode_record(closing.end)
        except ValueError:
            end = None
        if end is not None:
            keeper.keep_section_end(closing.step, end.rng, closing.section)
    if closing.held is not None:
        HeldLinesFile(keeper.directory, keeper.rank).keep(closing.step, closing.section, closing.held)
    if not closing.held_left_behind:
        return None
    return (
        f"rank {member.rank} was lost with {closing.held_size} bytes of lines held in section "
        f"{closing.section!r} after step {closing.step - 1}, over the {HELD_CAP} bytes carried to "
        "another host: they were on its lost host only and are not shown (shorten what the section "
        "logs to show it after a host loss)"
    )
