"""Every rank's own global generators, kept outside its process, so a replacement resumes them.

The global generators (torch CPU and CUDA, Python's ``random``, NumPy's) are per-rank state:
a script seeded ``1337 + rank`` draws its batches from them, rank 0 alone may draw evaluation
batches from them, and ``nn.Dropout`` draws its masks from them. They are not replica state,
so a replacement must not take them from the peer that sends it the model: it must resume the
very streams of the rank it replaces, as they stood when the step it re-runs first began.

Where they are kept, and why there: each rank writes its generators into the job's private
shared-memory directory (``<job shm>/rng/rank<k>.<slot>``), outside its process, at every point
a recovery may resume from: as a step begins, as a section begins, and as a step commits (the
state after the update, for a recovery that rolls the step forward). The write is synchronous
(about 12 KB, tens of microseconds: the figures are in the module's benchmark,
``benchmarks/rank_rng.py``), so the record of a point exists before the rank can take part in
any collective after it. No peer can therefore pass that point with an older record in the
keeper, which an asynchronous send to another process could not promise without a wait per
step: a rank killed just after it began step ``s`` has step ``s``'s record kept, whatever the
timing. It is the same directory as the snapshots and same-host buddy copies: the launcher's
and the reaper's clean-up remove it, even after a SIGKILL. Each record carries its step and a
digest; two slots (by the step's parity) keep the newest two steps, since the step a recovery
settles on may be the one before the newest record (a rank that committed a step its peers
did not reach). The limit: a replacement on another host (a lost host, or spares on a spare
host) finds no record, and then resumes the generators sent with the replica's state, and says
so in a warning (not silently); on a sharded mesh a buddy copy carries its owner's own
generators, so a replacement restored from one resumes the right streams anyway.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from checkpointless.data.shm_cache import job_cache_dir
from checkpointless.state.shm_dir import private_dir
from checkpointless.state.snapshot import RngState

__all__ = ["RankRngKeeper", "RngRecord", "decode_record", "encode_record", "rank_rng_dir"]

_MAGIC = b"CLRNG001"
_DIGEST = 16  # XXH3-128 of everything before it: a torn or foreign file is never restored


@dataclass(frozen=True)
class RngRecord:
    """A rank's generators as they stood when step ``step`` (or the section before it) began."""

    step: int
    rng: RngState


def rank_rng_dir(job_id: str) -> Path:
    """The job's directory of per-rank generator records (private, in its shared memory)."""
    path = job_cache_dir(job_id) / "rng"
    private_dir(path)
    return path


def _blob(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().numpy().tobytes())


def encode_record(step: int, rng: RngState) -> bytes:
    """``rng`` (``capture_rng()``'s layout) and ``step`` as bytes: a JSON header of the scalars and
    blob lengths, the blobs (Python's state words, NumPy's keys, torch's CPU and CUDA states),
    and a digest of it all."""
    version, words, py_gauss = rng["python"]
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    words_t = words if isinstance(words, torch.Tensor) else torch.tensor(list(words), dtype=torch.int64)
    blobs = [
        _blob(words_t.to(torch.int64)),
        np.asarray(np_keys, dtype=np.uint32).tobytes(),
        _blob(rng["torch"]),
        *(_blob(t) for t in rng.get("cuda", [])),
    ]
    header = {
        "step": step,
        "python": [int(version), py_gauss],
        "numpy": [str(np_kind), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "cuda": "cuda" in rng,
        "sizes": [len(b) for b in blobs],
    }
    head = json.dumps(header).encode()
    body = b"".join([_MAGIC, struct.pack("<I", len(head)), head, *blobs])
    return body + xxhash.xxh3_128_digest(body)


def decode_record(data: bytes) -> RngRecord:
    """The record :func:`encode_record` wrote. Raises ValueError if ``data`` is not one, whole."""
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if not data.startswith(_MAGIC) or xxhash.xxh3_128_digest(body) != digest:
        raise ValueError("not a whole generator record")
    (n,) = struct.unpack_from("<I", body, len(_MAGIC))
    at = len(_MAGIC) + 4
    header = json.loads(body[at : at + n])
    at += n
    blobs: list[bytes] = []
    for size in header["sizes"]:
        blobs.append(body[at : at + size])
        at += size
    if at != len(body):
        raise ValueError("a generator record of the wrong length")
    version, py_gauss = header["python"]
    np_kind, np_pos, np_has_gauss, np_gauss = header["numpy"]
    words = torch.from_numpy(np.frombuffer(blobs[0], dtype=np.int64).copy())
    rng: RngState = {
        "python": [version, words, py_gauss],
        "numpy": [np_kind, np.frombuffer(blobs[1], dtype=np.uint32).copy(), np_pos, np_has_gauss, np_gauss],
        "torch": torch.frombuffer(bytearray(blobs[2]), dtype=torch.uint8),
    }
    if header["cuda"]:
        rng["cuda"] = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs[3:]]
    return RngRecord(int(header["step"]), rng)


class RankRngKeeper:
    """This rank's generator records: the newest two steps in memory and, under the launcher,
    in the job's shared memory, where a replacement of this rank reads them."""

    def __init__(self) -> None:
        self.directory: Path | None = None  # None: not under the launcher, memory only
        self.rank = -1
        self._slots: dict[int, RngRecord] = {}  # step % 2 -> the newest record of that parity

    def configure(self, directory: Path | None, rank: int) -> None:
        """Keep this rank's records in ``directory`` (a spare learns its rank at assignment)."""
        self.directory = directory
        self.rank = rank

    @property
    def began(self) -> bool:
        """Whether this process has recorded a point of its own (it has begun a step here)."""
        return bool(self._slots)

    def keep(self, step: int, rng: RngState) -> None:
        """Record the generators ``rng`` as they stand when step ``step`` begins (or a section
        before it, or the commit of step ``step - 1``): the newest record of a step wins."""
        record = RngRecord(step, rng)
        self._slots[step % 2] = record
        if self.directory is None:
            return
        path = self._path(step)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(encode_record(step, rng))
        os.replace(tmp, path)  # whole or not at all: a kill mid-write leaves the older record

    def load(self, step: int) -> RngState | None:
        """This rank's generators as step ``step`` began, if a record of that step is kept (in
        this process, else in shared memory by whoever held the rank before); else None."""
        mine = self._slots.get(step % 2)
        if mine is not None and mine.step == step:
            return mine.rng
        if self.directory is None:
            return None
        try:
            record = decode_record(self._path(step).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return record.rng if record.step == step else None

    def _path(self, step: int) -> Path:
        assert self.directory is not None
        return self.directory / f"rank{self.rank}.{step % 2}"
