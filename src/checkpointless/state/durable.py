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

How it stays off the training thread, yet consistent: see ``state/checkpoint_writer.py``
(:class:`CheckpointWriter`, rank 0's asynchronous saves); the flat dict DCP writes and the
publication of a written checkpoint are ``state/checkpoint_format.py``. This module is the
synchronous save, the load and the restore, and what callers import.

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
import time
from pathlib import Path
from typing import Any

import torch

from checkpointless.errors import StateTransferError
from checkpointless.state.checkpoint_dir import (
    KEEP,
    CheckpointEvery,
    checkpoint_path,
    list_checkpoints,
    newest_checkpoint,
    parse_every,
    private_dir,
    remove_partial,
)
from checkpointless.state.checkpoint_format import (
    CheckpointInfo,
    checkpoint_error,
    dcp,
    flat_items,
    preload,
    publish,
)
from checkpointless.state.checkpoint_writer import CheckpointWriter
from checkpointless.state.codec import _dtype, receive_buffers, unpack
from checkpointless.state.manifest import parse_manifest
from checkpointless.state.snapshot import Stateful, restore_from

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


def save_checkpoint(directory: Path, step: int, state: Any) -> CheckpointInfo:
    """Save ``state`` as the checkpoint of ``step`` on this thread (tools and tests; training
    uses :class:`CheckpointWriter`)."""
    t0 = time.monotonic()
    private_dir(directory)
    remove_partial(directory)
    flat, nbytes = flat_items(state)
    dcp().save(flat, checkpoint_id=directory / f"step-{step}.tmp", no_dist=True)
    final = publish(directory, step)
    return CheckpointInfo(step, final, nbytes, 0.0, time.monotonic() - t0)


def load_checkpoint(directory: Path, step: int, into: Any = None) -> tuple[Any, dict[str, Any]]:
    """Read the checkpoint of ``step``; return (state tree, stats). Tensors land in ``into``'s
    tensors of the same path, dtype and shape (the caller's live state) where it has them. An
    unreadable checkpoint is refused with :class:`StateTransferError` and renamed aside, so the
    next recovery round plans with the older one."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    api = dcp()
    path = checkpoint_path(directory, step)
    t0 = time.monotonic()
    try:
        reader = api.FileSystemReader(path)
        md = reader.read_metadata().state_dict_metadata
        head = md["manifest"]
        if not isinstance(head, TensorStorageMetadata):
            raise StateTransferError(f"checkpoint {path} has no manifest tensor")
        raw = {"manifest": torch.empty(tuple(head.size), dtype=torch.uint8)}
        api.load(raw, storage_reader=api.FileSystemReader(path), no_dist=True)
        manifest = parse_manifest(raw["manifest"].numpy().tobytes())
        buffers, in_place = receive_buffers(manifest, into)
        flat: dict[str, torch.Tensor] = {f"message/{i}": b for i, b in enumerate(buffers)}
        for meta in manifest["tensors"]:
            if meta["solo"]:  # saved typed: load through a typed view of the same memory
                i = int(meta["msg"])
                shape = [int(s) for s in meta["shape"]]
                flat[f"message/{i}"] = buffers[i].view(_dtype(meta["dtype"])).reshape(shape)
        api.load(flat, storage_reader=api.FileSystemReader(path), no_dist=True)
        state = unpack(manifest, buffers)
    except FileNotFoundError:
        raise StateTransferError(f"checkpoint of step {step} ({path}) is gone") from None
    except (Exception, checkpoint_error()) as e:  # DCP's own error is a BaseException
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
