"""Durable checkpoints with ``torch.distributed.checkpoint`` (DCP), saved off the training thread.

Why: peer recovery needs one living replica, and shared-memory snapshots need the host's memory to
survive. When both are gone (every rank killed with ``--snapshot-every 0``, or the host itself was
lost), the last resort is a checkpoint on disk, ideally on shared storage. It is the bottom of the
fallback chain: replica, snapshot, checkpoint, stop.

What is saved: the same state a peer would send (``snapshot.collect_state``: every tracked
object's state, the RNG states as the step began, the step). It goes through ``codec.layout``,
and DCP writes a flat dict: ``manifest`` (the codec's JSON manifest as a uint8 tensor) and
``message/<i>`` (each tensor of 64 KiB or more, typed; the small ones packed into uint8
messages). Why not hand DCP the nested state itself: DCP's unflattening rebuilds each level from
its key path and reads an integer key as a list index, so an optimizer's ``state`` dict
``{0: ...}`` would not come back as that dict. The codec's manifest keeps tuples, integer keys,
floats and NumPy RNG state exact, so the round trip is bitwise, and nothing of ours needs DCP's
pickled "bytes" items.

How it stays off the training thread, yet consistent: when a due step begins, the state is
collected and every tensor that is *not* a parameter or optimizer state is cloned at once (they
are small, and a forward pass may change buffers). The rest is staged to CPU memory by DCP's own
``DefaultStager`` on its staging thread while forward and backward run; the job's optimizer
pre-hook waits for that staging (:meth:`CheckpointWriter.wait_staged`) before any update starts.
DCP's upload thread then writes the files. The stager is kept for the writer's life, so its CPU
copies are reused from one checkpoint to the next instead of allocated again. (Not yet for GPU
state: ``codec.layout`` copies a device tensor to the host on the training thread; handing DCP
the device tensors themselves would move that copy to the staging thread. Untested on a GPU.)

Why a crash never leaves a half checkpoint that looks whole: DCP writes into ``step-<N>.tmp``;
only when its metadata file is written (DCP's own mark of a complete checkpoint) is the directory
renamed to ``step-<N>``. Old checkpoints are renamed to ``step-<N>.old`` before they are deleted,
so a kill in the middle of a deletion leaves nothing named ``step-<N>`` either. The newest two
are kept. A writer removes what a killed writer left when it starts its next save, and the
launcher does the same when the job ends; the published checkpoints are kept (durable on purpose).

Trust: DCP's metadata file is a pickle, as is every ``torch.load``-able checkpoint, so the
checkpoint directory must be writable only by the job's user (it is created 0700).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpointless.errors import StateTransferError
from checkpointless.events import get_logger
from checkpointless.state.checkpoint_dir import (
    KEEP,
    CheckpointEvery,
    checkpoint_path,
    list_checkpoints,
    newest_checkpoint,
    parse_every,
    private_dir,
    prune,
    remove_partial,
)
from checkpointless.state.codec import _dtype, layout, receive_buffers, unpack
from checkpointless.state.manifest import parse_manifest
from checkpointless.state.snapshot import (
    Stateful,
    restore_from,
)

__all__ = [
    "KEEP",
    "CheckpointEvery",
    "CheckpointInfo",
    "CheckpointWriter",
    "checkpoint_path",
    "list_checkpoints",
    "load_checkpoint",
    "newest_checkpoint",
    "parse_every",
    "preload",
    "remove_partial",
    "restore_checkpoint",
    "save_checkpoint",
]

log = get_logger()

_SOLO_MIN = 64 << 10
# DCP warns on every single-process save that it assumes one process: that is exactly our intent
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _dcp() -> Any:
    # imported on first use: it adds about half a second to a worker's start-up, and most jobs
    # never save a checkpoint (the fork server's template imports torch, not this)
    import torch.distributed.checkpoint as dcp

    return dcp


def _checkpoint_error() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    exc: type[BaseException] = CheckpointException
    return exc


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


def preload() -> None:
    """Import DCP now (a rank that may save or load a checkpoint calls this before training), so
    the import's half second lands neither on a training step nor inside a recovery."""
    _dcp()


@dataclass(frozen=True)
class CheckpointInfo:
    """One published checkpoint, as reported in rank 0's commit event and the log."""

    step: int
    path: Path
    nbytes: int  # the tensors' bytes (what the disk holds, give or take DCP's framing)
    stage_s: float  # the part the optimizer may have to wait for
    total_s: float  # staging, writing, syncing and publishing

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "bytes": self.nbytes,
            "stage_s": round(self.stage_s, 4),
            "total_s": round(self.total_s, 4),
        }


