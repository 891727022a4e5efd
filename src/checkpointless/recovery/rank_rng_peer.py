"""Every rank's generator records kept on another host too, so that a lost host's ranks resume
their own streams (issue 38).

recovery/rank_rng.py keeps each rank's record (its global generators at each point a recovery
may resume from) in the job's shared memory on its own host; a host lost takes those records
with it. So each rank also sends every record it writes to its *keeper*, the rank one host over
(``state/buddy_ring.buddy_of``, the ring the buddy copies use), and a replacement that finds no
record on its host asks the keeper of its rank for the one of the step it resumes at.

Why this shape, and what it costs. A record is ~12.7 KB. The owner sends it on the training
thread, as one sealed frame on a connection it keeps open to its keeper's key server (opened
once per generation, on a helper thread, through the key server as every state stream is:
authenticated and nonce-checked): ``sendall`` of a frame the kernel buffers, some tens of
microseconds, no wait for an answer (``benchmarks/rank_rng_peer.py`` measures it). Sent on the
training thread, not queued for another thread, because the order is the guarantee: the record
of where step ``s + 1`` starts is written to the socket before the rank issues step ``s``'s
first gradient all-reduce (rank_rng.py keeps it there), so no peer can commit step ``s`` (and a
recovery settle on ``s + 1``) before the keeper's socket holds that record. The keeper reads
its owners' connections on a thread of its own and keeps each owner's newest record of each
step parity (two steps, as the shared-memory slots). A host lost before the kernel put the
frame on the wire (microseconds) leaves its keeper one step behind: the replacement is then
told "no record", never given another step's.

No copy is sent when the keeper shares the owner's host (one machine): the shared memory serves
a replacement there. Records travel through the key servers of the root-less rendezvous only
(``--rendezvous tcp`` has none): without them a lost host's records are lost, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from checkpointless.errors import StateTransferError
from checkpointless.events import get_logger
from checkpointless.recovery.rank_rng import RngRecord, decode_record, record_point
from checkpointless.rendezvous.peers import parse_address
from checkpointless.rendezvous.server import KeyServer
from checkpointless.state.stream import StreamRoute, open_stream
from checkpointless.state.stream_io import read_frame, write_frame
from checkpointless.wire import encode_frame

__all__ = ["ASK_CHANNEL", "KEEP_CHANNEL", "PeerRecords", "fetch_records", "pick"]

Accepted = queue.SimpleQueue[tuple[socket.socket, dict[str, Any]]]
Handler = Callable[[socket.socket, int, StreamRoute], None]

log = get_logger()

KEEP_CHANNEL = "rank-rng/keep"  # an owner's records, one sealed frame each
ASK_CHANNEL = "rank-rng/ask"  # a replacement asks for what its rank's keeper holds
_DIGEST = 16  # a record ends with its XXH3-128 digest (rank_rng.py)
# ~12.7 KB, more with many CUDA devices, plus the loader positions (at most rank_data's 4 MiB):
# anything larger is not a record
_MAX_RECORD = 5 << 20
_SEND_TIMEOUT_S = 1.0  # a frame the kernel cannot buffer within this: the keeper is gone
_CONNECT_S = 30.0  # the keeper may be a replacement still receiving its state


def _host(address: str) -> str:
    return parse_address(address)[0]


@dataclass(frozen=True)
class _Held:
    """One record as its owner sent it: checked against ``digest`` (sealed) when asked for."""

    step: int
    digest: bytes
    data: bytes

    def verified(self) -> bytes | None:
        try:
            step, _ = record_point(self.data)  # the body against the record's own digest
        except ValueError:
            return None
        return self.data if step == self.step and self.data[-_DIGEST:] == self.digest else None


class _Kept:
    """What a keeper holds: each owner's newest record per step parity, and which connection of
    the owner's is the current one (an older one still draining is a dead process's)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[int, dict[int, _Held]] = {}  # owner -> parity -> its newest record
        self.epochs: dict[int, int] = {}  # owner -> its newest connection

    def connected(self, owner: int) -> int:
        with self.lock:
            epoch = self.epochs[owner] = self.epochs.get(owner, 0) + 1
            return epoch

    def store(self, owner: int, epoch: int, held: _Held) -> None:
        with self.lock:
            if self.epochs.get(owner) == epoch:
                self.records.setdefault(owner, {})[held.step % 2] = held

    def of(self, owner: int) -> list[bytes]:
        """``owner``'s records that pass their checks (a torn or forged one is never given)."""
        with self.lock:
            held = list(self.records.get(owner, {}).values())
        return [d for d in (h.verified() for h in held) if d is not None]


