"""Writing a token file (data/format.py): documents streamed in, hashed as they go, published by one rename.

Separate from the format's definition because only `checkpointless data prepare` and tests write
token files; training only reads them (data/format_check.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

from checkpointless.data.format import (
    _DTYPES,
    _PREFIX,
    DEFAULT_CHUNK_BYTES,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    MAX_CHUNK_BYTES,
    TokenFileHeader,
    _fingerprint,
    dtype_for_vocab,
)
from checkpointless.errors import ConfigError, DataError

__all__ = ["TokenFileWriter", "write_token_file"]


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

    def add_document(self, tokens: npt.ArrayLike, end: bool = True) -> None:
        """Append one document (a 1-D sequence of ids below vocab_size; empty documents are kept).

        ``end=False`` appends a piece of a document that the next call continues (a long text
        tokenized a piece at a time)."""
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
        if end:
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
