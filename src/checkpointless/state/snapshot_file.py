"""The snapshot file: how a layout is written, published and read back, verified.

Separate from the writer (``shm_snapshot.py``, which decides when a snapshot is taken and runs it
off the training thread) because the format and its guarantees hold for any caller: recovery
loads with :func:`load_snapshot` alone, and benchmarks and tests write with :func:`write_snapshot`.

What is in a snapshot: exactly what a peer would send (``snapshot.collect_state``: every tracked
object's state, the RNG states as the step began, the step), laid out by ``codec.layout`` and
checked with the same XXH3-128 digests as the peer transfer.

File format (one file per snapshot, ``snap-<step>.ckpl``)::

    magic "CKPLSNP1" | u64 header length | 16-byte XXH3-128 of the header (the seal)
    header JSON: step, manifest length, each message's offset and size, the digests
    manifest JSON (codec's manifest, digest 0)
    the messages, each 64-byte aligned from a 4096-byte aligned start (digests 1..n)

Why it cannot be torn: a snapshot is written under a hidden ``.writing-<pid>`` name and only
renamed to its final name once every byte and digest is in place; rename is atomic, and a
published file is never written again. A writer killed at any point leaves at most a hidden
file that the next writer removes, and the newest published snapshot is untouched. At most two
snapshots exist at once (the newest published one, and the one being written, which replaces the
older published one only by being published): memory is bounded by two times the state's size.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from checkpointless.errors import StateTransferError
from checkpointless.state.codec import Layout, digest, mismatch, receive_buffers, unpack
from checkpointless.state.device_copy import copy_out
from checkpointless.state.shm_dir import list_snapshots, private_dir, snapshot_path

__all__ = ["SnapshotInfo", "load_snapshot", "write_snapshot"]

_MAGIC = b"CKPLSNP1"
_PREFIX = struct.Struct("<8sQ16s")  # magic, header length, XXH3-128 of the header
_ALIGN = 64
_DATA_ALIGN = 4096
_WRITING = ".writing-"


@dataclass(frozen=True)
class SnapshotInfo:
    """One published snapshot, as reported in a commit event and the log."""

    step: int
    path: Path
    nbytes: int  # the file's size: what one slot costs in shared memory
    copy_s: float  # the part the optimizer may have to wait for
    total_s: float  # copy, hashing and publishing

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "bytes": self.nbytes,
            "bound_bytes": 2 * self.nbytes,
            "copy_s": round(self.copy_s, 4),
            "total_s": round(self.total_s, 4),
        }


def _plan_file(lay: Layout) -> tuple[bytes, list[int], int]:
    """The manifest's bytes, each message's offset in the file, and the data start."""
    manifest = lay.manifest_bytes()
    sizes = [int(m.numel()) for m in lay.messages]
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += -(-n // _ALIGN) * _ALIGN
    return manifest, offsets, pos


def _header(step: int, manifest: bytes, offsets: list[int], sizes: list[int], digests: list[str]) -> bytes:
    return json.dumps(
        {
            "step": step,
            "manifest_bytes": len(manifest),
            "offsets": offsets,
            "sizes": sizes,
            "digests": digests,
        },
        separators=(",", ":"),
    ).encode()


def _data_start(head_len: int, manifest_len: int) -> int:
    return -(-(_PREFIX.size + head_len + manifest_len) // _DATA_ALIGN) * _DATA_ALIGN


def write_snapshot(
    directory: Path,
    step: int,
    lay: Layout,
    copied: threading.Event | None = None,
    cancel: threading.Event | None = None,
) -> SnapshotInfo | None:
    """Write ``lay`` as the snapshot of ``step``, then publish it. Sets ``copied`` as soon as every
    message has been copied out of the live tensors (the rest reads only the file). Returns None
    if ``cancel`` was set before it was published (the half-written file is removed)."""
    t0 = time.monotonic()
    private_dir(directory)
    tmp = directory / f"{_WRITING}{os.getpid()}"
    _prune(directory, tmp)
    manifest, offsets, data_len = _plan_file(lay)
    sizes = [int(m.numel()) for m in lay.messages]
    placeholder = ["0" * 32] * (len(sizes) + 1)  # digests are fixed-length hex: same header size
    head_len = len(_header(step, manifest, offsets, sizes, placeholder))
    data_start = _data_start(head_len, len(manifest))
    total = data_start + data_len
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
    published = False
    try:
        os.ftruncate(fd, max(total, 1))
        # reserve the pages now: a full /dev/shm is then an OSError here (the snapshot fails,
        # training goes on), not a SIGBUS that kills the rank when the copy touches a page
        os.posix_fallocate(fd, 0, max(total, 1))
        # populate: one call maps every page, instead of a page fault per 4 KiB during the copy
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(fd, max(total, 1), flags=flags) as mm:
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            copy_s = 0.0
            try:
                spans = [
                    (data_start + off, int(m.numel())) for off, m in zip(offsets, lay.messages, strict=True)
                ]
                if lay.ready is not None:  # from a GPU: beside the training stream, all at once
                    copy_out(lay.messages, [dst[a : a + n] for a, n in spans], lay.ready)
                else:
                    for (a, n), msg in zip(spans, lay.messages, strict=True):
                        if cancel is not None and cancel.is_set():
                            break
                        dst[a : a + n].copy_(msg)
                copy_s = time.monotonic() - t0
            finally:
                lay.messages.clear()  # drop our views of the live tensors before anyone waits on us
                if copied is not None:
                    copied.set()
                del dst
            if cancel is not None and cancel.is_set():
                return None
            view = memoryview(mm)
            try:
                base = _PREFIX.size + head_len
                view[base : base + len(manifest)] = manifest
                digests = [digest(manifest)]
                digests += [
                    xxhash.xxh3_128(view[data_start + o : data_start + o + n]).hexdigest()
                    for o, n in zip(offsets, sizes, strict=True)
                ]
                head = _header(step, manifest, offsets, sizes, digests)
                if len(head) != head_len:
                    raise StateTransferError("snapshot header changed size while it was written")
                view[: _PREFIX.size] = _PREFIX.pack(_MAGIC, head_len, xxhash.xxh3_128(head).digest())
                view[_PREFIX.size : base] = head
            finally:
                view.release()
        final = snapshot_path(directory, step)
        os.rename(tmp, final)  # the publication: atomic, and the file is never written again
        published = True
        return SnapshotInfo(step, final, total, copy_s, time.monotonic() - t0)
    finally:
        os.close(fd)
        if not published:
            tmp.unlink(missing_ok=True)


def _prune(directory: Path, tmp: Path) -> None:
    """Make room for one more snapshot: keep only the newest published one, remove what a killed
    writer left, and recycle the older published one as ``tmp`` (its pages are already allocated,
    so overwriting them is cheaper than filling new ones). There is one writer per directory at a
    time (rank 0, or on a sharded mesh each rank in its own; the launcher kills a rank's old process
    before a spare takes the rank), so every hidden file here is a dead writer's."""
    for name in os.listdir(directory):
        if name.startswith(_WRITING):
            (directory / name).unlink(missing_ok=True)
    steps = list_snapshots(directory)
    for s in steps[:-2]:
        snapshot_path(directory, s).unlink(missing_ok=True)
    if len(steps) >= 2:
        os.rename(snapshot_path(directory, steps[-2]), tmp)


