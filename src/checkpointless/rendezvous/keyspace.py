"""The keys one participant holds, with the exact semantics of a torch.distributed store.

One :class:`KeySpace` lives in every participant, inside its :class:`KeyServer`. Remote readers
reach it through the server's socket; the participant itself reaches it directly (no socket, no
copy of the protocol), so a key that a rank writes about itself never leaves the process until a
peer asks for it. Both paths call the same methods, so they cannot disagree on semantics.

Waiting comes in two forms because the two callers block differently: the server's event loop
must never block, so it registers a callback (:meth:`watch`) that fires when the keys appear;
the participant's own threads block on a condition variable (:meth:`wait_local`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from checkpointless.errors import RendezvousError
from checkpointless.rendezvous.keyproto import MAX_WAIT_S

__all__ = ["KeySpace", "Watch"]


class Watch:
    """A pending remote wait: fires ``on_ready`` once every key in ``keys`` exists."""

    __slots__ = ("keys", "missing", "on_ready")

    def __init__(self, keys: list[str], missing: set[str], on_ready: Callable[[Watch], None]) -> None:
        self.keys = keys
        self.missing = missing
        self.on_ready = on_ready


class KeySpace:
    """A thread-safe key -> bytes map with torch store semantics and wake-ups for waiters."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._watches: dict[str, list[Watch]] = {}

    # -- writes: every write that creates a key wakes whoever waits for it ------------------------
    def _put(self, key: str, value: bytes) -> list[Watch]:
        """Store under the lock; return the watches that became ready (fired outside the lock)."""
        existed = key in self._data
        self._data[key] = value
        if existed:
            return []
        self._changed.notify_all()
        ready: list[Watch] = []
        for w in self._watches.pop(key, ()):
            w.missing.discard(key)
            if not w.missing:
                ready.append(w)
        return ready

    @staticmethod
    def _fire(ready: list[Watch]) -> None:
        for w in ready:
            w.on_ready(w)

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            ready = self._put(key, value)
        self._fire(ready)

    def multi_set(self, items: Iterable[tuple[str, bytes]]) -> None:
        ready: list[Watch] = []
        with self._lock:
            for key, value in items:
                ready += self._put(key, value)
        self._fire(ready)

    def add(self, key: str, amount: int) -> int:
        """Add to the decimal counter at ``key`` (0 when missing), as torch stores do."""
        with self._lock:
            old = self._data.get(key, b"0")
            try:
                value = int(old) + amount
            except ValueError as e:
                raise RendezvousError(f"add on key {key!r}, which holds a non-integer value") from e
            ready = self._put(key, str(value).encode())
        self._fire(ready)
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's compare_set: swap when the value equals ``expected``; return what is stored.

        A missing key counts as holding the empty value; when it is missing and ``expected`` is
        not empty nothing is stored and ``expected`` is returned, as TCPStore and HashStore do.
        """
        ready: list[Watch] = []
        with self._lock:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return expected
                ready = self._put(key, desired)
                result = desired
            elif current == expected:
                ready = self._put(key, desired)
                result = desired
            else:
                result = current
        self._fire(ready)
        return result

    def append(self, key: str, value: bytes) -> None:
        with self._lock:
            ready = self._put(key, self._data.get(key, b"") + value)
        self._fire(ready)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def drop_prefix(self, prefix: str) -> int:
        """Forget every key under ``prefix`` (an old generation); return how many were dropped.

        Watches on those keys are left alone: their readers time out or go away with their
        connection, and a late write to an old generation's key is simply never read.
        """
        with self._lock:
            doomed = [k for k in self._data if k.startswith(prefix)]
            for k in doomed:
                del self._data[k]
            return len(doomed)

    # -- reads --------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def values(self, keys: list[str]) -> list[bytes] | None:
        """All values, or None when any key is missing."""
        with self._lock:
            try:
                return [self._data[k] for k in keys]
            except KeyError:
                return None

    def missing(self, keys: Iterable[str]) -> list[str]:
        with self._lock:
            return [k for k in keys if k not in self._data]

    def count(self, prefix: str) -> int:
        with self._lock:
            return sum(1 for k in self._data if k.startswith(prefix))

    # -- waiting ------------------------------------------------------------------------------
    def watch(self, keys: list[str], on_ready: Callable[[Watch], None]) -> Watch | None:
        """Call ``on_ready`` once all ``keys`` exist; return None when they already do.

        The callback runs on the writer's thread, outside the lock.
        """
        with self._lock:
            missing = {k for k in keys if k not in self._data}
            if not missing:
                return None
            w = Watch(keys, missing, on_ready)
            for k in missing:
                self._watches.setdefault(k, []).append(w)
            return w

    def unwatch(self, w: Watch) -> None:
        """Cancel a watch (its reader timed out or left); harmless when it already fired."""
        with self._lock:
            for k in w.missing:
                lst = self._watches.get(k)
                if lst is None:
                    continue
                try:
                    lst.remove(w)
                except ValueError:
                    continue
                if not lst:
                    del self._watches[k]
            w.missing = set()

    def wait_local(self, keys: list[str], deadline: float) -> list[str]:
        """Block until every key exists or ``deadline`` (monotonic) passes; return those missing."""
        with self._lock:
            while True:
                missing = [k for k in keys if k not in self._data]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self._changed.wait(min(left, MAX_WAIT_S))  # a longer wait would overflow
