"""Rank 0's durable checkpoints, saved off the training thread (DCP's ``async_save``).

How it stays off the training thread, yet consistent: when a due step begins, the state is
collected and every tensor that is *not* a parameter or optimizer state is cloned at once (they
are small, and a forward pass may change buffers). The rest is staged to CPU memory by DCP's own
``DefaultStager`` on its staging thread while forward and backward run; the job's optimizer
pre-hook waits for that staging (:meth:`CheckpointWriter.wait_staged`) before any update starts.
DCP's upload thread then writes the files. The stager is kept for the writer's life, so its CPU
copies are reused from one checkpoint to the next instead of allocated again. (Not yet for GPU
state: ``codec.layout`` copies a device tensor to the host on the training thread; handing DCP
the device tensors themselves would move that copy to the staging thread. Untested on a GPU.)
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from checkpointless.events import get_logger
from checkpointless.state.checkpoint_dir import (
    KEEP,
    CheckpointEvery,
    checkpoint_path,
    private_dir,
    remove_partial,
)
from checkpointless.state.checkpoint_format import CheckpointInfo, checkpoint_error, dcp, flat_items, publish

__all__ = ["CheckpointWriter"]

log = get_logger()

_LOCAL_GROUP: Any = None


def _local_cpu_group() -> Any:
    """A process group of this process alone, with a CPU backend, for DCP's async save.

    ``async_save`` asserts that its group (by default torch's default group) has a CPU backend
    before it looks at ``no_dist``. The job's default group is a resilient group whose
    collectives are ours (recovery/default_group.py) and shows no c10d backend; rank 0 saves
    alone (``no_dist=True``), so a gloo group of this rank alone, which no collective ever uses,
    satisfies the check without touching the job's communicators. ``use_local_synchronization``
    makes it a local call: no other rank takes part."""
    global _LOCAL_GROUP
    import torch.distributed as dist

    if not dist.is_initialized():
        return None  # no default group: async_save makes no such check
    if _LOCAL_GROUP is None:
        from checkpointless.comm.script_groups import made_by_torch

        with made_by_torch():  # a real gloo group, not one of the job's (comm/script_groups.py)
            _LOCAL_GROUP = dist.new_group(
                ranks=[dist.get_rank()], backend="gloo", use_local_synchronization=True
            )
    return _LOCAL_GROUP


class CheckpointWriter:
    """Rank 0's asynchronous DCP saves: at most one in flight; a due save while one is still
    being written is skipped, so training never queues behind the disk.

    ``aligned``: one of the per-rank writers of a sharded job, whose checkpoints are of use only
    where every rank has one of the same step. A time interval then counts on the wall clock,
    which the ranks' hosts share to within milliseconds and the ranks reach each step together:
    every rank's save falls due at the same step (unless an interval ends within the few
    milliseconds between their commits). Counted from each writer's own start, as rank 0's is,
    the ranks' saves would drift apart by their start-up offsets."""

    def __init__(self, directory: Path, every: CheckpointEvery, aligned: bool = False) -> None:
        self.directory = directory
        self.every = every
        self._interval: int | None = None  # aligned time-based saves: the wall-clock interval
        if aligned and every.seconds:
            self._interval = int(time.time() // every.seconds)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
        self._staging: Future[None] | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._cancel = threading.Event()
        self._published: CheckpointInfo | None = None
        self._last_start = time.monotonic()
        self._logged = False
        self.skipped = 0

    def due(self, step: int, now: float, wall: float | None = None) -> bool:
        """Whether step ``step`` should be saved; ``now`` is ``time.monotonic()``, ``wall``
        ``time.time()`` (read here when not given). Called once per committed step."""
        if step <= 0 or self.every.off:
            return False
        if self.every.steps:
            return step % self.every.steps == 0
        if self._interval is not None:
            interval = int((time.time() if wall is None else wall) // self.every.seconds)
            if interval == self._interval:
                return False
            self._interval = interval
            return True
        return now - self._last_start >= self.every.seconds

    def start(self, step: int, state: Any, guarded: set[int]) -> bool:
        """Begin the checkpoint of ``state`` (taken as step ``step`` begins). Clones what is not
        guarded now; DCP stages the rest on its thread. False if not started."""
        if not self._idle.is_set():
            self.skipped += 1
            return False
        if checkpoint_path(self.directory, step).exists():
            return False  # a replay of steps already covered (after a restore)
        t0 = time.monotonic()
        self._last_start = t0
        private_dir(self.directory)
        remove_partial(self.directory)  # a killed writer's leftovers (one writer per job at a time)
        flat, nbytes = flat_items(state)
        for k, t in flat.items():
            if t.data_ptr() not in guarded:
                flat[k] = t.clone()  # buffers, RNG, step counters: small, and not ours to wait for
        self._idle.clear()
        self._cancel.clear()
        try:
            resp = dcp().async_save(
                flat,
                checkpoint_id=self.directory / f"step-{step}.tmp",
                async_stager=self._stager,
                no_dist=True,
                process_group=_local_cpu_group(),
            )
        except BaseException:
            self._idle.set()
            raise
        if isinstance(resp, Future):  # synchronous staging (not what we ask for): already staged
            staging: Future[None] = Future()
            staging.set_result(None)
            upload: Future[Any] = resp
        else:
            staging, upload = resp.staging_completion, resp.upload_completion
        stage_s: list[float] = []
        staging.add_done_callback(lambda _: stage_s.append(time.monotonic() - t0))
        self._staging = staging
        upload.add_done_callback(lambda f: self._finish(f, step, nbytes, t0, stage_s))
        return True

    def _finish(self, upload: Future[Any], step: int, nbytes: int, t0: float, stage_s: list[float]) -> None:
        # runs on DCP's upload thread once the files are written (or the save failed)
        tmp = self.directory / f"step-{step}.tmp"
        try:
            upload.result()
            if self._cancel.is_set():
                shutil.rmtree(tmp, ignore_errors=True)
                return
            final = publish(self.directory, step)
            info = CheckpointInfo(step, final, nbytes, stage_s[0] if stage_s else 0.0, time.monotonic() - t0)
            self._published = info
            if not self._logged:
                self._logged = True
                log.info(
                    "checkpoint of step %d in %s: %.1f MB, newest %d kept; staged in %.3f s, total %.3f s",
                    step,
                    final,
                    nbytes / 1e6,
                    KEEP,
                    info.stage_s,
                    info.total_s,
                )
        except (Exception, checkpoint_error()) as e:  # a failed save must not fail training
            log.warning("checkpoint of step %d failed: %s", step, e)
            shutil.rmtree(tmp, ignore_errors=True)
        finally:
            self._idle.set()

    def wait_staged(self, timeout: float) -> float:
        """Block until DCP has staged the live tensors; return the seconds waited. Past the
        deadline the checkpoint is cancelled (it would not be consistent) and training goes on."""
        staging = self._staging
        if staging is None or staging.done():
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + timeout
        while not staging.done():
            try:
                staging.result(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    self._cancel.set()
                    log.warning(
                        "checkpoint staging took over %.0f s; cancelled it, the older ones stay", timeout
                    )
                    break
            except (Exception, checkpoint_error()):
                break  # the save failed; _finish logs it
        return time.monotonic() - t0

    def take_published(self) -> CheckpointInfo | None:
        info, self._published = self._published, None
        return info

    def wait_idle(self, timeout: float) -> bool:
        """Wait (bounded) for the save in flight to be published; True if none is left."""
        return self._idle.wait(timeout=timeout)

    def close(self, timeout: float) -> None:
        """Let the save in flight finish (bounded), then release the stager's CPU copies."""
        if self.wait_idle(timeout):
            self._stager.close()
