"""Tokenizers for ``checkpointless data prepare``: a built-in byte-level one and optional adapters.

The byte tokenizer needs nothing and never changes, so the example and the tests produce the same
token file on every machine. Hugging Face ``tokenizers`` and ``tiktoken`` are used only when they are
installed; asking for one that is not installed is a configuration error that names the package.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from checkpointless.errors import ConfigError

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "get_tokenizer",
]

# Tried in order when a Hugging Face tokenizer is given without --eos-token.
_HF_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class Tokenizer(Protocol):
    """What the prepare step needs from a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode_batch(self, texts: list[str]) -> list[npt.NDArray[np.int64]]: ...

    def decode(self, ids: npt.ArrayLike) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and id 256 as the end-of-document separator."""

    name = "byte"
    vocab_size = 257
    eos_id: int | None = 256

    def encode_batch(self, texts: list[str]) -> list[npt.NDArray[np.int64]]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: npt.ArrayLike) -> str:
        arr = np.asarray(ids)
        return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _import_optional(module: str, spec: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"--tokenizer {spec} needs the `{module}` package, which is not installed; "
            f"run `pip install {module}` or use --tokenizer byte"
        ) from None


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a tokenizer.json file or a hub name."""

    def __init__(self, source: str, eos_token: str | None = None) -> None:
        lib = _import_optional("tokenizers", f"hf:{source}")
        if os.path.exists(source):
            self._tok = lib.Tokenizer.from_file(source)
        else:
            try:
                self._tok = lib.Tokenizer.from_pretrained(source)
            except Exception as e:  # the library raises its own exception types for a missing model
                raise ConfigError(
                    f"--tokenizer hf:{source}: no such tokenizer.json file and no hub model ({e})"
                ) from None
        self.name = f"hf:{source}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        candidates = (eos_token,) if eos_token is not None else _HF_EOS_CANDIDATES
        found = [self._tok.token_to_id(c) for c in candidates]
        ids = [i for i in found if i is not None]
        if eos_token is not None and not ids:
            raise ConfigError(f"--eos-token {eos_token!r} is not in the vocabulary of {self.name}")
        self.eos_id: int | None = int(ids[0]) if ids else None

    def encode_batch(self, texts: list[str]) -> list[npt.NDArray[np.int64]]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: npt.ArrayLike) -> str:
        return str(self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False))


class TiktokenTokenizer:
    """A ``tiktoken`` encoding by name (gpt2, cl100k_base, ...); its end-of-text token separates documents."""

    def __init__(self, encoding: str) -> None:
        lib = _import_optional("tiktoken", f"tiktoken:{encoding}")
        try:
            self._enc = lib.get_encoding(encoding)
        except Exception as e:  # unknown names and missing BPE files raise various types
            raise ConfigError(f"--tokenizer tiktoken:{encoding}: cannot load the encoding ({e})") from None
        self.name = f"tiktoken:{encoding}"
        self.vocab_size = int(self._enc.n_vocab)
        self.eos_id: int | None = int(self._enc.eot_token)

    def encode_batch(self, texts: list[str]) -> list[npt.NDArray[np.int64]]:
        # encode_ordinary: text that happens to spell a special token is just text, not a control token.
        return [np.asarray(ids, dtype=np.int64) for ids in self._enc.encode_ordinary_batch(texts)]

    def decode(self, ids: npt.ArrayLike) -> str:
        return str(self._enc.decode([int(i) for i in np.asarray(ids).ravel()]))


def get_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """``byte``, ``hf:<tokenizer.json or hub name>`` or ``tiktoken:<encoding name>``."""
    kind, _, arg = spec.partition(":")
    if spec == "byte":
        if eos_token is not None:
            raise ConfigError("--eos-token applies to hf: tokenizers only; the byte tokenizer uses id 256")
        return ByteTokenizer()
    if kind == "hf" and arg:
        return HFTokenizer(arg, eos_token)
    if kind == "tiktoken" and arg:
        if eos_token is not None:
            raise ConfigError(
                "--eos-token applies to hf: tokenizers only; tiktoken uses its end-of-text token"
            )
        return TiktokenTokenizer(arg)
    raise ConfigError(
        f"--tokenizer {spec!r} is not understood; use byte, hf:PATH/tokenizer.json or tiktoken:ENCODING"
    )
