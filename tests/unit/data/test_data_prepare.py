"""`checkpointless data prepare` end to end on a small synthetic corpus, and its error paths."""

from __future__ import annotations

import fcntl
import importlib.util
import io
import json
import os
import pty
import select
import struct
import termios
from pathlib import Path

import numpy as np
import pytest

from checkpointless.data import ByteTokenizer, TokenDataset, make_synthetic_corpus, prepare_main


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    return prepare_main(argv, stderr=err), err.getvalue()


@pytest.mark.timeout(30)
def test_synthetic_corpus_is_deterministic(tmp_path: Path) -> None:
    a = make_synthetic_corpus(tmp_path / "a.jsonl", num_docs=50, seed=4)
    b = make_synthetic_corpus(tmp_path / "b.jsonl", num_docs=50, seed=4)
    c = make_synthetic_corpus(tmp_path / "c.jsonl", num_docs=50, seed=5)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    docs = [json.loads(line) for line in a.read_text().splitlines()]
    assert [d["id"] for d in docs] == list(range(50)) and all(
        d["text"].endswith((".", "?", "!")) for d in docs
    )


@pytest.mark.timeout(30)
def test_prepare_jsonl_end_to_end(tmp_path: Path) -> None:
    corpus = make_synthetic_corpus(tmp_path / "c.jsonl", num_docs=300, seed=1)
    out = tmp_path / "c.tokens"
    rc, err = _run([str(corpus), "-o", str(out), "--tokenizer", "byte"])
    assert rc == 0, err
    # not a terminal and not asked for: the summary line only, no bar in a log
    assert err.startswith(f"wrote {out}") and "prepare:" not in err and err.count("\n") == 1
    ds = TokenDataset.open(out)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert ds.num_docs == 300 and ds.header.tokenizer == "byte" and ds.eos_id == 256
    tok = ByteTokenizer()
    for i in (0, 17, 299):
        doc = ds.document(i)
        assert int(doc[-1]) == 256  # every document ends with the separator
        assert tok.decode(doc) == texts[i]
    assert ds.num_tokens == sum(len(t.encode()) + 1 for t in texts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "c.tokens"]


@pytest.mark.timeout(30)
def test_progress_bar_on_a_terminal_only_or_when_asked(tmp_path: Path) -> None:
    corpus = make_synthetic_corpus(tmp_path / "c.jsonl", num_docs=200, seed=3)
    size = corpus.stat().st_size
    # a real terminal (a pseudo-terminal): tqdm draws the bar there without being asked
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    try:
        with open(follower, "w", encoding="utf-8", closefd=False) as term:
            assert term.isatty()
            rc = prepare_main([str(corpus), "-o", str(tmp_path / "t.tokens")], stderr=term)
            term.flush()
        drawn = b""
        while select.select([leader], [], [], 0.5)[0]:
            drawn += os.read(leader, 65536)
    finally:
        os.close(leader)
        os.close(follower)
    text = drawn.decode("utf-8", errors="replace")
    assert rc == 0 and "prepare: 100%" in text and "wrote " in text, text
    # asked for in a log: the bar (ASCII, total in input bytes) comes before the summary
    rc, err = _run([str(corpus), "-o", str(tmp_path / "l.tokens"), "--progress"])
    assert rc == 0 and "prepare: 100%|##########|" in err, err
    assert f"/{size / 1024:.1f}k" in err, err  # the total is the inputs' size in KiB
    assert err.index("prepare:") < err.index("wrote ")
    # --quiet and --progress contradict each other: argparse's usage error, nothing written
    rc, err = _run([str(corpus), "-o", str(tmp_path / "q.tokens"), "--quiet", "--progress"])
    assert rc == 2 and not (tmp_path / "q.tokens").exists()


@pytest.mark.timeout(30)
def test_text_and_jsonl_inputs_give_the_same_file(tmp_path: Path) -> None:
    jsonl = make_synthetic_corpus(tmp_path / "c.jsonl", num_docs=120, seed=2)
    text = make_synthetic_corpus(tmp_path / "c.txt", num_docs=120, seed=2)
    assert _run([str(jsonl), "-o", str(tmp_path / "a.tokens"), "--quiet"]) == (0, "")
    assert _run([str(text), "-o", str(tmp_path / "b.tokens"), "--split-lines", "--quiet"]) == (0, "")
    a, b = TokenDataset.open(tmp_path / "a.tokens"), TokenDataset.open(tmp_path / "b.tokens")
    assert a.fingerprint == b.fingerprint
    whole = tmp_path / "w.tokens"  # without --split-lines a text file is one document
    assert _run([str(text), "-o", str(whole), "--quiet", "--no-eos"])[0] == 0
    w = TokenDataset.open(whole)
    assert w.num_docs == 1 and w.eos_id is None and w.num_tokens == text.stat().st_size


