"""`checkpointless data prepare` on hostile inputs: deep nesting, an over-long line, a FIFO, and a
large one-document text file, which is streamed in pieces (peak RSS measured in a child)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from checkpointless.data import TokenDataset, prepare_main
from checkpointless.data.prepare import MAX_LINE_BYTES

pytestmark = pytest.mark.timeout(120)


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    return prepare_main(argv, stderr=err), err.getvalue()


@pytest.mark.parametrize("where", ["array", "field"])
def test_deeply_nested_json_is_a_clear_error(tmp_path: Path, where: str) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    line = deep if where == "array" else '{"text": "x", "meta": ' + deep + "}"
    inp = tmp_path / "c.jsonl"
    inp.write_text('{"text": "fine"}\n' + line + "\n")
    rc, err = _run([str(inp), "-o", str(tmp_path / "o.tokens"), "--quiet"])
    assert rc == 1, err
    assert (
        err
        == f"checkpointless data prepare: error: {inp}:2: JSON nested too deeply to be a record; fix or remove the line\n"
    )
    assert not (tmp_path / "o.tokens").exists()


def test_a_fifo_input_is_not_a_regular_file_and_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    rc, err = _run([str(fifo), "-o", str(tmp_path / "o.tokens")])
    assert rc == 2, err
    assert "is not a regular file" in err and "not found" not in err
    assert err.count("\n") == 1


_PEAK = textwrap.dedent(
    """
    import io, resource, sys
    from checkpointless.data import prepare_main
    err = io.StringIO()
    rc = prepare_main(sys.argv[1:], stderr=err)
    print(rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, repr(err.getvalue()))
    """
)


def _peak(args: list[str]) -> tuple[int, int, str]:
    res = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, timeout=100)
    m = re.fullmatch(r"(\d+) (\d+) (.*)\n", res.stdout, re.S)
    assert m, res.stdout + res.stderr[-3000:]
    return int(m.group(1)), int(m.group(2)), m.group(3)


def test_a_line_over_the_cap_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    """A 96 MiB line (the cap is 32 MiB): exit 1 naming FILE:LINE, and peak RSS well under the line."""
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "hello"}\n')
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.write(b'{"text": "hello"}\n{"text": "')
        block = b"a" * (1 << 20)
        for _ in range(96):
            f.write(block)
        f.write(b'"}\n')
    rc0, base, _ = _peak([str(small), "-o", str(tmp_path / "s.tokens"), "--quiet"])
    rc, peak, err = _peak([str(big), "-o", str(tmp_path / "b.tokens"), "--quiet"])
    assert rc0 == 0 and rc == 1, err
    assert f"{big}:2: line longer than {MAX_LINE_BYTES >> 20} MiB" in err
    assert (peak - base) * 1024 < 2 * MAX_LINE_BYTES, (base, peak)  # 54 MB measured; whole: 7.8 GB for 400 MB


def test_a_large_one_document_text_file_is_streamed_in_pieces(tmp_path: Path) -> None:
    """12 MB of text without a newline (multi-byte characters across every piece boundary) is
    one document, byte for byte, tokenized a piece at a time."""
    text = ("é日x" * 2_000_000).encode()  # 12 MB, no newline: pieces are cut between characters
    inp = tmp_path / "book.txt"
    inp.write_bytes(text + b"\nlast line")
    out = tmp_path / "book.tokens"
    rc, err = _run([str(inp), "-o", str(out), "--quiet"])
    assert rc == 0, err
    ds = TokenDataset.open(out)
    assert ds.num_docs == 1
    doc = np.asarray(ds.document(0))
    assert int(doc[-1]) == 256 and doc[:-1].astype(np.uint8).tobytes() == text + b"\nlast line"
