"""The XXH3-128 digests of a stream's messages, computed piece by piece as the bytes move.

Separate from the socket code (``stream_io.py``) because where the hashing runs is a decision of
its own, made from the cores this process may use, and it has its own thread to manage.

A large tensor's bytes are hashed piece by piece, exactly the piece each socket call just moved,
while it is still in cache (XXH3 runs at ~47 GB/s from cache, ~16 from memory). Where the process
has cores to spare (four or more), a helper thread hashes the pieces while the socket moves the
next ones; on fewer cores it would only take CPU from the copy, and the socket's thread hashes
each piece itself. Measured, 2 GB over loopback: on 2 cores, whole 4 MiB chunks hashed before
sending (and after receiving) left each side idle while the other hashed (77% of raw TCP), pieces
hashed inline 92%, a helper thread less; on 16 cores, pieces inline reached 74%, while the gloo
path, which hashes on a pool beside gloo's I/O threads, reached 98%.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import xxhash

from checkpointless.errors import StateTransferError

__all__ = ["Hasher", "hash_on_thread"]


def hash_on_thread() -> bool:
    """Hash on a helper thread? ``CHECKPOINTLESS_STREAM_HASH=thread|inline`` decides; by default
    yes when this process may run on four or more cores."""
    choice = os.environ.get("CHECKPOINTLESS_STREAM_HASH", "")
    if choice in ("thread", "inline"):
        return choice == "thread"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores >= 4


_END = object()  # queue marker: the current message is complete


class Hasher:
    """The XXH3-128 digest of every message, in order, fed piece by piece as bytes move.

    Threaded, the pieces go to a helper thread (xxhash releases the GIL) and the socket's thread
    never waits for a hash; inline, each piece is hashed at once. Either way the pieces must stay
    untouched until :meth:`digests` returns: they are the tensors being sent or received."""

    def __init__(self, threaded: bool) -> None:
        self._h = xxhash.xxh3_128()
        self._out: list[str] = []
        self._error: BaseException | None = None
        self._cancelled = False
        self._q: queue.SimpleQueue[object] | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._q = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._run, args=(self._q,), daemon=True, name="cl-stream-hash"
            )
            self._thread.start()

    def _run(self, q: queue.SimpleQueue[object]) -> None:
        while (item := q.get()) is not None:
            if self._error is not None or self._cancelled:
                continue  # drain without hashing: the transfer has failed
            try:
                self._feed(item)
            except BaseException as e:
                self._error = e

    def _feed(self, item: object) -> None:
        if item is _END:
            self._out.append(self._h.hexdigest())
            self._h = xxhash.xxh3_128()
        else:
            self._h.update(item)  # type: ignore[arg-type]

    def update(self, piece: memoryview) -> None:
        if self._q is not None:
            self._q.put(piece)
        else:
            self._feed(piece)

    def end(self) -> None:
        """The message fed so far is complete."""
        if self._q is not None:
            self._q.put(_END)
        else:
            self._feed(_END)

    def message(self, view: memoryview) -> None:
        """A whole message at once."""
        self.update(view)
        self.end()

    def digests(self, deadline: float) -> list[str]:
        """Every complete message's digest, once the helper thread has caught up."""
        if self._q is not None:
            self._q.put(None)
            self._q = None
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                raise StateTransferError("state transfer timed out while hashing")
        if self._error is not None:
            raise StateTransferError(f"hashing the state failed: {self._error!r}")
        return self._out

    def close(self) -> None:
        """Stop the helper thread without waiting for it (idempotent). After a failed transfer it
        skips what is still queued instead of hashing bytes nobody will check."""
        self._cancelled = True
        if self._q is not None:
            self._q.put(None)
            self._q = None
