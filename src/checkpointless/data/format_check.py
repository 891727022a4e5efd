"""Reading and checking a token file (data/format.py): its header, then its bytes against the fingerprint.

Separate from the writer because every reader (TokenDataset, at each rank's start) runs these checks
and never writes. A "quick" check proves the header, index digest and chunk table belong together in
O(table) time, and a "full" check re-hashes every token chunk against the table, naming the first
bad byte range when one differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from checkpointless.data.format import (
    _DIGEST_BYTES,
    _DTYPES,
    _PREFIX,
    _READABLE_VERSIONS,
    HEADER_BYTES,
    MAGIC,
    MAX_CHUNK_BYTES,
    MAX_VOCAB,
    TokenFileHeader,
    _fingerprint,
    dtype_for_vocab,
)
from checkpointless.errors import ConfigError, DataError

__all__ = ["Verify", "read_header", "scan_max_token", "verify_token_file"]

_SCAN_BLOCK = 1 << 24  # tokens per block of the max-id scan: a bounded temporary however big the file
_FIX = "re-create it with `checkpointless data prepare`"

Verify = Literal["full", "quick"]


def _bad(path: Path, problem: str) -> DataError:
    return DataError(f"{path}: {problem}; {_FIX}")


def read_header(path: str | os.PathLike[str]) -> TokenFileHeader:
    """Parse and sanity-check the header of ``path`` against the file's real size (no hashing)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise DataError(
            f"{p}: token file not found; create it with `checkpointless data prepare INPUT -o {p}`"
        ) from None
    except OSError as e:
        raise DataError(
            f"{p}: cannot read token file ({e.strerror}); check the path and its permissions"
        ) from e
    if len(raw) < _PREFIX.size:
        raise _bad(p, f"file is truncated ({size} bytes, shorter than a header)")
    magic, length = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise _bad(p, f"not a checkpointless token file (magic {magic!r}, expected {MAGIC!r})")
    if len(raw) < HEADER_BYTES:
        raise _bad(p, f"file is truncated ({size} bytes, shorter than the {HEADER_BYTES}-byte header)")
    if length > HEADER_BYTES - _PREFIX.size:
        raise _bad(p, f"header length {length} is larger than the header page")
    try:
        fields = json.loads(raw[_PREFIX.size : _PREFIX.size + length])
    except (ValueError, RecursionError) as e:  # RecursionError: a deeply nested, garbled header
        raise _bad(p, f"header is not valid JSON ({type(e).__name__})") from None
    header = TokenFileHeader(**_checked_fields(p, fields))
    if header.dtype != dtype_for_vocab(header.vocab_size):
        raise _bad(p, f"token dtype {header.dtype} does not match vocab_size {header.vocab_size}")
    if header.eos_id is not None and not 0 <= header.eos_id < header.vocab_size:
        raise _bad(p, f"eos_id {header.eos_id} is outside the vocabulary [0, {header.vocab_size})")
    if header.max_token_id is not None and header.max_token_id >= header.vocab_size:
        raise _bad(
            p,
            f"max_token_id {header.max_token_id} is not below vocab_size {header.vocab_size}: the file "
            "holds ids the model cannot embed (was it prepared with another tokenizer?)",
        )
    if header.format_version >= 2 and (header.max_token_id is None) != (header.num_tokens == 0):
        raise _bad(p, f"max_token_id {header.max_token_id} contradicts num_tokens {header.num_tokens}")
    expected = TokenFileHeader.layout(header.num_tokens, header.num_docs, header.dtype, header.chunk_bytes)
    actual = (header.tokens_offset, header.index_offset, header.chunks_offset, header.file_size)
    if actual != expected:
        raise _bad(p, f"header offsets {actual} do not match its sizes (expected {expected})")
    if size != header.file_size:
        what = "truncated" if size < header.file_size else "longer than its header says"
        raise _bad(p, f"file is {what}: {size} bytes on disk, {header.file_size} expected")
    return header


