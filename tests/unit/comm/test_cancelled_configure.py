"""A generation whose forming is cancelled must keep its stores alive until gloo is done.

Why: a configure that is cancelled by a newer fault (or passes its deadline) returns at once, while
gloo is still connecting on a helper thread and calling into the store. torch keeps only the C++
half of a store written in Python (the root-less store is one); once its callers drop their
references, gloo calls into an object that no longer exists. A full-suite run saw a worker die of
SIGSEGV about 100 ms after its recovery was cancelled that way.
"""

from __future__ import annotations

import datetime
import gc
import threading
import time
import weakref

import pytest
import torch.distributed as dist

from checkpointless.comm.process_group import ResilientProcessGroup
from checkpointless.errors import RendezvousError

pytestmark = pytest.mark.timeout(60)


# what gloo called on the store, kept apart from it: the store itself may be gone
_CALLS: list[str] = []
# set by the test: the peer's address "arrives", so gloo goes on from its wait to a get
_ARRIVED = threading.Event()


class _PyStore(dist.Store):
    """A store written in Python (as the root-less one is). gloo waits in :meth:`wait` for the
    peer's address until the test says it arrived, then reads it with :meth:`get`."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = dist.HashStore()

    def set(self, key: str, value: bytes) -> None:
        _CALLS.append("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        _CALLS.append("get")
        raise RuntimeError(f"{key}: no peer in this test")  # gloo gives up here, either way

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        _CALLS.append("wait")
        if not _ARRIVED.wait(timeout.total_seconds() if timeout else 5.0):
            raise RuntimeError(f"timed out waiting for {keys}")


def test_a_cancelled_configure_keeps_a_python_store_alive_while_gloo_still_uses_it() -> None:
    pg = ResilientProcessGroup(0, 2, [0, 1], datetime.timedelta(seconds=5))
    store = _PyStore()
    cancelled = threading.Event()
    threading.Timer(0.2, cancelled.set).start()
    with pytest.raises(RendezvousError, match="cancelled"):
        # wrapped as the mesh wraps it: only the innermost store is the Python one
        pg.configure(1, dist.PrefixStore("gen1/", store), time.monotonic() + 5.0, cancelled)
    forming = [t for t in threading.enumerate() if t.name.startswith("cl-rpg-r0.1-gen1")]
    assert forming, "the forming thread should still be connecting after the cancel"
    assert _CALLS[-1:] == ["wait"], _CALLS  # gloo is waiting for its peer's address
    gone = weakref.ref(store)
    del store
    gc.collect()  # the caller's references are gone
    _ARRIVED.set()
    for t in forming:
        t.join(10)
    assert not any(t.is_alive() for t in forming)
    # gloo came back from its wait to read the address: the store it read from was still there
    # (without the fix torch reports a call of the pure virtual Store::get, or worse)
    assert _CALLS[-1:] == ["get"], _CALLS
    gc.collect()
    assert gone() is None, "the forming thread should let the store go once it is done"