@pytest.mark.timeout(30)
def test_several_inputs_are_concatenated_in_order(tmp_path: Path) -> None:
    one = tmp_path / "1.jsonl"
    two = tmp_path / "2.jsonl"
    one.write_text('{"text": "ab"}\n\n{"body": "x", "text": "c"}\n')
    two.write_text('{"text": "d"}\n')
    rc, err = _run([str(one), str(two), "-o", str(tmp_path / "o.tokens")])
    assert rc == 0, err
    ds = TokenDataset.open(tmp_path / "o.tokens")
    assert ds.tokens.tolist() == [97, 98, 256, 99, 256, 100, 256] and ds.num_docs == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("content", "extra", "needle"),
    [
        ('{"text": "ok"}\n{broken\n', [], ":2: not valid JSON"),
        ('{"body": "ok"}\n', [], "no string field 'text'; pass --text-key"),
        ("\n\n", [], "no text found"),
        (
            '{"text": "ok"}\n',
            ["--tokenizer", "sentencepiece"],
            "--tokenizer 'sentencepiece' is not understood",
        ),
        ('{"text": "ok"}\n', ["--eos-token", "</s>"], "--eos-token applies to hf:"),
    ],
    ids=["bad-json", "wrong-key", "empty", "unknown-tokenizer", "eos-for-byte"],
)
def test_errors_name_the_input_and_the_fix(
    tmp_path: Path, content: str, extra: list[str], needle: str
) -> None:
    corpus = tmp_path / "in.jsonl"
    corpus.write_text(content)
    out = tmp_path / "out.tokens"
    rc, err = _run([str(corpus), "-o", str(out), *extra])
    # a bad flag is a usage error (2); bad contents of an input are a data error (1)
    assert rc == (2 if extra else 1) and needle in err and "error:" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no output, no temporary file


@pytest.mark.timeout(30)
def test_missing_input_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jsonl"
    rc, err = _run([str(missing), "-o", str(tmp_path / "o.tokens")])
    assert rc == 2 and f"{missing}: input file not found" in err
    assert prepare_main([str(missing)]) == 2  # -o is required: argparse's usage error
    assert "--output" in capsys.readouterr().err
    same = make_synthetic_corpus(tmp_path / "c.jsonl", num_docs=2)
    rc, err = _run([str(same), "-o", str(same)])
    assert rc == 2 and "is also an input" in err


@pytest.mark.timeout(30)
@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None, reason="tokenizers is installed")
def test_missing_optional_tokenizer_package_is_explained(tmp_path: Path) -> None:
    corpus = make_synthetic_corpus(tmp_path / "c.jsonl", num_docs=2)
    rc, err = _run([str(corpus), "-o", str(tmp_path / "o.tokens"), "--tokenizer", "hf:gpt2"])
    assert rc == 2 and "pip install tokenizers" in err


@pytest.mark.timeout(60)
def test_hf_tokenizer_file(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {
        "<unk>": 0,
        "</s>": 1,
        **{w: i + 2 for i, w in enumerate(["the", "cat", "sat", "on", "a", "mat"])},
    }
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok_file = tmp_path / "tokenizer.json"
    tok.save(str(tok_file))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "the cat sat"}\n{"text": "on a dog"}\n')
    rc, err = _run([str(corpus), "-o", str(tmp_path / "o.tokens"), "--tokenizer", f"hf:{tok_file}"])
    assert rc == 0, err
    ds = TokenDataset.open(tmp_path / "o.tokens")
    assert ds.tokens.tolist() == [2, 3, 4, 1, 5, 6, 0, 1] and ds.eos_id == 1


@pytest.mark.timeout(60)
def test_tiktoken_encoding(tmp_path: Path) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # its BPE file needs a download or a local cache
        pytest.skip(f"tiktoken gpt2 encoding unavailable offline: {e}")
    corpus = make_synthetic_corpus(tmp_path / "c.jsonl", num_docs=5)
    rc, err = _run([str(corpus), "-o", str(tmp_path / "o.tokens"), "--tokenizer", "tiktoken:gpt2"])
    assert rc == 0, err
    ds = TokenDataset.open(tmp_path / "o.tokens")
    first = json.loads(corpus.read_text().splitlines()[0])["text"]
    assert ds.document(0).tolist() == [*enc.encode_ordinary(first), enc.eot_token]
    assert ds.header.dtype == "uint16" and np.all(ds.tokens < enc.n_vocab)
