"""Verified snapshots of the training state in host shared memory, written off the training thread.

Why: peer-to-peer recovery needs one living replica. When every process that holds the state dies
(a burst of kills, a node-wide OOM kill of the workers), there is no peer left to copy from. A
snapshot in ``/dev/shm`` outlives the processes, so the replacements load it and replay the few
steps since it was taken; steps are pure functions of the step index, so the job still ends
bitwise identical to a fault-free run.

Why the copy is consistent although it runs beside the next step: the parameters and the
optimizer's state change only inside ``optimizer.step()``, and the job's optimizer pre-hook waits
for the copy (:meth:`SnapshotWriter.wait_copied`) before any update starts. Every other tensor
(buffers a forward pass may update, RNG states, scheduler and user state) is copied on the
training thread when the snapshot starts, which costs little because such tensors are small.

The snapshot file (its format, publication and verified loading) is ``snapshot_file.py``; where
snapshots live in the job's shared memory is ``shm_dir.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from checkpointless.errors import ConfigError
from checkpointless.events import get_logger
from checkpointless.state.codec import Layout
from checkpointless.state.shm_dir import snapshot_path
from checkpointless.state.snapshot import (
    Stateful,
    restore_from,
)
from checkpointless.state.snapshot_file import SnapshotInfo, load_snapshot, write_snapshot
from checkpointless.state.staging import staged_layout

__all__ = ["SnapshotWriter", "restore_snapshot"]

log = get_logger()


def restore_snapshot(objects: dict[str, Stateful], directory: Path, step: int) -> dict[str, Any]:
    """Load the verified snapshot of ``step`` into ``objects`` and the RNGs; return its stats."""
    return restore_from(objects, step, lambda own: load_snapshot(directory, step, own), "snapshot")


class SnapshotWriter:
    """Takes a snapshot every ``every`` steps on a background thread, one at a time."""

    def __init__(self, directory: Path, every: int) -> None:
        if every < 0:
            raise ConfigError(f"--snapshot-every must be 0 (off) or a number of steps (got {every})")
        self.directory = directory
        self.every = every
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._cancel = threading.Event()
        self._copied.set()
        self._published: SnapshotInfo | None = None
        self._reported_size = 0
        self.skipped = 0  # snapshots not taken because the previous one was still being written

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def start(self, step: int, state: Any, guarded: set[int], staged: Layout | None = None) -> bool:
        """Begin the snapshot of ``state`` (taken as step ``step`` begins). Lays it out and copies
        the unguarded tensors now (or takes ``staged``, :func:`staged_layout` of the same state,
        shared with the buddy copy); the rest is copied on a thread. False if not started."""
        if self._thread is not None and self._thread.is_alive():
            self.skipped += 1  # never queue: memory stays at two slots, training never waits here
            return False
        if snapshot_path(self.directory, step).exists():
            return False  # a replay of steps already covered (after a restore)
        src = staged if staged is not None else staged_layout(state, guarded)
        lay = Layout(src.manifest, list(src.messages), src.ready)  # our own list: the writer clears it
        self._copied.clear()
        self._cancel.clear()
        self._thread = threading.Thread(
            target=self._run, args=(step, lay), name=f"cl-snapshot-{step}", daemon=True
        )
        self._thread.start()
        return True

    def _run(self, step: int, lay: Layout) -> None:
        try:
            info = write_snapshot(self.directory, step, lay, self._copied, self._cancel)
        except Exception as e:  # a failed snapshot must not fail training: log it, keep the old one
            log.warning("snapshot of step %d failed: %s", step, e)
            self._copied.set()
            return
        if info is not None:
            self._published = info
            if info.nbytes > self._reported_size:
                self._reported_size = info.nbytes
                log.info(
                    "snapshot of step %d in %s: %.1f MB, at most 2 kept (%.1f MB of shared memory); "
                    "copy %.3f s, total %.3f s",
                    step,
                    self.directory,
                    info.nbytes / 1e6,
                    2 * info.nbytes / 1e6,
                    info.copy_s,
                    info.total_s,
                )

    def wait_copied(self, timeout: float) -> float:
        """Block until the live tensors have been copied; return the seconds waited. Past the
        deadline the snapshot is cancelled (it would not be consistent) and training goes on."""
        if self._copied.is_set():
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + timeout
        while not self._copied.wait(timeout=max(0.0, min(0.5, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                self._cancel.set()
                log.warning("snapshot copy took over %.0f s; cancelled it, the previous one stays", timeout)
                break
        return time.monotonic() - t0

    def take_published(self) -> SnapshotInfo | None:
        """The snapshot published since the last call, if any (for the commit event)."""
        info, self._published = self._published, None
        return info

    def wait_idle(self, timeout: float) -> bool:
        """Wait (bounded) for the snapshot in flight to be published; True if none is left."""
        t = self._thread
        if t is not None:
            t.join(timeout=timeout)
        return t is None or not t.is_alive()

    def close(self, timeout: float) -> None:
        """Cancel an unpublished snapshot and wait (bounded) for the thread to end."""
        self._cancel.set()
        t = self._thread
        if t is not None:
            t.join(timeout=timeout)
