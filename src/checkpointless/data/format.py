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
    "TokenFileHeader",
    "TokenFileWriter",
    "Verify",
    "dtype_for_vocab",
    "read_header",
    "verify_token_file",
    "write_token_file",
]

MAGIC = b"CKPLTOK1"
FORMAT_VERSION = 1
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
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ConfigError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


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
    body = json.dumps(dataclasses.asdict(header), sort_keys=True).encode()
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
        if chunk_bytes < 64 or chunk_bytes % 8:
            raise ConfigError(f"chunk_bytes must be a multiple of 8 and at least 64, got {chunk_bytes}")
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
        self._chunk_hashes: list[bytes] = []
        self._chunk = hashlib.sha256()
        self._chunk_fill = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
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
            data = np.ascontiguousarray(arr, dtype=self._np_dtype)
            view = data.data.cast("B")
            self._file.write(view)
            self._hash_tokens(view)
            self._num_tokens += arr.size
        self._offsets.append(self._num_tokens)

    def commit(self) -> TokenFileHeader:
        """Write index, chunk table and header, fsync, and atomically rename over ``path``."""
        f = self._file
        if f is None:
            raise DataError(f"{self.path}: writer is already closed")
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
        )
        header = dataclasses.replace(header, fingerprint=_fingerprint(header, table))
        f.seek(0)
        f.write(_encode_header(header))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None
        os.replace(self._tmp, self.path)
        _fsync_dir(self.path.parent)
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
        version = fields.get("format_version") if isinstance(fields, dict) else None
        if version != FORMAT_VERSION:  # checked first: another version may have other fields
            raise _bad(p, f"format version {version} is not supported (expected {FORMAT_VERSION})")
        header = TokenFileHeader(**fields)
    except (ValueError, TypeError) as e:
        raise _bad(p, f"header is not valid ({e})") from None
    if header.dtype not in _DTYPES:
        raise _bad(p, f"token dtype {header.dtype!r} is not supported (expected one of {sorted(_DTYPES)})")
    if not 1 <= header.vocab_size <= 1 << 32:
        raise _bad(p, f"vocab_size {header.vocab_size} is out of range")
    if header.dtype != dtype_for_vocab(header.vocab_size):
        raise _bad(p, f"token dtype {header.dtype} does not match vocab_size {header.vocab_size}")
    if header.num_tokens < 0 or header.num_docs < 0 or header.chunk_bytes < 64:
        raise _bad(p, "header holds negative counts or a bad chunk size")
    expected = TokenFileHeader.layout(header.num_tokens, header.num_docs, header.dtype, header.chunk_bytes)
    actual = (header.tokens_offset, header.index_offset, header.chunks_offset, header.file_size)
    if actual != expected:
        raise _bad(p, f"header offsets {actual} do not match its sizes (expected {expected})")
    if size != header.file_size:
        what = "truncated" if size < header.file_size else "longer than its header says"
        raise _bad(p, f"file is {what}: {size} bytes on disk, {header.file_size} expected")
    return header


def verify_token_file(path: str | os.PathLike[str], header: TokenFileHeader, verify: Verify = "full") -> None:
    """Check the fingerprint; "full" also re-hashes the index and every token chunk."""
    p = Path(path)
    if verify not in ("full", "quick"):
        raise ConfigError(f"verify must be 'full' or 'quick', got {verify!r}")
    with open(p, "rb") as f:
        f.seek(header.chunks_offset)
        table = f.read(_DIGEST_BYTES * header.num_chunks)
        if _fingerprint(header, table) != header.fingerprint:
            raise _bad(p, "fingerprint mismatch: the header or chunk table was modified")
        if verify == "quick":
            return
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
