"""A durable checkpoint's files: the flat dict DCP writes for a state, and its publication.

DCP writes a flat dict: ``manifest`` (the codec's JSON manifest as a uint8 tensor) and
``message/<i>`` (each tensor of 64 KiB or more, typed; the small ones packed into uint8
messages); ``state/durable.py`` says why. DCP writes it into ``step-<N>.tmp``, and
:func:`publish` renames that to ``step-<N>`` only once DCP's metadata file (its own mark of a
complete checkpoint) is there. DCP itself is imported on first use (:func:`dcp`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpointless.errors import StateTransferError
from checkpointless.state.checkpoint_dir import checkpoint_path, prune
from checkpointless.state.codec import _dtype, layout

__all__ = ["CheckpointInfo", "checkpoint_error", "dcp", "flat_items", "preload", "publish"]

_SOLO_MIN = 64 << 10
# DCP warns on every single-process save that it assumes one process: that is exactly our intent
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def dcp() -> Any:
    """``torch.distributed.checkpoint``."""
    # imported on first use: it adds about half a second to a worker's start-up, and most jobs
    # never save a checkpoint (the fork server's template imports torch, not this)
    import torch.distributed.checkpoint as module

    return module


def checkpoint_error() -> type[BaseException]:
    """DCP's own error (a BaseException, so an ``except Exception`` does not catch it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    exc: type[BaseException] = CheckpointException
    return exc


def preload() -> None:
    """Import DCP now (a rank that may save or load a checkpoint calls this before training), so
    the import's half second lands neither on a training step nor inside a recovery."""
    dcp()


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


def flat_items(state: Any) -> tuple[dict[str, torch.Tensor], int]:
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


def publish(directory: Path, step: int) -> Path:
    """Rename the checkpoint DCP wrote in ``step-<step>.tmp`` to its final name, durably, and
    prune the older ones; returns its path."""
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
