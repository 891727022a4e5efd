"""RootlessStore: a torch.distributed.Store with no root process.

Every participant holds the keys it owns (see :mod:`~checkpointless.rendezvous.peers` for the
rule) in its own :class:`KeyServer`; this class routes each store operation to the owner of each
key: straight into the local key space for this rank's own keys, over one authenticated
connection otherwise. Batched operations (``multi_get``, ``multi_set``, ``wait``, ``check``) are
grouped per owner and fanned out concurrently, one request per owner.

Generations: each instance serves one generation, named by ``prefix`` (e.g. ``"gen4/"``); every
key is stored as ``prefix + key``, so a rebuild never reads a key left over from an earlier one.
Build a new instance (with the new generation's peer table) for each rebuild; the KeyServer
stays and serves every generation.

What ProcessGroupGloo (torch 2.13) calls, all implemented here: ``set`` of its own address,
then either ``wait`` + ``get`` of every rank's address, or, with ``GLOO_ENABLE_STORE_V2_API=1``,
``has_extended_api`` and ``multi_get`` in batches of 128 keys. Calls that reach a Python store
from C++ are those torch's trampoline forwards (set, get, add, check, compare_set, wait,
multi_get, multi_set, append, has_extended_api); ``delete_key`` and ``num_keys`` work when
called from Python.

A call that a C++ library makes on a thread of its own (gloo's lazy connection reads a peer's
address from its worker thread, inside a collective) never raises: a failed ``get``,
``multi_get``, ``wait`` or ``check`` there returns a value torch's C++ refuses with its own
exception, so the collective fails and can be waited on again
(:mod:`~checkpointless.rendezvous.foreign_reads` says why a Python exception there aborts).

Keep a reference to the store for as long as a process group made from it lives: the C++ side
holds the store, but the Python methods vanish with the last Python reference.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from checkpointless.errors import ConfigError, RendezvousError
from checkpointless.rendezvous.client import PeerClient, Request
from checkpointless.rendezvous.foreign_reads import on_foreign_thread, unreadable
from checkpointless.rendezvous.keyproto import clamp_wait, join_values, split_values
from checkpointless.rendezvous.peers import PeerTable, group_by_owner, key_owner
from checkpointless.rendezvous.server import KeyServer

if TYPE_CHECKING:  # torch.distributed binds Store only at run time, where mypy cannot see it
    from torch._C._distributed_c10d import Store
else:
    from torch.distributed import Store

__all__ = ["RootlessStore"]


def _as_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RootlessStore(Store):
    """One participant's view of one generation's keys. Thread-safe."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        peers: PeerTable,
        secret: bytes,
        prefix: str,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        server: KeyServer | None = None,
        *,
        connect_grace: datetime.timedelta = datetime.timedelta(seconds=3),
        max_idle_connections: int = 128,
    ) -> None:
        super().__init__()
        if not isinstance(peers, PeerTable):
            raise ConfigError(f"peers must be a PeerTable, got {type(peers).__name__}")
        if world_size != len(peers):
            raise ConfigError(f"world size {world_size} does not match the peer table's {len(peers)} ranks")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}")
        if not isinstance(secret, bytes) or not secret:
            raise ConfigError("the rendezvous store needs the job secret as non-empty bytes")
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError("each generation needs a non-empty key prefix, e.g. 'gen4/'")
        if timeout.total_seconds() <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        if server is not None and server.port != peers.endpoint(rank)[1]:
            raise ConfigError(
                f"the key server given to rank {rank} listens on port {server.port}, but the peer "
                f"table lists {peers[rank]} for that rank"
            )
        self.rank = rank
        self.world_size = world_size
        self.peers = peers
        self.prefix = prefix
        self.connect_grace = connect_grace
        self._secret = secret
        self._server = server
        self._max_idle = max_idle_connections
        self._client = PeerClient(peers, secret, prefix, connect_grace.total_seconds(), max_idle_connections)
        self._lock = threading.Lock()
        self._failed_waits: dict[str, str] = {}  # key -> why a wait on a C++ thread failed
        self.set_timeout(timeout)

    def __repr__(self) -> str:
        return f"RootlessStore(rank={self.rank}, world_size={self.world_size}, prefix={self.prefix!r})"

    # -- plumbing -----------------------------------------------------------------------------
    def set_timeout(self, timeout: datetime.timedelta) -> None:
        super().set_timeout(timeout)  # C++ callers read the base class's copy
        self._timeout = timeout

    @property
    def timeout(self) -> datetime.timedelta:
        """The default deadline of every operation (set by the constructor or set_timeout)."""
        return self._timeout

    @property
    def requests_sent(self) -> int:
        """Requests this participant sent to other owners (for load measurements)."""
        return self._client.requests_sent

    def owner(self, key: str) -> int:
        """The rank that holds ``key`` in this generation."""
        return key_owner(self.prefix + key, self.world_size)

    def _local(self, owner: int) -> bool:
        return self._server is not None and owner == self.rank

    def _deadline(self, timeout: datetime.timedelta | None = None) -> float:
        # clamped: torch passes its group's timeout, which may be years (Lightning's: 10000 days)
        return time.monotonic() + clamp_wait((timeout or self.timeout).total_seconds())

    def _timed_out(self, missing: list[str], op: str) -> RendezvousError:
        return RendezvousError(
            f"rank {self.rank} ({self.peers[self.rank]}) holds no value for {missing} at the deadline "
            f"of {op!r}: the key was never written [generation {self.prefix!r}]"
        )

    def _one(self, key: str, header: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """Send a single-key request to the key's (remote) owner."""
        full = self.prefix + key
        reply = self._client.call(
            key_owner(full, self.world_size), ({**header, "keys": [full]}, payload), self._deadline()
        )
        return reply[0], bytes(reply[1])

    def _grouped(
        self,
        keys: list[str],
        make: Callable[[list[str], list[int]], Request],
        local: Callable[[list[str], list[int]], None],
        deadline: float,
    ) -> dict[int, tuple[list[int], dict[str, Any], bytearray]]:
        """Fan ``keys`` out to their owners: one request per remote owner, ``local`` for ours.

        Returns each remote owner's positions (into ``keys``) and reply.
        """
        full = [self.prefix + k for k in keys]
        groups = group_by_owner(full, self.world_size)
        mine = groups.pop(self.rank, None) if self._server is not None else None
        requests = {owner: make([full[i] for i in pos], pos) for owner, pos in groups.items()}
        run_local = None if mine is None else (lambda: local([full[i] for i in mine], mine))
        if not requests:
            if run_local is not None:
                run_local()
            return {}
        replies = self._client.fanout(requests, deadline, run_local)
        return {owner: (groups[owner], h, p) for owner, (h, p) in replies.items()}

    def close(self) -> None:
        """Close this generation's connections (the key server is not touched)."""
        self._client.close()

    # -- torch.distributed.Store ----------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self.multi_set([key], [_as_bytes(value)])

    def multi_set(self, keys: list[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys and {len(values)} values")
        data = [_as_bytes(v) for v in values]
        ks = self._server.keyspace if self._server is not None else None

        def make(full: list[str], pos: list[int]) -> Request:
            lens, payload = join_values([data[i] for i in pos])
            return {"op": "set", "keys": full, "lens": lens}, payload

        def local(full: list[str], pos: list[int]) -> None:
            assert ks is not None
            ks.multi_set(zip(full, [data[i] for i in pos], strict=True))

        self._grouped(keys, make, local, self._deadline())

    def get(self, key: str) -> bytes:
        if on_foreign_thread():
            return cast(bytes, self._read_for_cpp([key], one=True))
        return self._read([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every value, waiting (up to the store timeout) for keys not written yet."""
        if on_foreign_thread():
            return cast(list[bytes], self._read_for_cpp(keys, one=False))
        return self._read(keys)

    def _read_for_cpp(self, keys: list[str], one: bool) -> Any:
        """A read on a C++ library's own thread (gloo's lazy connection reads a peer's address
        there): a failure, or one its ``wait`` met, is returned as a value torch's C++ refuses,
        never raised (rendezvous/foreign_reads.py says why a raise there aborts the process)."""
        with self._lock:
            failed = [self._failed_waits.pop(k) for k in keys if k in self._failed_waits]
        if failed:
            return unreadable(failed[0])
        try:
            values = self._read(keys)
        except Exception as e:
            return unreadable(str(e))
        return values[0] if one else values

    def _read(self, keys: list[str]) -> list[bytes]:
        deadline = self._deadline()
        out: list[bytes] = [b""] * len(keys)
        ks = self._server.keyspace if self._server is not None else None

        def make(full: list[str], pos: list[int]) -> Request:
            return {"op": "get", "keys": full, "timeout": max(0.0, deadline - time.monotonic())}, b""

        def local(full: list[str], pos: list[int]) -> None:
            assert ks is not None
            missing = ks.wait_local(full, deadline)
            values = ks.values(full)
            if missing or values is None:
                raise self._timed_out(missing or ks.missing(full), "get")
            for i, v in zip(pos, values, strict=True):
                out[i] = v

        for _owner, (pos, header, payload) in self._grouped(keys, make, local, deadline).items():
            values = split_values(header.get("lens"), payload, len(pos))
            if values is None:
                raise RendezvousError(f"rank {_owner} sent a malformed multi_get reply")
            for i, v in zip(pos, values, strict=True):
                out[i] = v
        return out

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if not on_foreign_thread():
            self._wait(keys, timeout)
            return
        # on a C++ library's own thread a raise would abort the process: the failure is kept
        # for the read that follows (gloo waits for a key, then gets it), which returns it
        try:
            self._wait(keys, timeout)
        except Exception as e:
            with self._lock:
                self._failed_waits.update(dict.fromkeys(keys, str(e)))

    def _wait(self, keys: list[str], timeout: datetime.timedelta | None) -> None:
        deadline = self._deadline(timeout)
        ks = self._server.keyspace if self._server is not None else None

        def make(full: list[str], pos: list[int]) -> Request:
            return {"op": "wait", "keys": full, "timeout": max(0.0, deadline - time.monotonic())}, b""

        def local(full: list[str], pos: list[int]) -> None:
            assert ks is not None
            missing = ks.wait_local(full, deadline)
            if missing:
                raise self._timed_out(missing, "wait")

        self._grouped(keys, make, local, deadline)

    def check(self, keys: list[str]) -> bool:
        if not on_foreign_thread():
            return self._check(keys)
        try:
            return self._check(keys)
        except Exception as e:  # torch's C++ refuses the value instead (foreign_reads.py)
            return cast(bool, unreadable(str(e)))

    def _check(self, keys: list[str]) -> bool:
        present = [True]
        ks = self._server.keyspace if self._server is not None else None

        def make(full: list[str], pos: list[int]) -> Request:
            return {"op": "check", "keys": full}, b""

        def local(full: list[str], pos: list[int]) -> None:
            assert ks is not None
            present[0] = not ks.missing(full)

        replies = self._grouped(keys, make, local, self._deadline())
        return present[0] and all(h.get("present") is True for _, h, _ in replies.values())

    def add(self, key: str, amount: int) -> int:
        if self._local(self.owner(key)):
            assert self._server is not None
            return self._server.keyspace.add(self.prefix + key, int(amount))
        header, _ = self._one(key, {"op": "add", "amount": int(amount)})
        value = header.get("value")
        if not isinstance(value, int):
            raise RendezvousError(f"rank {self.owner(key)} sent a malformed add reply")
        return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        old, new = _as_bytes(expected), _as_bytes(desired)
        if self._local(self.owner(key)):
            assert self._server is not None
            return self._server.keyspace.compare_set(self.prefix + key, old, new)
        lens, payload = join_values([old, new])
        return self._one(key, {"op": "cas", "lens": lens}, payload)[1]

    def append(self, key: str, value: str | bytes) -> None:
        data = _as_bytes(value)
        if self._local(self.owner(key)):
            assert self._server is not None
            self._server.keyspace.append(self.prefix + key, data)
            return
        self._one(key, {"op": "append"}, data)

    def delete_key(self, key: str) -> bool:
        if self._local(self.owner(key)):
            assert self._server is not None
            return self._server.keyspace.delete(self.prefix + key)
        return self._one(key, {"op": "del"})[0].get("deleted") is True

    def num_keys(self) -> int:
        """Keys of this generation across all owners: asks every participant (O(N) requests)."""
        total = 0
        requests: dict[int, Request] = {}
        for rank in range(self.world_size):
            if self._local(rank):
                assert self._server is not None
                total += self._server.keyspace.count(self.prefix)
            else:
                requests[rank] = ({"op": "count", "prefix": self.prefix}, b"")
        for header, _ in self._client.fanout(requests, self._deadline()).values():
            count = header.get("count")
            if not isinstance(count, int):
                raise RendezvousError("a key server sent a malformed count reply")
            total += count
        return total

    def has_extended_api(self) -> bool:
        # Tells gloo (with GLOO_ENABLE_STORE_V2_API=1) to read peers' addresses with multi_get.
        return True

    def clone(self) -> RootlessStore:
        """A store for the same generation with its own connections (for another thread)."""
        return RootlessStore(
            self.rank,
            self.world_size,
            self.peers,
            self._secret,
            self.prefix,
            self.timeout,
            self._server,
            connect_grace=self.connect_grace,
            max_idle_connections=self._max_idle,
        )
