"""The peer table and the rule that decides which participant owns a key.

The launcher hands every participant the same table of ``rank -> host:port`` (the address of that
rank's :class:`~checkpointless.rendezvous.server.KeyServer`). Nothing else has to be started: with
the table and the ownership rule below, every participant can compute, without asking anyone, which
peer holds any key.

Ownership rule (pure, identical in every process):

* a key whose last ``/``-separated component names a rank (``"7"`` or ``"rank_7"``, below the world
  size) is owned by that rank. Gloo publishes rank *i*'s address under ``"<device>/<i>"``, so rank
  *i* writes its own address into its own process, and a reader learns that rank *i* is gone from
  the very connection on which it asks for the address;
* every other key (counters, NCCL's unique id, barrier flags) is spread over the ranks by a stable
  hash (BLAKE2b of the UTF-8 key), so no participant holds more than its share.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Iterable, Sequence

from checkpointless.errors import ConfigError

__all__ = ["PeerTable", "group_by_owner", "key_owner", "parse_address"]


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into its parts; ConfigError when malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(f"peer address {address!r} is not of the form host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as e:
            raise ConfigError(f"peer address {address!r} has a malformed IPv6 host") from e
    elif ":" in host:
        raise ConfigError(f"peer address {address!r}: write an IPv6 host in brackets, [{host}]:port")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ConfigError(f"peer address {address!r} has port {port} outside 1-65535")
    return host, port


def _rank_named_by(component: str) -> int | None:
    """The rank that a final key component names, if it names one."""
    if component.startswith("rank_"):
        component = component[5:]
    # isdecimal() rejects "+1", " 1" and other forms int() would accept: the rule must be exact
    # so that every process, whatever wrote the key, derives the same owner.
    if component.isdecimal() and component.isascii() and (component == "0" or component[0] != "0"):
        return int(component)
    return None


def key_owner(key: str, world_size: int) -> int:
    """The rank that holds ``key`` in a generation of ``world_size`` participants."""
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1, got {world_size}")
    named = _rank_named_by(key.rpartition("/")[2])
    if named is not None and named < world_size:
        return named
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % world_size


def group_by_owner(keys: Sequence[str], world_size: int) -> dict[int, list[int]]:
    """Positions of ``keys`` grouped by owning rank, in the order each rank first appears.

    The positions (not the keys) are returned so that a caller can scatter the per-owner replies
    back into the caller's order, duplicates included.
    """
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key_owner(key, world_size), []).append(i)
    return groups


class PeerTable:
    """The ``rank -> host:port`` table of one generation; index = rank."""

    __slots__ = ("_addresses", "_endpoints")

    def __init__(self, addresses: Iterable[str], shared: Iterable[int] = ()) -> None:
        """``shared``: ranks whose keys another rank's key server holds (a degraded job's held
        slots, recovery/slots.py); every other rank has a key server of its own."""
        self._addresses = tuple(addresses)
        if not self._addresses:
            raise ConfigError("the peer table is empty: a generation needs at least one rank")
        self._endpoints = tuple(parse_address(a) for a in self._addresses)
        seen: dict[tuple[str, int], int] = {}
        held = frozenset(shared)
        for rank, endpoint in enumerate(self._endpoints):
            other = seen.setdefault(endpoint, rank)
            if other != rank and rank not in held and other not in held:
                raise ConfigError(
                    f"peer table gives ranks {other} and {rank} the same address "
                    f"{self._addresses[rank]}; every rank needs its own key server port"
                )

    def __len__(self) -> int:
        return len(self._addresses)

    def __getitem__(self, rank: int) -> str:
        return self._addresses[rank]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerTable) and other._addresses == self._addresses

    def __hash__(self) -> int:
        return hash(self._addresses)

    def __repr__(self) -> str:
        return f"PeerTable({list(self._addresses)!r})"

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._addresses

    def endpoint(self, rank: int) -> tuple[str, int]:
        """``(host, port)`` of ``rank``'s key server."""
        return self._endpoints[rank]

    def replace(self, rank: int, address: str) -> PeerTable:
        """The table of the next generation, in which a replacement process takes ``rank``."""
        if not 0 <= rank < len(self._addresses):
            raise ConfigError(f"rank {rank} is outside the peer table of {len(self)} ranks")
        changed = list(self._addresses)
        changed[rank] = address
        return PeerTable(changed)

    def to_json(self) -> str:
        return json.dumps({"peers": list(self._addresses)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> PeerTable:
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"peer table is not valid JSON: {e}") from e
        peers = doc.get("peers") if isinstance(doc, dict) else None
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ConfigError('peer table JSON must be {"peers": ["host:port", ...]}')
        return cls(peers)