_INT_FIELDS = (
    "vocab_size",
    "num_tokens",
    "num_docs",
    "chunk_bytes",
    "tokens_offset",
    "index_offset",
    "chunks_offset",
    "file_size",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true would pass as 1


def _checked_fields(p: Path, fields: object) -> dict[str, Any]:
    """The header's fields, each of the right type and range, or a DataError naming the first bad one.

    Every check here runs before any size from the header is used, so a garbled header can never
    make a reader allocate or map what it claims.
    """
    if not isinstance(fields, dict):
        raise _bad(p, f"header is a JSON {type(fields).__name__}, not an object")
    version = fields.get("format_version")
    if not _is_int(version) or version not in _READABLE_VERSIONS:  # first: other versions, other fields
        raise _bad(
            p, f"format version {version!r} is not supported (expected one of {list(_READABLE_VERSIONS)})"
        )
    known = {f.name for f in dataclasses.fields(TokenFileHeader)}
    if version == 1:
        known.discard("max_token_id")
    required = known - {"max_token_id"} if version == 1 else known
    for name in sorted(set(fields) - known):
        raise _bad(p, f"header has an unknown field {name!r}")
    for name in sorted(required - set(fields)):
        raise _bad(p, f"header lacks the field {name!r}")
    for name in _INT_FIELDS:
        if not _is_int(fields[name]):
            raise _bad(p, f"header field {name} is {fields[name]!r}, not an integer")
        if fields[name] < 0:
            raise _bad(p, f"header field {name} is {fields[name]}, a negative count")
    for name in ("eos_id", "max_token_id"):
        value = fields.get(name)
        if value is not None and (not _is_int(value) or value < 0):
            raise _bad(p, f"header field {name} is {value!r}, not a token id (an integer >= 0, or null)")
    for name in ("dtype", "tokenizer", "index_sha256", "fingerprint"):
        if not isinstance(fields[name], str):
            raise _bad(p, f"header field {name} is {fields[name]!r}, not a string")
    for name in ("index_sha256", "fingerprint"):
        if len(fields[name]) != 64 or not all(c in "0123456789abcdef" for c in fields[name]):
            raise _bad(p, f"header field {name} is {fields[name][:80]!r}, not a sha256 hex digest")
    if fields["dtype"] not in _DTYPES:
        raise _bad(p, f"token dtype {fields['dtype']!r} is not supported (expected one of {sorted(_DTYPES)})")
    if not 1 <= fields["vocab_size"] <= MAX_VOCAB:
        raise _bad(p, f"vocab_size {fields['vocab_size']} is out of range (1 to {MAX_VOCAB:,})")
    chunk = fields["chunk_bytes"]
    if not 64 <= chunk <= MAX_CHUNK_BYTES or chunk % 8:
        raise _bad(p, f"chunk_bytes {chunk} is not a multiple of 8 from 64 to {MAX_CHUNK_BYTES}")
    return fields


def scan_max_token(path: str | os.PathLike[str], header: TokenFileHeader) -> tuple[int, int]:
    """(largest token id, position of its first occurrence) over the mapped tokens; (-1, -1) when empty.

    One vectorised pass in bounded blocks: the mapping is read straight from the page cache, so this
    costs a memory scan, not a hash (see docs/data.md for the measured rate).
    """
    if not header.num_tokens:
        return -1, -1
    tokens = np.memmap(
        path, dtype=header.np_dtype, mode="r", offset=header.tokens_offset, shape=(header.num_tokens,)
    )
    best, where = -1, -1
    try:
        for start in range(0, header.num_tokens, _SCAN_BLOCK):
            block = tokens[start : start + _SCAN_BLOCK]
            top = int(block.max())
            if top > best:
                best, where = top, start + int(np.argmax(block == top))
    finally:
        del tokens  # drop the mapping now, not at the next garbage collection
    return best, where


def verify_token_file(path: str | os.PathLike[str], header: TokenFileHeader, verify: Verify = "full") -> None:
    """Check the fingerprint and that every token id is below ``vocab_size``.

    "quick" checks the chunk table's fingerprint and scans the tokens for their largest id (one
    vectorised pass, no hashing): an id beyond the vocabulary, or a largest id other than the one
    the header records, means the token bytes changed. "full" re-hashes the index and every token
    chunk instead, which catches any change; it scans for the largest id only in a version 1 file,
    whose header does not record it.
    """
    p = Path(path)
    if verify not in ("full", "quick"):
        raise ConfigError(f"verify must be 'full' or 'quick', got {verify!r}")
    with open(p, "rb") as f:
        f.seek(header.chunks_offset)
        table = f.read(_DIGEST_BYTES * header.num_chunks)
        if _fingerprint(header, table) != header.fingerprint:
            raise _bad(p, "fingerprint mismatch: the header or chunk table was modified")
        if verify == "full":
            _verify_hashes(p, f, header, table)
    if verify == "full" and header.max_token_id is not None:
        return  # the hashes prove the tokens are the ones whose largest id the writer recorded
    top, where = scan_max_token(p, header)
    if top >= header.vocab_size:
        raise _bad(
            p,
            f"token {where} has id {top}, beyond the vocabulary [0, {header.vocab_size}): the token bytes "
            "are corrupt or were written for another tokenizer",
        )
    if header.max_token_id is not None and top != header.max_token_id:
        raise _bad(
            p,
            f"the largest token id is {top} (token {where}) but the header records {header.max_token_id}: "
            "the token bytes were modified",
        )


def _verify_hashes(p: Path, f: BinaryIO, header: TokenFileHeader, table: bytes) -> None:
    f.seek(header.index_offset)
    if hashlib.sha256(f.read(8 * (header.num_docs + 1))).hexdigest() != header.index_sha256:
        raise _bad(p, "fingerprint mismatch: the document index was modified")
    token_bytes = header.num_tokens * header.np_dtype.itemsize
    f.seek(header.tokens_offset)
    for i in range(header.num_chunks):
        start = i * header.chunk_bytes
        data = f.read(min(header.chunk_bytes, token_bytes - start))
        if hashlib.sha256(data).digest() != table[i * _DIGEST_BYTES : (i + 1) * _DIGEST_BYTES]:
            raise _bad(p, f"fingerprint mismatch: token bytes {start}..{start + len(data)} were modified")
