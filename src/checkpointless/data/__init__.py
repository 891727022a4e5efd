"""Memory-mapped token data that resumes at the exact sample, with batches cached in shared memory.

* :func:`prepare_main` / :func:`write_token_file`: build a validated token file (one atomic write).
* :class:`TokenDataset`: map it (no copy) after checking size, dtype and fingerprint.
* :class:`BatchLoader`: rank ``r``'s batch at global step ``s``, a pure function of the step.
* :class:`ShmBatchCache`: prefetched batches in /dev/shm that outlive the process;
  :func:`remove_job_cache` / :func:`start_cache_janitor` leave nothing behind.
* :func:`prefetch_as_spare`: a hot spare on a spare host fills its own host's cache for the
  ranks it may take (``spare_cache.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from checkpointless.data.corpus import make_synthetic_corpus
from checkpointless.data.dataset import TokenDataset
from checkpointless.data.digest import array_digest, batch_digest
from checkpointless.data.format import TokenFileHeader
from checkpointless.data.format_check import read_header
from checkpointless.data.format_writer import TokenFileWriter, write_token_file
from checkpointless.data.prepare import prepare_main
from checkpointless.data.sampler import GlobalSampler
from checkpointless.data.shm_cache import (
    BatchKey,
    CacheStats,
    ShmBatchCache,
    job_cache_dir,
    remove_job_cache,
    start_cache_janitor,
)
from checkpointless.data.tokenize import ByteTokenizer, get_tokenizer

if TYPE_CHECKING:
    from checkpointless.data.loader import BatchLoader
    from checkpointless.data.spare_cache import prefetch_as_spare

# Loaded on first use: they yield torch tensors, so importing them imports torch (1.5-2 s of CPU),
# which `checkpointless data prepare` and the launcher's clean-up of the batch cache never need.
_LAZY = {"BatchLoader": "checkpointless.data.loader", "prefetch_as_spare": "checkpointless.data.spare_cache"}

__all__ = [
    "BatchKey",
    "BatchLoader",
    "ByteTokenizer",
    "CacheStats",
    "GlobalSampler",
    "ShmBatchCache",
    "TokenDataset",
    "TokenFileHeader",
    "TokenFileWriter",
    "array_digest",
    "batch_digest",
    "get_tokenizer",
    "job_cache_dir",
    "make_synthetic_corpus",
    "prefetch_as_spare",
    "prepare_main",
    "read_header",
    "remove_job_cache",
    "start_cache_janitor",
    "write_token_file",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