def _verified_map(path: Path) -> tuple[mmap.mmap, dict[str, Any], dict[str, Any]]:
    """Map a snapshot file and check every byte that matters; return (map, header, manifest)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _PREFIX.size:
            raise StateTransferError(f"snapshot {path} is truncated ({size} bytes)")
        # copy-on-write: torch can view it as writable, and nothing we do reaches the file
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        magic, head_len, seal = _PREFIX.unpack_from(mm, 0)
        if magic != _MAGIC or _PREFIX.size + head_len > size:
            raise StateTransferError(f"snapshot {path} has no valid header (magic {magic!r})")
        head_bytes = mm[_PREFIX.size : _PREFIX.size + head_len]
        if xxhash.xxh3_128(head_bytes).digest() != seal:
            raise StateTransferError(f"snapshot {path}: the header's checksum does not match")
        head = json.loads(head_bytes)
        base = _PREFIX.size + head_len
        manifest_bytes = mm[base : base + int(head["manifest_bytes"])]
        start = _data_start(head_len, int(head["manifest_bytes"]))
        spans = list(zip(head["offsets"], head["sizes"], strict=True))
        if any(start + int(o) + int(n) > size for o, n in spans):
            raise StateTransferError(f"snapshot {path} is shorter than its header says ({size} bytes)")
        view = memoryview(mm)
        try:
            got = [digest(manifest_bytes)]
            got += [xxhash.xxh3_128(view[start + o : start + o + n]).hexdigest() for o, n in spans]
        finally:
            view.release()
        bad = mismatch(got, head["digests"])
        if bad is not None:
            raise StateTransferError(f"snapshot {path} is corrupt: {bad}")
        return mm, head, json.loads(manifest_bytes)
    except BaseException:
        mm.close()
        raise


def load_snapshot(directory: Path, step: int, into: Any = None) -> tuple[Any, dict[str, Any]]:
    """Read and verify the snapshot of ``step``; return (state tree, stats). Every digest is checked
    before any byte lands in ``into`` (the caller's live state, reused as the landing zone as in
    the peer transfer). A corrupt snapshot is refused with :class:`StateTransferError` and
    deleted, so the next recovery round plans with the older one."""
    path = snapshot_path(directory, step)
    t0 = time.monotonic()
    try:
        mm, head, manifest = _verified_map(path)
    except FileNotFoundError:
        raise StateTransferError(f"snapshot of step {step} ({path}) is gone") from None
    except (StateTransferError, ValueError, KeyError, TypeError) as e:
        path.unlink(missing_ok=True)
        why = str(e) if isinstance(e, StateTransferError) else f"snapshot {path} is unreadable ({e})"
        raise StateTransferError(
            f"{why}; refused and removed (an older snapshot is used if one exists)"
        ) from e
    try:
        if int(head["step"]) != step:
            raise StateTransferError(f"snapshot {path} holds step {head['step']}, not {step}")
        buffers, in_place = receive_buffers(manifest, into)
        src = torch.frombuffer(mm, dtype=torch.uint8)
        start = _data_start(int(_PREFIX.unpack_from(mm, 0)[1]), int(head["manifest_bytes"]))
        for buf, o, n in zip(buffers, head["offsets"], head["sizes"], strict=True):
            buf.copy_(src[start + o : start + o + n])
        del src
        state = unpack(manifest, buffers)
    finally:
        try:
            mm.close()
        except BufferError:  # a view is still alive somewhere: the map goes when it does
            pass
    stats = {
        "bytes": sum(int(n) for n in head["sizes"]),
        "in_place": in_place,
        "load_s": time.monotonic() - t0,
    }
    return state, stats
