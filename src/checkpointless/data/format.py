"""The on-disk token file: one flat array of token ids plus a small self-describing header and index.

One file holds everything, so publishing it is a single atomic rename and a reader can never pair
the tokens of one preparation with the index of another. Layout (all integers little-endian)::

    0      8-byte magic ``CKPLTOK1`` | u32 length of the JSON header | JSON header | zero padding
    4096   tokens: ``num_tokens`` x dtype (uint16 or uint32), page-aligned so np.memmap maps it directly
    ...    document index: ``num_docs + 1`` x u64 token offsets (doc i is tokens[idx[i]:idx[i+1]])
    ...    chunk table: one 32-byte sha256 per ``chunk_bytes`` of the token array

The fingerprint is the sha256 of the canonical JSON header (without the fingerprint itself) followed
by the chunk table; the header in turn holds the index's sha256. A "quick" check therefore proves the
header, index digest and chunk table belong together in O(table) time, and a "full" check re-hashes
every token chunk against the table, naming the first bad byte range when one differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import numpy.typing as npt

from checkpointless.errors import ConfigError, DataError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_CHUNK_BYTES",
    "MAX_VOCAB",
    "TokenFileHeader",
    "TokenFileWriter",
    "Verify",
    "dtype_for_vocab",
    "read_header",
    "scan_max_token",
    "verify_token_file",
    "write_token_file",
]

MAGIC = b"CKPLTOK1"
# Version 2 added ``max_token_id``; version 1 files are still read (their max is scanned on open).
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
# No tokenizer in use comes near 2^24 ids; a header claiming more is corrupt, and believing it would
# make a model allocate an embedding table of that many rows.
MAX_VOCAB = 1 << 24
MAX_CHUNK_BYTES = 1 << 30  # full verification reads one chunk at a time: keep that bounded
_SCAN_BLOCK = 1 << 24  # tokens per block of the max-id scan: a bounded temporary however big the file
HEADER_BYTES = 4096
DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB: a 1 TB file still has a chunk table of only ~8 MB
_PREFIX = struct.Struct("<8sI")
_DIGEST_BYTES = 32
_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_FIX = "re-create it with `checkpointless data prepare`"

Verify = Literal["full", "quick"]


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest supported dtype that can hold every id below ``vocab_size``."""
    if vocab_size < 1:
        raise ConfigError(f"vocab_size must be at least 1, got {vocab_size}")
    if vocab_size > MAX_VOCAB:
        raise ConfigError(f"vocab_size {vocab_size} is beyond the supported maximum of {MAX_VOCAB:,} ids")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclasses.dataclass(frozen=True)
