"""A rank's generator record as bytes (recovery/rank_rng.py keeps them): what is written to its
file in shared memory and sent to its keeper on another host at every point a recovery may
resume from, and read back by a replacement.

One record is one write: a lead (magic, the whole length, the header's length), a JSON header
of the scalars (step, section, Python's version and cached Gaussian, NumPy's kind, position and
cached Gaussian) and of the blobs' sizes, the blobs (Python's state words, NumPy's keys, torch's
CPU and CUDA states, the data positions, how a section closed), and an XXH3-128 digest of all
that, so a write cut short by a SIGKILL, or a foreign file, is refused and never restored. A
slot's file is written in place, so a record is self-delimiting: an older, longer one's tail
after it is ignored.

This is written every step, so the encoding avoids per-call costs that add up there: the
tensors are viewed as they are, and the header is spelled out rather than passed through
``json.dumps`` (the same bytes: tests/unit/recovery/test_rank_rng.py).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii

import numpy as np
import torch
import xxhash

from checkpointless.state.snapshot import RngState

__all__ = ["RngRecord", "decode_record", "encode_parts", "encode_record", "record_point"]

_MAGIC = b"CLRNG002"
_LEAD = struct.Struct("<8sII")  # magic, the record's whole length, the JSON header's length
_DIGEST = 16  # XXH3-128 of everything before it: a torn or foreign record is never restored


@dataclass(frozen=True)
class RngRecord:
    """A rank's generators as they stood at step ``step``'s boundary: as the step began (or
    committed, the step before), or as section ``section`` began before it."""

    step: int
    rng: RngState
    section: str | None = None
    # the rank's per-rank data positions as they stood there (rank_data.py's bytes), if any
    data: bytes | None = None
    # how the section of this boundary closed here (section_closing.py's bytes), if it did
    closing: bytes | None = None


def _blob(t: torch.Tensor) -> memoryview:
    # a generator's state is a plain contiguous CPU tensor: viewed as it is, without the
    # conversions' dispatcher calls or the checks' attribute reads (a record is written every
    # step); numpy() refuses a tensor on a device or that requires grad, cast() a strided one
    try:
        arr: np.ndarray = t.numpy()
        return arr.data.cast("B")
    except (RuntimeError, TypeError):
        arr = t.detach().cpu().contiguous().numpy()
        return arr.data.cast("B")


def _js(x: object) -> str:
    """``json.dumps(x)``: spelled here for the header's own types (None, int, a finite float,
    str), which is most of a record's encoding time otherwise (~5 µs of ~20)."""
    if x is None:
        return "null"
    if type(x) is int:
        return int.__repr__(x)
    if type(x) is float and math.isfinite(x):
        return float.__repr__(x)
    if type(x) is str:
        return encode_basestring_ascii(x)  # json.dumps's own escaping
    return json.dumps(x)


def encode_parts(record: RngRecord) -> list[bytes | memoryview]:
    """``record`` as the pieces of one write: a lead (magic, lengths), a JSON header of the
    scalars and blob sizes, the blobs (Python's state words, NumPy's keys, torch's CPU and CUDA
    states) and the digest of all that."""
    rng = record.rng
    version, words, py_gauss = rng["python"]
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    words_t = words if isinstance(words, torch.Tensor) else torch.tensor(list(words))
    blobs = [
        _blob(words_t if words_t.dtype == torch.int64 else words_t.to(torch.int64)),
        np.ascontiguousarray(np_keys, dtype=np.uint32).data.cast("B"),
        _blob(rng["torch"]),
        *(_blob(t) for t in rng.get("cuda", [])),
    ]
    if record.data is not None:
        blobs.append(memoryview(record.data))
    if record.closing is not None:
        blobs.append(memoryview(record.closing))
    sizes = [b.nbytes for b in blobs]
    on = ("false", "true")
    # the bytes json.dumps wrote for this dict (its key order, its separators: what is stored
    # is unchanged, tests/unit/recovery/test_rank_rng.py), without its call per step
    head = (
        f'{{"step": {_js(record.step)}, "section": {_js(record.section)}, '
        f'"python": [{_js(int(version))}, {_js(py_gauss)}], "numpy": [{_js(str(np_kind))}, '
        f'{_js(int(np_pos))}, {_js(int(np_has_gauss))}, {_js(float(np_gauss))}], "cuda": {on["cuda" in rng]}, '
        # "data": the last blob (or the one before): the data positions; "closing": the last
        # blob, how the section closed
        f'"data": {on[record.data is not None]}, "closing": {on[record.closing is not None]}, '
        f'"sizes": [{", ".join(map(str, sizes))}]}}'
    ).encode()
    total = _LEAD.size + len(head) + sum(sizes) + _DIGEST
    parts: list[bytes | memoryview] = [_LEAD.pack(_MAGIC, total, len(head)), head, *blobs]
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return [*parts, h.digest()]


def encode_record(record: RngRecord) -> bytes:
    """``record`` as one byte string (:func:`encode_parts`, joined)."""
    return b"".join(encode_parts(record))


def _checked_body(data: bytes) -> tuple[bytes, int]:
    """The record at the start of ``data`` (without its digest) and its header's length."""
    if len(data) < _LEAD.size + _DIGEST:
        raise ValueError("not a whole generator record")
    magic, total, n = _LEAD.unpack_from(data)
    if magic != _MAGIC or total > len(data) or total < _LEAD.size + n + _DIGEST:
        raise ValueError("not a whole generator record")
    body, digest = data[: total - _DIGEST], data[total - _DIGEST : total]
    if xxhash.xxh3_128_digest(body) != digest:
        raise ValueError("a generator record that fails its digest")
    return body, n


def record_point(data: bytes) -> tuple[int, str | None]:
    """The step and section of the record at the start of ``data``, checked against its digest
    but not decoded (what a keeper of another rank's records needs, per step).

    Raises:
        ValueError: ``data`` does not start with a whole record."""
    body, n = _checked_body(data)
    try:
        header = json.loads(body[_LEAD.size : _LEAD.size + n])
        step, section = header["step"], header["section"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"a generator record with a malformed header: {e}") from e
    if not isinstance(step, int) or not (section is None or isinstance(section, str)):
        raise ValueError("a generator record with a malformed header")
    return step, section


def decode_record(data: bytes) -> RngRecord:
    """The record at the start of ``data`` (a slot may hold a longer older one's tail after it).

    Raises:
        ValueError: ``data`` does not start with a whole record."""
    body, n = _checked_body(data)
    at = _LEAD.size
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
    closing = blobs.pop() if header.get("closing") else None
    positions = blobs.pop() if header.get("data") else None
    if header["cuda"]:
        rng["cuda"] = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs[3:]]
    return RngRecord(int(header["step"]), rng, header["section"], positions, closing)
