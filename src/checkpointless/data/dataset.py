"""A read-only, memory-mapped view of a token file.

Every rank on a node maps the same file, so the kernel keeps one copy of it in the page cache
however many ranks read it, and nothing is copied until a batch is assembled. Samples are
non-overlapping windows of ``seq_len`` tokens over the concatenated documents plus one extra token
for the shifted targets: sample ``i`` covers tokens ``[i*seq_len, (i+1)*seq_len]`` inclusive.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from checkpointless.data.format import TokenFileHeader
from checkpointless.data.format_check import Verify, read_header, verify_token_file
from checkpointless.errors import ConfigError, DataError

__all__ = ["TokenDataset"]


class TokenDataset:
    """Tokens and document index of one token file, mapped without copying."""

    def __init__(self, path: Path, header: TokenFileHeader) -> None:
        self.path = path
        self.header = header

    # The maps are made on first use: a replacement whose first batch comes from the shared-memory
    # cache needs only the header's fingerprint, and two np.memmap objects cost it more than the
    # batch itself.
    @functools.cached_property
    def tokens(self) -> npt.NDArray[Any]:
        header = self.header
        # Mapping an empty range is an error in mmap, so an empty token file gets a plain empty array.
        if not header.num_tokens:
            return np.zeros(0, dtype=header.np_dtype)
        return np.memmap(
            self.path,
            dtype=header.np_dtype,
            mode="r",
            offset=header.tokens_offset,
            shape=(header.num_tokens,),
        )

    @functools.cached_property
    def doc_offsets(self) -> npt.NDArray[np.uint64]:
        header = self.header
        return np.memmap(
            self.path, dtype="<u8", mode="r", offset=header.index_offset, shape=(header.num_docs + 1,)
        )

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: Verify = "full") -> TokenDataset:
        """Map ``path`` after checking its header, size, dtype and fingerprint.

        ``verify="full"`` re-hashes every byte (about 1.6 s per GB here); ``"quick"`` checks the header,
        sizes and the fingerprint of the chunk table, and scans the mapped tokens once for their
        largest id (a memory pass, no hashing), for a process that must produce its first batch soon
        from a file that its job already verified. Either way a file holding an id at or beyond
        ``vocab_size`` is refused here, not by an IndexError in the model's embedding later.
        """
        p = Path(path)
        header = read_header(p)
        verify_token_file(p, header, verify)
        return cls(p, header)

    @property
    def fingerprint(self) -> str:
        return self.header.fingerprint

    @property
    def vocab_size(self) -> int:
        return self.header.vocab_size

    @property
    def max_token_id(self) -> int | None:
        """The largest token id the writer recorded; ``None`` for an empty or a version 1 file."""
        return self.header.max_token_id

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def num_docs(self) -> int:
        return self.header.num_docs

    @property
    def eos_id(self) -> int | None:
        return self.header.eos_id

    def num_samples(self, seq_len: int) -> int:
        """How many whole ``seq_len`` windows (plus their target token) the file holds."""
        if seq_len < 1:
            raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
        return max(0, (self.num_tokens - 1) // seq_len)

    def sample(self, index: int, seq_len: int) -> npt.NDArray[Any]:
        """The ``seq_len + 1`` tokens of sample ``index``, as a view into the mapping."""
        n = self.num_samples(seq_len)
        if not 0 <= index < n:
            raise IndexError(f"sample {index} out of range [0, {n}) for seq_len {seq_len}")
        start = index * seq_len
        return self.tokens[start : start + seq_len + 1]

    def document(self, i: int) -> npt.NDArray[Any]:
        """The tokens of document ``i`` (its end-of-document id included), as a view."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range [0, {self.num_docs})")
        lo, hi = int(self.doc_offsets[i]), int(self.doc_offsets[i + 1])
        if not 0 <= lo <= hi <= self.num_tokens:
            raise DataError(
                f"{self.path}: document index entry {i} is corrupt; run TokenDataset.open(verify='full')"
            )
        return self.tokens[lo:hi]

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        h = self.header
        return (
            f"TokenDataset({str(self.path)!r}, tokens={h.num_tokens}, docs={h.num_docs}, dtype={h.dtype}, "
            f"vocab={h.vocab_size}, fingerprint={h.fingerprint[:12]})"
        )