class TokenFileHeader:
    """Everything a reader needs to map and validate a token file; stored as JSON in the first page."""

    format_version: int
    dtype: str
    vocab_size: int
    num_tokens: int
    num_docs: int
    eos_id: int | None
    tokenizer: str
    chunk_bytes: int
    tokens_offset: int
    index_offset: int
    chunks_offset: int
    file_size: int
    index_sha256: str
    fingerprint: str = ""
    max_token_id: int | None = None  # the largest id in the file (None: no tokens, or a version 1 file)

    @property
    def np_dtype(self) -> np.dtype[Any]:
        return _DTYPES[self.dtype]

    @property
    def num_chunks(self) -> int:
        return -(-self.num_tokens * self.np_dtype.itemsize // self.chunk_bytes)

    def canonical_json(self) -> bytes:
        """The header without its fingerprint, in one fixed byte form, as the fingerprint hashes it."""
        fields = dataclasses.asdict(self)
        del fields["fingerprint"]
        if self.format_version == 1:  # version 1 had no max_token_id: its fingerprints hash without it
            del fields["max_token_id"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def layout(num_tokens: int, num_docs: int, dtype: str, chunk_bytes: int) -> tuple[int, int, int, int]:
        """(tokens_offset, index_offset, chunks_offset, file_size) for the given sizes."""
        token_bytes = num_tokens * _DTYPES[dtype].itemsize
        index_offset = _align(HEADER_BYTES + token_bytes, 8)
        chunks_offset = index_offset + 8 * (num_docs + 1)
        num_chunks = -(-token_bytes // chunk_bytes)
        return HEADER_BYTES, index_offset, chunks_offset, chunks_offset + _DIGEST_BYTES * num_chunks


def _fingerprint(header: TokenFileHeader, chunk_table: bytes) -> str:
    h = hashlib.sha256(header.canonical_json())
    h.update(chunk_table)
    return h.hexdigest()


def _encode_header(header: TokenFileHeader) -> bytes:
    fields = dataclasses.asdict(header)
    if header.format_version == 1:
        del fields["max_token_id"]
    body = json.dumps(fields, sort_keys=True).encode()
    raw = _PREFIX.pack(MAGIC, len(body)) + body
    if len(raw) > HEADER_BYTES:  # only a pathological tokenizer name could get here
        raise ConfigError(
            f"token file header is {len(raw)} bytes, more than {HEADER_BYTES}; shorten --tokenizer"
        )
    return raw + b"\0" * (HEADER_BYTES - len(raw))


class TokenFileWriter:
    """Streams documents into a temporary file next to ``path`` and renames it into place on commit.

    Token bytes are hashed chunk by chunk as they are written, so committing never re-reads the data.
    If the writer is closed without :meth:`commit` (an exception, a crash), the temporary file is
    removed (or, after a crash, left under a hidden ``.tmp`` name that no reader ever opens).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        vocab_size: int,
        *,
        eos_id: int | None = None,
        tokenizer: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not 64 <= chunk_bytes <= MAX_CHUNK_BYTES or chunk_bytes % 8:
            raise ConfigError(
                f"chunk_bytes must be a multiple of 8 from 64 to {MAX_CHUNK_BYTES}, got {chunk_bytes}"
            )
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise ConfigError(f"eos_id {eos_id} is outside the vocabulary [0, {vocab_size})")
        self.path = Path(path)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.eos_id = eos_id
        self.tokenizer = tokenizer
        self.chunk_bytes = chunk_bytes
        self._np_dtype = _DTYPES[self.dtype]
        self._offsets: list[int] = [0]
        self._num_tokens = 0
        self._max_id = -1
        self._chunk_hashes: list[bytes] = []
        self._chunk = hashlib.sha256()
        self._chunk_fill = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        except OSError as e:
            raise ConfigError(
                f"cannot create the token file {str(self.path)!r} ({e.strerror or e}); "
                "choose an output path in a writable directory"
            ) from None
        self._tmp = Path(tmp)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._file.write(b"\0" * HEADER_BYTES)  # real header goes in at commit, once sizes are known

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_docs(self) -> int:
        return len(self._offsets) - 1

    def _hash_tokens(self, data: memoryview) -> None:
        # Split the stream at fixed chunk boundaries regardless of how documents fall.
        pos = 0
        while pos < len(data):
            take = min(self.chunk_bytes - self._chunk_fill, len(data) - pos)
            self._chunk.update(data[pos : pos + take])
            self._chunk_fill += take
            pos += take
            if self._chunk_fill == self.chunk_bytes:
                self._chunk_hashes.append(self._chunk.digest())
                self._chunk = hashlib.sha256()
                self._chunk_fill = 0

    def add_document(self, tokens: npt.ArrayLike) -> None:
        """Append one document (a 1-D sequence of ids below vocab_size; empty documents are kept)."""
        if self._file is None:
            raise DataError(f"{self.path}: writer is already closed")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ConfigError(f"a document must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ConfigError(f"token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ConfigError(
                    f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})"
                )
            self._max_id = max(self._max_id, hi)
            data = np.ascontiguousarray(arr, dtype=self._np_dtype)
            view = data.data.cast("B")
            self._file.write(view)
            self._hash_tokens(view)
            self._num_tokens += arr.size
        self._offsets.append(self._num_tokens)

    def commit(self) -> TokenFileHeader:
        """Write index, chunk table and header, fsync, and atomically rename over ``path``."""
        if self._file is None:
            raise DataError(f"{self.path}: writer is already closed")
        try:
            header = self._finish(self._file)
            os.replace(self._tmp, self.path)
        except BaseException as e:
            # Whatever failed (a full disk, an output path that is a directory), no temporary is left.
            if self._file is not None:
                self._file.close()
                self._file = None
            self._tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise DataError(
                    f"{self.path}: cannot write the token file ({e.strerror or e}); "
                    "check that the path is a file name in a writable directory"
                ) from e
            raise
        _fsync_dir(self.path.parent)
        return header

    def _finish(self, f: BinaryIO) -> TokenFileHeader:
        if self._chunk_fill:
            self._chunk_hashes.append(self._chunk.digest())
        tokens_offset, index_offset, chunks_offset, file_size = TokenFileHeader.layout(
            self._num_tokens, self.num_docs, self.dtype, self.chunk_bytes
        )
        f.write(b"\0" * (index_offset - f.tell()))
        index = np.asarray(self._offsets, dtype="<u8").tobytes()
        f.write(index)
        table = b"".join(self._chunk_hashes)
        f.write(table)
        header = TokenFileHeader(
            format_version=FORMAT_VERSION,
            dtype=self.dtype,
            vocab_size=self.vocab_size,
            num_tokens=self._num_tokens,
            num_docs=self.num_docs,
            eos_id=self.eos_id,
            tokenizer=self.tokenizer,
            chunk_bytes=self.chunk_bytes,
            tokens_offset=tokens_offset,
            index_offset=index_offset,
            chunks_offset=chunks_offset,
            file_size=file_size,
            index_sha256=hashlib.sha256(index).hexdigest(),
            max_token_id=self._max_id if self._num_tokens else None,
        )
        header = dataclasses.replace(header, fingerprint=_fingerprint(header, table))
        f.seek(0)
        f.write(_encode_header(header))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None
        return header

    def abort(self) -> None:
        """Discard everything written so far; ``path`` is left as it was."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None and self._file is not None:
            self.commit()
        else:
            self.abort()


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk; some filesystems refuse this.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_token_file(
    path: str | os.PathLike[str],
    documents: Iterable[npt.ArrayLike],
    vocab_size: int,
    *,
    eos_id: int | None = None,
    tokenizer: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> TokenFileHeader:
    """Write ``documents`` (already tokenized, separators included) as one token file, atomically."""
    with TokenFileWriter(path, vocab_size, eos_id=eos_id, tokenizer=tokenizer, chunk_bytes=chunk_bytes) as w:
        for doc in documents:
            w.add_document(doc)
        return w.commit()


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