class PeerRecords:
    """One process's two sides: as an owner it sends its records to its keeper; as a keeper it
    holds its owners' records and answers whoever asks for them."""

    def __init__(self) -> None:
        self.rank = -1
        self.keeper: int | None = None  # the rank one host over (None: one rank)
        self._lock = threading.Lock()  # the owner's connection and newest records
        self._sock: socket.socket | None = None
        self._route: StreamRoute | None = None
        self._generation = -1
        self._newest: dict[int, tuple[int, bytes]] = {}  # parity -> this rank's newest (step, record)
        self._sent: dict[int, bytes] = {}  # parity -> the record the connection carried last
        self._kept = _Kept()
        self._served: KeyServer | None = None
        self.sent_frames = 0  # records sent (for the benchmark and the tests)

    def place(self, rank: int, keeper: int | None) -> None:
        """This process holds ``rank`` now (a spare learns it at assignment); ``keeper`` keeps
        its records."""
        self.rank = rank
        self.keeper = keeper

    # -- the owner's side ----------------------------------------------------------------------
    def resume(self, generation: int, route: StreamRoute | None, *, held: bool = False) -> None:
        """A generation formed: serve this process's owners, and open a connection to this
        rank's keeper (on a helper thread), which first receives the newest records.

        ``held``: this instance sends the records of a slot this process holds in degraded mode
        (recovery/slot_rng.py). The process's own instance serves; and the records go to the
        slot's keeper even on this host (the holder itself, maybe): the spare that takes the
        slot back may start on any host and asks that keeper."""
        with self._lock:
            self._drop()
            self._generation = generation
            self._route = None
        if route is None:
            return
        if not held:
            self.serve(route)
        keeper = self.keeper
        if keeper is None or (not held and _host(route.peers[keeper]) == _host(route.peers[self.rank])):
            return  # one host: the shared memory serves a replacement
        self._route = dataclasses.replace(route, channel=KEEP_CHANNEL)
        threading.Thread(
            target=self._connect, args=(generation, keeper), name="cl-rank-rng-send", daemon=True
        ).start()

    def send(self, step: int, data: bytes) -> None:
        """Send this rank's newest record, of step ``step``, to its keeper now (on the caller's
        thread: the frame is in the kernel's hands when this returns), or as the connection
        opens."""
        with self._lock:
            self._newest[step % 2] = (step, data)
            if self._sock is not None:
                self._send_locked(step, data)

    def close(self) -> None:
        with self._lock:
            self._drop()
            self._route = None

    def _connect(self, generation: int, keeper: int) -> None:
        route = self._route
        if route is None:
            return

        def stale() -> str | None:
            return "a newer generation" if self._generation != generation else None

        try:
            sock = open_stream(route, keeper, self.rank, time.monotonic() + _CONNECT_S, stale)
        except StateTransferError as e:
            log.info("no connection to rank %d, which keeps this rank's generators: %s", keeper, e)
            return
        sock.settimeout(_SEND_TIMEOUT_S)
        with self._lock:
            if self._generation != generation or self._sock is not None:
                sock.close()
                return
            self._sock = sock
            self._sent = {}
            # the older step first: a keeper holds the newest record of each parity
            for step, data in sorted(self._newest.values(), key=lambda sd: sd[0]):
                if self._sock is not None:
                    self._send_locked(step, data)

    def _send_locked(self, step: int, data: bytes) -> None:
        assert self._sock is not None and self._route is not None
        if self._sent.get(step % 2) is data:
            return
        # a small sealed header (the step, the length and the record's own XXH3-128 digest, its
        # last 16 bytes), then the record's bytes: one system call, and the keeper checks the
        # bytes against the sealed digest only when somebody asks for them
        head = {"step": step, "size": len(data), "digest": data[-_DIGEST:].hex()}
        try:
            self._sock.sendall(encode_frame(self._route.request_key, head) + data)
        except OSError as e:
            log.info("the generator records' connection to rank %s broke: %s", self.keeper, e)
            self._drop()
            return
        self._sent[step % 2] = data
        self.sent_frames += 1

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None
        self._sent = {}

    # -- the keeper's side ---------------------------------------------------------------------
    def serve(self, route: StreamRoute) -> None:
        """Accept owners' records and replacements' questions on this process's key server
        (once; the server and the secret outlive every generation)."""
        if self._served is route.server:
            return
        self._served = route.server
        for channel, handle in ((KEEP_CHANNEL, self._keep), (ASK_CHANNEL, self._answer)):
            accepted = route.server.open_channel(channel)
            threading.Thread(
                target=self._accept,
                args=(accepted, handle, route),
                name=f"cl-{channel.replace('/', '-')}",
                daemon=True,
            ).start()

    def fetch(self, route: StreamRoute, step: int, timeout: float) -> RngRecord | None:
        """As a replacement: this rank's record of ``step`` from its keeper, if it holds one.
        This process answers its own owners first (its keeper may be a replacement asking it)."""
        self.serve(route)
        keeper = self.keeper
        if keeper is None or _host(route.peers[keeper]) == _host(route.peers[self.rank]):
            return None  # one host: what the shared memory did not hold, nobody holds
        found = pick(fetch_records(route, keeper, self.rank, timeout), step)
        if found is not None:
            log.info("resuming rank %d's own generators of step %d, kept by rank %d", self.rank, step, keeper)
        return found

    def fetch_of(
        self, route: StreamRoute, owner: int, keeper: int | None, step: int, timeout: float
    ) -> RngRecord | None:
        """As the holder of lost rank ``owner``'s slot (degraded mode): ``owner``'s record of
        ``step`` from ``keeper``, its keeper, which may be this process itself."""
        self.serve(route)
        if keeper is None:
            return None
        records = self.held(owner) if keeper == self.rank else fetch_records(route, keeper, owner, timeout)
        found = pick(records, step)
        if found is not None:
            log.info(
                "slot %d's own generators of step %d, kept by rank %d, go to its holder", owner, step, keeper
            )
        return found

    def held(self, owner: int) -> list[RngRecord]:
        """The records this process keeps for ``owner`` (tests, and what an ask returns)."""
        return [decode_record(d) for d in self._kept.of(owner)]

    def _accept(self, accepted: Accepted, handle: Handler, route: StreamRoute) -> None:
        while True:
            sock, request = accepted.get()
            owner = request.get("rank")
            if not isinstance(owner, int) or owner < 0:
                sock.close()
                continue
            handle(sock, owner, route)

    def _keep(self, sock: socket.socket, owner: int, route: StreamRoute) -> None:
        epoch = self._kept.connected(owner)
        threading.Thread(
            target=self._read, args=(sock, owner, epoch, route), name=f"cl-rank-rng-keep-{owner}", daemon=True
        ).start()

    def _read(self, sock: socket.socket, owner: int, epoch: int, route: StreamRoute) -> None:
        """An owner's records, until its connection ends (its process did, or a new generation)."""
        forever = time.monotonic() + 10 * 365 * 86400.0
        try:
            while True:
                head = read_frame(sock, route.request_key, forever, lambda: None, "a generator record")
                step, size, digest = head.get("step"), head.get("size"), head.get("digest")
                if not isinstance(step, int) or not isinstance(size, int) or not 0 < size <= _MAX_RECORD:
                    return  # not a record's header: the connection ends
                data = _recv_raw(sock, size)
                self._kept.store(owner, epoch, _Held(step, bytes.fromhex(str(digest)), data))
        except (StateTransferError, ValueError, OSError):
            pass  # the owner's process ended, or sent what is not a record: what was kept stays
        finally:
            sock.close()

    def _answer(self, sock: socket.socket, owner: int, route: StreamRoute) -> None:
        records = self._kept.of(owner)
        try:
            deadline = time.monotonic() + _SEND_TIMEOUT_S
            write_frame(
                sock, route.reply_key, deadline, {"sizes": [len(r) for r in records]}, b"".join(records)
            )
        except (StateTransferError, OSError) as e:
            log.info("could not answer rank %d's question for its generators: %s", owner, e)
        finally:
            sock.close()


