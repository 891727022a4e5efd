"""Who takes over a lost coordinator, and when: pure rules, no sockets or clocks.

Terms number the coordinators of a job: 0 is the one that started it, and each later term ``t``
has exactly one possible candidate, ``successors[(t - 1) % n]``. An agent votes at most once per
term (:class:`Ballot`), so one candidate per term means at most one coordinator per term, and a
candidate acts only with a strict majority of the last known membership: two disjoint sides of a
partition cannot both have one. See docs/architecture.md, "Coordinator failover".
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = [
    "Ballot",
    "HostSeen",
    "candidate_for",
    "elect_on_side",
    "first_live_term",
    "has_quorum",
    "keeps_majority",
    "membership",
    "quorum",
]


def quorum(members: int) -> int:
    """Votes a candidate needs: a strict majority of ``members`` hosts."""
    if members < 1:
        raise ValueError(f"a membership of {members} hosts has no majority; it needs at least one host")
    return members // 2 + 1


def has_quorum(votes: Collection[int], membership: Collection[int]) -> bool:
    """Whether ``votes`` (agent ids) hold a strict majority of ``membership``; votes from outside
    the membership (a host that joined after the last succession) do not count."""
    members = set(membership)
    return len(set(votes) & members) >= quorum(len(members))


def candidate_for(term: int, successors: Sequence[int]) -> int:
    """The one agent that may become coordinator in ``term``."""
    if term < 1:
        raise ValueError(f"term {term}: only terms from 1 on have a candidate (0 is the first coordinator)")
    if not successors:
        raise ValueError("an empty successor list names no candidate; the coordinator sends it at join")
    return successors[(term - 1) % len(successors)]


def first_live_term(after: int, successors: Sequence[int], live: Collection[int]) -> int | None:
    """The first term above ``after`` whose candidate is in ``live`` (one full turn of the list at
    most); None when no successor is live."""
    for term in range(after + 1, after + 1 + len(successors)):
        if candidate_for(term, successors) in live:
            return term
    return None


@dataclass
class Ballot:
    """One agent's vote record: the highest term it has voted in (or served as candidate)."""

    voted: int = 0

    def may_vote(self, term: int) -> bool:
        return term > self.voted

    def cast(self, term: int) -> bool:
        """Vote in ``term``; False (and nothing changes) if this agent already voted there or later."""
        if not self.may_vote(term):
            return False
        self.voted = term
        return True


def elect_on_side(
    side: Collection[int], membership: Collection[int], successors: Sequence[int], last_term: int
) -> tuple[int, int] | None:
    """What the agents of ``side`` (those that can reach each other) elect: ``(term, candidate)``
    or None. Every agent of the side tries the same first term whose candidate is on the side, so
    the side's votes all land there; the candidate wins with a majority of the membership."""
    term = first_live_term(last_term, successors, set(side))
    if term is None:
        return None
    voters = set(side) & set(membership)
    return (term, candidate_for(term, successors)) if has_quorum(voters, membership) else None


@dataclass(frozen=True)
class HostSeen:
    """One host as a coordinator sees it, for the majority it must keep."""

    host: int
    lost: bool
    remote: bool  # the embedded agent (a coordinator's own) is always heard
    last_seen: float  # monotonic time of its agent's last message


def membership(hosts: Collection[HostSeen], now: float, lease: float) -> list[int]:
    """The hosts a majority is counted against: the live ones, and those lost within two leases.
    A partition silences several hosts at once, and a coordinator that dropped each silent host
    from the count in turn would end up a "majority" of the few on its own side; after two leases
    the lost side has fenced itself (its agents give up a lease after they notice), so it drops out."""
    return sorted(h.host for h in hosts if not h.lost or now - h.last_seen <= 2 * lease)


def keeps_majority(hosts: Collection[HostSeen], now: float, lease: float) -> bool:
    """Whether a coordinator still hears a strict majority of its membership within a lease."""
    members = set(membership(hosts, now, lease))
    if not members:
        return True  # nothing to count against (a job that has not started its hosts)
    heard = {
        h.host
        for h in hosts
        if h.host in members and not h.lost and (not h.remote or now - h.last_seen <= lease)
    }
    return has_quorum(heard, members)
