"""``checkpointless data prepare``: turn text / JSONL files into one validated token file.

Inputs are streamed in binary and decoded line by line, so memory stays flat whatever the corpus
size, and progress is measured in input bytes (known up front), which makes the bar honest for
mixed file sizes. Every document is followed by the tokenizer's end-of-document id so that
samples cut across document boundaries still tell the model where one text ends.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np
from tqdm import tqdm

from checkpointless.data.format import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES
from checkpointless.data.format_writer import TokenFileWriter
from checkpointless.data.tokenize import get_tokenizer
from checkpointless.errors import ConfigError, DataError

__all__ = ["MAX_LINE_BYTES", "build_parser", "iter_documents", "prepare_main"]

_BATCH_DOCS = 512  # documents per encode_batch call: enough to amortise tokenizer overhead
_BATCH_BYTES = 16 * 1024 * 1024  # and at most this much input per call: memory stays flat


def _progress_bar(total: int, stream: TextIO, *, quiet: bool, forced: bool) -> tqdm[None]:
    """A tqdm bar over input bytes on ``stream``.

    Drawn on a terminal only, unless ``--progress`` asks for it (a CI log that wants to see it move);
    ``--quiet`` wins. In a log the bar is redrawn at most every few seconds so it does not swamp it.
    """
    tty = stream.isatty()
    return tqdm(
        total=max(total, 1),
        desc="prepare",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream,
        disable=quiet or not (tty or forced),
        mininterval=0.1 if tty else 5.0,
        ascii=not tty,  # a log file gets '#' rather than block characters it may not render
        dynamic_ncols=tty,
    )


MAX_LINE_BYTES = 32 * 1024 * 1024  # one JSONL record or text line; a longer one is an error
_PIECE_BYTES = 4 * 1024 * 1024  # a text file that is one document is tokenized this much at a time


def _open_input(path: Path) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file (a FIFO would block, a device never end).

    Raises:
        ConfigError: it does not exist, or it is not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{path}: input file not found; check the path") from None
    except OSError as e:
        raise ConfigError(f"input {str(path)!r} cannot be read ({e.strerror}); check the path") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(_not_regular(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _not_regular(path: Path) -> str:
    return f"input {str(path)!r} is not a regular file (a FIFO, socket or device); pass a file"


def _utf8_cut(piece: bytes) -> int:
    """Where to cut ``piece`` so that no line (or failing that, no UTF-8 character) is split."""
    nl = piece.rfind(b"\n")
    if nl >= 0:
        return nl + 1
    cut = len(piece)
    while cut > len(piece) - 4 and cut > 0 and piece[cut - 1] & 0xC0 == 0x80:
        cut -= 1  # back over continuation bytes to the character's first byte
    return cut - 1 if cut > 0 and piece[cut - 1] >= 0xC0 else cut


def _pieces(f: BinaryIO) -> Iterator[tuple[str, int, bool]]:
    """A whole file as one document, in pieces cut at line ends: memory stays flat."""
    rest = b""
    while True:
        chunk = f.read(_PIECE_BYTES)
        buf = rest + chunk
        if not chunk:
            yield buf.decode("utf-8", errors="replace"), len(buf), True
            return
        cut = _utf8_cut(buf) or len(buf)
        rest = buf[cut:]
        if cut:
            yield buf[:cut].decode("utf-8", errors="replace"), cut, False


def _lines(f: BinaryIO, path: Path) -> Iterator[tuple[int, bytes]]:
    for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
        if len(line) > MAX_LINE_BYTES:
            raise DataError(
                f"{path}:{lineno}: line longer than {MAX_LINE_BYTES >> 20} MiB; split the document "
                "(one record per line) or check that the file is JSONL/text"
            )
        yield lineno, line


def iter_documents(path: Path, *, text_key: str, split_lines: bool) -> Iterator[tuple[str, int, bool]]:
    """Yield (text, input bytes consumed, whether the document ends here) from one input file.

    ``.jsonl`` / ``.json`` files hold one JSON object per line with the text under ``text_key``;
    any other file is one document (yielded in pieces cut at line ends), or one document per
    non-empty line with ``split_lines``. Lines are read one at a time, each at most
    :data:`MAX_LINE_BYTES`.

    Raises:
        ConfigError: ``path`` is missing or not a regular file.
        DataError: ``FILE:LINE`` of a line that is too long, not JSON, nested too deeply, or
            without the text field.
    """
    is_jsonl = path.suffix in (".jsonl", ".json")
    with _open_input(path) as f:
        if not is_jsonl and not split_lines:
            yield from _pieces(f)
            return
        for lineno, line in _lines(f, path):
            if not line.strip():
                yield "", len(line), True  # still counts toward progress, but makes no document
                continue
            if not is_jsonl:
                yield line.rstrip(b"\r\n").decode("utf-8", errors="replace"), len(line), True
                continue
            try:
                obj = json.loads(line)
            except RecursionError:
                raise DataError(
                    f"{path}:{lineno}: JSON nested too deeply to be a record; fix or remove the line"
                ) from None
            except ValueError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({str(e)[:100]}); fix or remove the line"
                ) from None
            text = obj.get(text_key) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{path}:{lineno}: no string field {text_key!r}; pass --text-key with the right field name"
                )
            yield text, len(line), True


def build_parser(prog: str = "checkpointless data prepare") -> argparse.ArgumentParser:
    """The argument parser of the prepare command (exposed so a parent CLI can show its help)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Tokenize text or JSONL files into a checkpointless token file (written atomically).",
    )
    p.add_argument("inputs", nargs="+", help="input .jsonl/.json (one object per line) or text files")
    p.add_argument("-o", "--output", required=True, help="token file to write (e.g. train.tokens)")
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
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    shown.add_argument(
        "--progress",
        action="store_true",
        help="draw the progress bar even when stderr is not a terminal (default: only on a terminal)",
    )
    return p


