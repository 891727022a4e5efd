"""Session-wide results shared by every pytest-xdist worker of one run.

``make test`` runs the suite in several worker processes (pytest-xdist). A session fixture runs
once per worker, so a fault-free reference run or the corpus that many test files need would be
made once per worker, each a whole job. :class:`SharedDir` makes each such result once per run:
the first worker to ask makes it under an exclusive lock, and the others wait on the lock and read
the file it left. Without xdist it is a plain folder of the session's temporary directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

__all__ = ["SharedDir", "shared_root"]


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this run sees: the parent of the workers' own basetemps under
    xdist (``<basetemp>/popen-gwN``), the session's basetemp without it."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "shared"
    path.mkdir(exist_ok=True)
    return path


class SharedDir:
    """Results made once per run, keyed by what decides them."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def key(*parts: object) -> str:
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]

    @contextmanager
    def _locked(self, key: str, timeout: float) -> Iterator[None]:
        # flock, not a lock file's existence: a worker that dies holding it releases it with its
        # descriptor, so the next one makes the result instead of waiting for ever
        with open(self.root / f"{key}.lock", "w") as f:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"another worker held {self.root / key}.lock for {timeout} s"
                        ) from None
                    time.sleep(0.2)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def folder(self, key: str, make: Callable[[Path], None], timeout: float) -> Path:
        """``root/key``, filled once by ``make(folder)``; a folder whose ``make`` failed is made
        again by the next caller (it is only marked done after ``make`` returned)."""
        path = self.root / key
        done = self.root / f"{key}.done"
        with self._locked(key, timeout):
            if not done.exists():
                if path.exists():  # an earlier attempt's leftovers
                    for p in sorted(path.rglob("*"), reverse=True):
                        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
                path.mkdir(exist_ok=True)
                make(path)
                done.touch()
        return path

    def record(self, key: str, make: Callable[[], dict[str, Any]], timeout: float) -> dict[str, Any]:
        """A JSON record made once by ``make()``: written whole (temporary file, then rename), so
        a reader never sees half of one."""
        path = self.root / f"{key}.json"
        with self._locked(key, timeout):
            if not path.exists():
                value = make()
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(value))
                tmp.replace(path)
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
