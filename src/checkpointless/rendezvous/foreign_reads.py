"""Failing a store read that C++ started on a thread of its own, without a Python exception.

Why (found in session 35, issue 39): with gloo's lazy connection, gloo reads a peer's address
key when a collective first needs the peer, from its own worker thread (``Context::getPair``,
inside the collective). A Python exception raised there by the store (the peer died: its key
server refuses) reaches C++ as pybind11's ``error_already_set``, which the collective's work
keeps and throws again at every ``wait()``. The first throw into Python moves the Python error
out of that object; the second finds it empty, and pybind11 raises ``std::runtime_error``
("restore() called a second time") inside its own exception handler, where nothing can catch
it: ``std::terminate``, SIGABRT. A polled wait re-asks a completed work for its outcome
(comm/handle.py), so every survivor of a dead peer aborted.

So a read that fails on such a thread returns a value instead of raising: one that torch's
store trampoline cannot cast to ``bytes``. Its C++ side then throws its own ``type_error``,
naming the value's type, whose name is the reason. A C++ exception is thrown again as a fresh
Python ``TypeError`` each time, so the collective fails normally, as often as it is waited on,
and the step's recovery runs. ``tests/unit/comm/test_gloo_connect.py`` holds torch to this.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["on_foreign_thread", "unreadable"]

_PREFIX = "store read failed: "


def on_foreign_thread() -> bool:
    """Whether the caller runs on a thread that Python did not start (a C++ library's own:
    gloo's workers, NCCL's watchdog). An exception raised there can only go back into C++."""
    return isinstance(threading.current_thread(), threading._DummyThread)


def unreadable(reason: str) -> Any:
    """A value that stands for a failed read, for a caller in C++ (see the module docstring).

    torch's trampoline refuses it as ``Object of type 'store read failed: <reason>' is not an
    instance of 'bytes'``. Indexing it gives itself, so a ``get`` written as
    ``multi_get([key])[0]`` (as subclasses do) passes it on instead of raising.
    """
    name = _PREFIX + reason.replace("\x00", " ")
    return type(name, (), {"__slots__": (), "__getitem__": lambda self, _i: self})()