def _recv_raw(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (the socket's timeout is a poll: waited through, as the reader
    waits for the next header)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            continue
        if k == 0:
            raise OSError("the owner's connection closed inside a record")
        got += k
    return bytes(buf)


def fetch_records(route: StreamRoute, keeper: int, rank: int, timeout: float) -> list[RngRecord]:
    """What ``keeper`` holds of ``rank``'s records (a replacement of ``rank`` asks); none when the
    keeper cannot be reached or holds none.

    Raises nothing: a keeper lost too is a record not found."""
    ask = dataclasses.replace(route, channel=ASK_CHANNEL)
    deadline = time.monotonic() + timeout
    try:
        sock = open_stream(ask, keeper, rank, deadline, lambda: None)
    except StateTransferError as e:
        log.info("rank %d, which keeps rank %d's generators, did not answer: %s", keeper, rank, e)
        return []
    try:
        frame = read_frame(sock, ask.reply_key, deadline, lambda: None, "the generator records")
    except StateTransferError as e:
        log.info("rank %d's generator records from rank %d broke off: %s", rank, keeper, e)
        return []
    finally:
        sock.close()
    return _split(frame.get("payload", b""), frame.get("sizes"))


def _split(payload: bytes, sizes: object) -> list[RngRecord]:
    if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        return []
    if sum(sizes) != len(payload):
        return []
    out: list[RngRecord] = []
    at = 0
    for n in sizes:
        try:
            out.append(decode_record(payload[at : at + n]))
        except ValueError:
            pass  # a record that fails its digest is never restored
        at += n
    return out


def pick(records: Sequence[RngRecord], step: int) -> RngRecord | None:
    """The record of ``step`` among ``records`` (a keeper holds the newest of each parity)."""
    return next((r for r in records if r.step == step), None)
