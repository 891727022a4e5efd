"""``checkpointless data prepare``: turn text / JSONL files into one validated token file.

Inputs are streamed in binary and decoded line by line, so memory stays flat whatever the corpus
size, and progress is measured in input bytes (known up front), which makes the bar honest for
mixed file sizes. Every document is followed by the tokenizer's end-of-document id so that
samples cut across document boundaries still tell the model where one text ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np

from checkpointless.data.format import DEFAULT_CHUNK_BYTES, TokenFileWriter
from checkpointless.data.tokenize import get_tokenizer
from checkpointless.errors import ConfigError, DataError

__all__ = ["Progress", "build_parser", "iter_documents", "prepare_main"]

_BATCH_DOCS = 512  # documents per encode_batch call: enough to amortise tokenizer overhead


class Progress:
    """A byte-based progress bar on a stream: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(
        self, total: int, stream: TextIO, *, enabled: bool = True, min_interval: float = 0.1
    ) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.enabled = enabled
        self.done = 0
        self._tty = stream.isatty()
        self._min_interval = min_interval
        self._last_draw = 0.0
        self._last_decile = -1
        self._start = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= self._min_interval:
                self._last_draw = now
                self._draw(now, end="\r")
        else:
            decile = min(10, self.done * 10 // self.total)
            if decile > self._last_decile:
                self._last_decile = decile
                self._draw(now, end="\n")

    def _draw(self, now: float, end: str) -> None:
        frac = min(1.0, self.done / self.total)
        filled = int(frac * 30)
        rate = self.done / max(now - self._start, 1e-9) / 1e6
        bar = "#" * filled + "." * (30 - filled)
        self.stream.write(f"prepare [{bar}] {frac:6.1%} {self.done / 1e6:9.1f} MB {rate:7.1f} MB/s{end}")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.done = max(self.done, self.total)
            if self._tty or self._last_decile < 10:
                self._draw(time.monotonic(), end="\n")


def iter_documents(path: Path, *, text_key: str, split_lines: bool) -> Iterator[tuple[str, int]]:
    """Yield (document text, input bytes consumed) from one input file.

    ``.jsonl`` / ``.json`` files hold one JSON object per line with the text under ``text_key``;
    any other file is one document, or one document per non-empty line with ``split_lines``.
    """
    is_jsonl = path.suffix in (".jsonl", ".json")
    if not path.is_file():
        raise DataError(f"{path}: input file not found; check the path")
    with open(path, "rb") as f:
        if not is_jsonl and not split_lines:
            raw = f.read()
            yield raw.decode("utf-8", errors="replace"), len(raw)
            return
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                yield "", len(line)  # still counts toward progress, but makes no document
                continue
            if not is_jsonl:
                yield line.rstrip(b"\r\n").decode("utf-8", errors="replace"), len(line)
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e}); fix or remove the line") from None
            text = obj.get(text_key) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: no string field {text_key!r}; pass --text-key with the right field name"
                )
            yield text, len(line)


def build_parser(prog: str = "checkpointless data prepare") -> argparse.ArgumentParser:
    """The argument parser of the prepare command (exposed so a parent CLI can show its help)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Tokenize text or JSONL files into a checkpointless token file (written atomically).",
    )
    p.add_argument(
        "inputs", nargs="+", type=Path, help="input .jsonl/.json (one object per line) or text files"
    )
    p.add_argument("-o", "--output", required=True, type=Path, help="token file to write (e.g. train.tokens)")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (built in), hf:PATH/tokenizer.json or hf:HUB_NAME (needs `tokenizers`), "
        "tiktoken:ENCODING (needs `tiktoken`); default: byte",
    )
    p.add_argument("--eos-token", default=None, help="end-of-document token string for hf: tokenizers")
    p.add_argument("--text-key", default="text", help="JSON field that holds the text (default: text)")
    p.add_argument("--split-lines", action="store_true", help="text files: one document per non-empty line")
    p.add_argument("--no-eos", action="store_true", help="do not append the end-of-document id")
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p


def _prepare(args: argparse.Namespace, stderr: TextIO) -> None:
    for inp in args.inputs:
        if not inp.is_file():
            raise DataError(f"{inp}: input file not found; check the path")
    if args.output.resolve() in {i.resolve() for i in args.inputs}:
        raise ConfigError(f"--output {args.output} is also an input; choose another output path")
    tok = get_tokenizer(args.tokenizer, args.eos_token)
    eos = None if args.no_eos else tok.eos_id
    if not args.no_eos and eos is None:
        raise ConfigError(f"{tok.name} has no end-of-document token; pass --eos-token or --no-eos")
    total = sum(i.stat().st_size for i in args.inputs)
    progress = Progress(total, stderr, enabled=not args.quiet)
    start = time.monotonic()
    suffix = np.asarray([eos] if eos is not None else [], dtype=np.int64)

    with TokenFileWriter(
        args.output, tok.vocab_size, eos_id=eos, tokenizer=tok.name, chunk_bytes=args.chunk_bytes
    ) as writer:
        texts: list[str] = []
        pending = 0

        def flush() -> None:
            nonlocal pending
            for ids in tok.encode_batch(texts):
                writer.add_document(np.concatenate([ids, suffix]) if suffix.size else ids)
            texts.clear()
            progress.advance(pending)
            pending = 0

        for inp in args.inputs:
            for text, nbytes in iter_documents(inp, text_key=args.text_key, split_lines=args.split_lines):
                pending += nbytes
                if text:
                    texts.append(text)
                if len(texts) >= _BATCH_DOCS:
                    flush()
        flush()
        if writer.num_tokens == 0:
            raise DataError(
                f"{', '.join(map(str, args.inputs))}: no text found; check --text-key and the inputs"
            )
        header = writer.commit()
    progress.finish()
    if not args.quiet:
        stderr.write(
            f"wrote {args.output}: {header.num_tokens:,} tokens ({header.dtype}), {header.num_docs:,} documents, "
            f"tokenizer {header.tokenizer}, fingerprint {header.fingerprint[:16]}, "
            f"{time.monotonic() - start:.2f} s\n"
        )


def prepare_main(argv: list[str] | None = None, *, stderr: TextIO | None = None) -> int:
    """Run the prepare command; returns the process exit status (0 ok, 1 data/config error, 2 usage)."""
    err = stderr if stderr is not None else sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage message
        return e.code if isinstance(e.code, int) else 2
    try:
        _prepare(args, err)
    except (DataError, ConfigError) as e:
        err.write(f"checkpointless data prepare: error: {e}\n")
        return 1
    return 0