def _flat(state: Any) -> tuple[dict[str, torch.Tensor], int]:
    """The dict DCP writes, and the tensors' bytes. Tensors of 64 KiB or more are messages of
    their own (saved typed, straight from the live tensor); smaller ones are packed by the codec
    into a few uint8 messages right here: DCP pays a planning and serialisation cost per item, and
    a model's biases, norms and step counters are hundreds of items otherwise."""
    lay = layout(state, solo_min=_SOLO_MIN)
    flat: dict[str, torch.Tensor] = {
        "manifest": torch.frombuffer(bytearray(lay.manifest_bytes()), dtype=torch.uint8)
    }
    for meta in lay.manifest["tensors"]:
        if meta["solo"]:
            i = int(meta["msg"])
            shape = [int(s) for s in meta["shape"]]
            lay.messages[i] = lay.messages[i].view(_dtype(meta["dtype"])).reshape(shape)
    for i, msg in enumerate(lay.messages):
        flat[f"message/{i}"] = msg
    return flat, sum(int(m["nbytes"]) for m in lay.manifest["tensors"])


def _publish(directory: Path, step: int) -> Path:
    tmp, final = directory / f"step-{step}.tmp", checkpoint_path(directory, step)
    if not (tmp / ".metadata").is_file():
        raise StateTransferError(f"checkpoint of step {step}: DCP wrote no metadata in {tmp}")
    os.rename(tmp, final)  # atomic: a reader sees no checkpoint, or a complete one
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)
    prune(directory)
    return final


def save_checkpoint(directory: Path, step: int, state: Any) -> CheckpointInfo:
    """Save ``state`` as the checkpoint of ``step`` on this thread (tools and tests; training
    uses :class:`CheckpointWriter`)."""
    t0 = time.monotonic()
    private_dir(directory)
    remove_partial(directory)
    flat, nbytes = _flat(state)
    _dcp().save(flat, checkpoint_id=directory / f"step-{step}.tmp", no_dist=True)
    final = _publish(directory, step)
    return CheckpointInfo(step, final, nbytes, 0.0, time.monotonic() - t0)


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
        flat, nbytes = _flat(state)
        for k, t in flat.items():
            if t.data_ptr() not in guarded:
                flat[k] = t.clone()  # buffers, RNG, step counters: small, and not ours to wait for
        self._idle.clear()
        self._cancel.clear()
        try:
            resp = _dcp().async_save(
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
            final = _publish(self.directory, step)
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
        except (Exception, _checkpoint_error()) as e:  # a failed save must not fail training
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
            except (Exception, _checkpoint_error()):
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


def load_checkpoint(directory: Path, step: int, into: Any = None) -> tuple[Any, dict[str, Any]]:
    """Read the checkpoint of ``step``; return (state tree, stats). Tensors land in ``into``'s
    tensors of the same path, dtype and shape (the caller's live state) where it has them. An
    unreadable checkpoint is refused with :class:`StateTransferError` and renamed aside, so the
    next recovery round plans with the older one."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp = _dcp()
    path = checkpoint_path(directory, step)
    t0 = time.monotonic()
    try:
        reader = dcp.FileSystemReader(path)
        md = reader.read_metadata().state_dict_metadata
        head = md["manifest"]
        if not isinstance(head, TensorStorageMetadata):
            raise StateTransferError(f"checkpoint {path} has no manifest tensor")
        raw = {"manifest": torch.empty(tuple(head.size), dtype=torch.uint8)}
        dcp.load(raw, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        manifest = parse_manifest(raw["manifest"].numpy().tobytes())
        buffers, in_place = receive_buffers(manifest, into)
        flat: dict[str, torch.Tensor] = {f"message/{i}": b for i, b in enumerate(buffers)}
        for meta in manifest["tensors"]:
            if meta["solo"]:  # saved typed: load through a typed view of the same memory
                i = int(meta["msg"])
                shape = [int(s) for s in meta["shape"]]
                flat[f"message/{i}"] = buffers[i].view(_dtype(meta["dtype"])).reshape(shape)
        dcp.load(flat, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        state = unpack(manifest, buffers)
    except FileNotFoundError:
        raise StateTransferError(f"checkpoint of step {step} ({path}) is gone") from None
    except (Exception, _checkpoint_error()) as e:  # DCP's own error is a BaseException
        aside = directory / f"step-{step}.bad-{os.getpid()}"
        try:
            os.rename(path, aside)
        except OSError:
            aside = path  # another rank moved it first, or the storage refuses: leave it
        raise StateTransferError(
            f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); moved to {aside.name} "
            "(an older checkpoint is used if one exists)"
        ) from e
    stats = {
        "bytes": sum(int(m["nbytes"]) for m in manifest["tensors"]),
        "in_place": in_place,
        "load_s": time.monotonic() - t0,
    }
    return state, stats


def restore_checkpoint(objects: dict[str, Stateful], directory: Path, step: int) -> dict[str, Any]:
    """Load the checkpoint of ``step`` into ``objects`` and the RNGs; return its stats."""
    return restore_from(objects, step, lambda own: load_checkpoint(directory, step, own), "checkpoint")
