"""A small text corpus for the character-level example scripts (minGPT's ``input.txt``)."""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["write_words"]

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "tired",
    "cats",
    "sleep",
    "by",
    "the",
    "door",
]


def write_words(path: Path, count: int = 500, seed: int = 0) -> Path:
    """``count`` words drawn from a fixed list by ``seed``, written to ``path``: about 2,400
    characters for 500 (with block_size 32, 2 ranks and batches of 16, 67 steps an epoch)."""
    r = random.Random(seed)
    path.write_text(" ".join(r.choice(_WORDS) for _ in range(count)))
    return path
