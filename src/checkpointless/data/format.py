"""The on-disk token file: one flat array of token ids plus a small self-describing header and index.

One file holds everything, so publishing it is a single atomic rename and a reader can never pair
the tokens of one preparation with the index of another. Layout (all integers little-endian)::

    0      8-byte magic ``CKPLTOK1`` | u32 length of the JSON header | JSON header | zero padding
    4096   tokens: ``num_tokens`` x dtype (uint16 or uint32), page-aligned so np.memmap maps it directly
    ...    document index: ``num_docs + 1`` x u64 token offsets (doc i is tokens[idx[i]:idx[i+1]])
    ...    chunk table: one 32-byte sha256 per ``chunk_bytes`` of the token array

The fingerprint is the sha256 of the canonical JSON header (without the fingerprint itself) followed
by the chunk table; the header in turn holds the index's sha256.

This module is the format itself (its constants, the header and the layout it implies, the
fingerprint), which both sides share: writing a file is data/format_writer.py, reading and checking
one is data/format_check.py, so that neither needs the other's code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import Any

import numpy as np

from checkpointless.errors import ConfigError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_CHUNK_BYTES",
    "MAX_VOCAB",
    "TokenFileHeader",
    "dtype_for_vocab",
]

MAGIC = b"CKPLTOK1"
# Version 2 added ``max_token_id``; version 1 files are still read (their max is scanned on open).
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
# No tokenizer in use comes near 2^24 ids; a header claiming more is corrupt, and believing it would
# make a model allocate an embedding table of that many rows.
MAX_VOCAB = 1 << 24
MAX_CHUNK_BYTES = 1 << 30  # full verification reads one chunk at a time: keep that bounded
HEADER_BYTES = 4096
DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB: a 1 TB file still has a chunk table of only ~8 MB
_PREFIX = struct.Struct("<8sI")
_DIGEST_BYTES = 32
_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


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