def _check_paths(inputs: list[str], output: str) -> tuple[list[Path], Path]:
    """Refuse inputs and an output that cannot work, before a temporary file is created."""
    for text in inputs:
        inp = Path(text)
        if not text.strip():
            raise ConfigError("an input path is empty; pass .jsonl or text files")
        if inp.is_dir():
            raise ConfigError(f"input {text!r} is a directory; pass the files in it (e.g. {text}/*.jsonl)")
        if not inp.exists():
            raise ConfigError(f"{text}: input file not found; check the path")
        if not inp.is_file():
            raise ConfigError(_not_regular(inp))
        if not os.access(inp, os.R_OK):
            raise ConfigError(f"input {text!r} is not readable; check its permissions")
    out = Path(output)
    if not output.strip():
        raise ConfigError("--output is empty; name the token file to write, e.g. -o train.tokens")
    if out.is_dir():
        raise ConfigError(
            f"--output {output!r} is a directory; name a file in it, e.g. -o {out / 'train.tokens'}"
        )
    if out.exists() and not out.is_file():
        raise ConfigError(f"--output {output!r} exists and is not a regular file; choose another path")
    parent = out.parent
    if not parent.exists():
        raise ConfigError(
            f"--output {output!r}: directory {str(parent)!r} does not exist; create it first (mkdir -p {parent})"
        )
    if not parent.is_dir():
        raise ConfigError(
            f"--output {output!r}: {str(parent)!r} is a file, not a directory; choose another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--output {output!r}: directory {str(parent)!r} is not writable; choose another path"
        )
    paths = [Path(t) for t in inputs]
    if out.resolve() in {i.resolve() for i in paths}:
        raise ConfigError(f"--output {output} is also an input; choose another output path")
    return paths, out


def _prepare(args: argparse.Namespace, stderr: TextIO) -> None:
    args.inputs, args.output = _check_paths(args.inputs, args.output)
    if not 64 <= args.chunk_bytes <= MAX_CHUNK_BYTES or args.chunk_bytes % 8:
        raise ConfigError(
            f"--chunk-bytes {args.chunk_bytes} must be a multiple of 8 from 64 to {MAX_CHUNK_BYTES}"
        )
    tok = get_tokenizer(args.tokenizer, args.eos_token)
    eos = None if args.no_eos else tok.eos_id
    if not args.no_eos and eos is None:
        raise ConfigError(f"{tok.name} has no end-of-document token; pass --eos-token or --no-eos")
    total = sum(i.stat().st_size for i in args.inputs)
    bar = _progress_bar(total, stderr, quiet=args.quiet, forced=args.progress)
    start = time.monotonic()
    suffix = np.asarray([eos] if eos is not None else [], dtype=np.int64)

    with (
        bar,
        TokenFileWriter(
            args.output, tok.vocab_size, eos_id=eos, tokenizer=tok.name, chunk_bytes=args.chunk_bytes
        ) as writer,
    ):
        texts: list[str] = []
        ends: list[bool] = []  # whether each text ends its document (a long one comes in pieces)
        pending = 0
        open_doc = False  # the last text was a piece of a document that goes on

        def flush() -> None:
            nonlocal pending
            for ids, end in zip(tok.encode_batch(texts), ends, strict=True):
                writer.add_document(np.concatenate([ids, suffix]) if end and suffix.size else ids, end=end)
            texts.clear()
            ends.clear()
            bar.update(pending)
            pending = 0

        for inp in args.inputs:
            docs = iter_documents(inp, text_key=args.text_key, split_lines=args.split_lines)
            for text, nbytes, end in docs:
                pending += nbytes
                if text or (end and open_doc):
                    texts.append(text)
                    ends.append(end)
                    open_doc = not end
                if len(texts) >= _BATCH_DOCS or pending >= _BATCH_BYTES:
                    flush()
        flush()
        if writer.num_tokens == 0:
            raise DataError(
                f"{', '.join(map(str, args.inputs))}: no text found; check --text-key and the inputs"
            )
        header = writer.commit()
    if not args.quiet:
        stderr.write(
            f"wrote {args.output}: {header.num_tokens:,} tokens ({header.dtype}), {header.num_docs:,} documents, "
            f"tokenizer {header.tokenizer}, fingerprint {header.fingerprint[:16]}, "
            f"{time.monotonic() - start:.2f} s\n"
        )


def prepare_main(argv: list[str] | None = None, *, stderr: TextIO | None = None) -> int:
    """Run the prepare command; returns the process exit status.

    0: done. 1: the inputs' contents are bad (invalid JSON, no text). 2: a bad argument (a flag's
    value, a path that cannot work, a tokenizer that is not available) or argparse's usage error.
    """
    err = stderr if stderr is not None else sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage message
        return e.code if isinstance(e.code, int) else 2
    try:
        if not args.text_key:
            raise ConfigError("--text-key is empty; name the JSON field that holds the text, e.g. text")
        _prepare(args, err)
    except ConfigError as e:
        err.write(f"checkpointless data prepare: error: {e}\n")
        return 2
    except DataError as e:
        err.write(f"checkpointless data prepare: error: {e}\n")
        return 1
    return 0
