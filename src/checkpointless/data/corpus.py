"""A deterministic synthetic text corpus, so the example and the tests never download anything.

Words come from a fixed made-up lexicon and are drawn with numpy's PCG64 raw output, whose stream
numpy keeps stable across releases; the same (num_docs, seed) gives the same bytes everywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from checkpointless.errors import ConfigError

__all__ = ["make_synthetic_corpus"]

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "n", "r", "s", "l", "th")
# 16 x 7 x 6 = 672 syllables; one- and two-syllable words give a lexicon of ~450k words, enough for
# a byte-level model to see realistic-looking but non-trivial text.
_SYLLABLES = tuple(o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS)
_ENDINGS = (".", ".", ".", "?", "!")


def _document(raw: np.ndarray) -> str:
    """Turn a block of uint64 draws into one paragraph of sentence-cased made-up words."""
    n_words = 8 + int(raw[0] % 120)
    words: list[str] = []
    capitalize = True
    for k in range(n_words):
        v = int(raw[1 + k])
        word = _SYLLABLES[v % len(_SYLLABLES)]
        if (v >> 12) % 3 == 0:
            word += _SYLLABLES[(v >> 20) % len(_SYLLABLES)]
        if capitalize:
            word = word.capitalize()
        # About one word in nine ends a sentence; the last word always does.
        capitalize = (v >> 32) % 9 == 0 or k == n_words - 1
        if capitalize:
            word += _ENDINGS[(v >> 40) % len(_ENDINGS)]
        elif (v >> 48) % 11 == 0:
            word += ","
        words.append(word)
    return " ".join(words)


def make_synthetic_corpus(path: str | os.PathLike[str], num_docs: int = 2000, seed: int = 0) -> Path:
    """Write ``num_docs`` documents to ``path`` and return it.

    A ``.jsonl`` path gets one ``{"id": i, "text": ...}`` object per line; any other suffix gets
    plain text with one document per line (prepare it with ``--split-lines``). The file is written
    to a temporary name and renamed, so a reader never sees half a corpus.
    """
    if num_docs < 1:
        raise ConfigError(f"num_docs must be at least 1, got {num_docs}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    gen = np.random.PCG64(seed)
    as_jsonl = out.suffix == ".jsonl"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for i in range(num_docs):
                text = _document(gen.random_raw(129))
                f.write(json.dumps({"id": i, "text": text}) + "\n" if as_jsonl else text + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
