"""Token file format: round trip, atomic writes, and every validation error a reader can meet."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from checkpointless.data import TokenDataset, TokenFileWriter, read_header, write_token_file
from checkpointless.errors import ConfigError, DataError

FIX = "checkpointless data prepare"


def _docs(seed: int = 0, n: int = 40, vocab: int = 1000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=int(rng.integers(0, 300))) for _ in range(n)]
    docs[3] = np.zeros(0, dtype=np.int64)  # an empty document must keep its place in the index
    return docs


def _rewrite_header(path: Path, **changes: object) -> None:
    """Edit header fields in place, keeping the file size, as a buggy or hostile writer might."""
    raw = bytearray(path.read_bytes())
    magic, length = struct.unpack_from("<8sI", raw)
    fields = json.loads(raw[12 : 12 + length])
    fields.update(changes)
    body = json.dumps(fields, sort_keys=True).encode()
    raw[0:4096] = struct.pack("<8sI", magic, len(body)) + body + b"\0" * (4096 - 12 - len(body))
    path.write_bytes(bytes(raw))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "d.tokens"
    # 64-byte chunks: a few thousand tokens span many chunks, so chunk boundaries are exercised.
    write_token_file(path, _docs(), vocab_size=1000, eos_id=999, tokenizer="test", chunk_bytes=64)
    return path


@pytest.mark.timeout(20)
def test_round_trip_tokens_index_and_header(token_file: Path) -> None:
    docs = _docs()
    ds = TokenDataset.open(token_file)
    assert ds.num_docs == len(docs)
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert ds.header.dtype == "uint16" and ds.vocab_size == 1000 and ds.eos_id == 999
    assert ds.header.tokenizer == "test"
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds.document(i), d)
    assert isinstance(ds.tokens, np.memmap)  # mapped, not read into memory
    assert ds.sample(2, 10).tolist() == np.concatenate(docs)[20:31].tolist()
    assert [p.name for p in token_file.parent.iterdir()] == ["d.tokens"]  # no temporary file left


@pytest.mark.timeout(20)
def test_fingerprint_is_a_function_of_content(tmp_path: Path) -> None:
    a = write_token_file(tmp_path / "a.tokens", _docs(), vocab_size=1000, chunk_bytes=64)
    b = write_token_file(tmp_path / "b.tokens", _docs(), vocab_size=1000, chunk_bytes=64)
    c = write_token_file(tmp_path / "c.tokens", _docs(seed=1), vocab_size=1000, chunk_bytes=64)
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != c.fingerprint


@pytest.mark.timeout(20)
def test_large_vocab_uses_uint32(tmp_path: Path) -> None:
    path = tmp_path / "big.tokens"
    write_token_file(path, [np.array([0, 70000, 123456])], vocab_size=200_000)
    ds = TokenDataset.open(path)
    assert ds.header.dtype == "uint32"
    assert ds.tokens.tolist() == [0, 70000, 123456]


@pytest.mark.timeout(20)
def test_failed_write_leaves_previous_file_and_no_temp(token_file: Path) -> None:
    before = token_file.read_bytes()
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        write_token_file(token_file, [np.array([1, 2]), np.array([5000])], vocab_size=1000)
    assert token_file.read_bytes() == before
    assert [p.name for p in token_file.parent.iterdir()] == ["d.tokens"]
    w = TokenFileWriter(token_file.parent / "never.tokens", vocab_size=10)
    w.add_document([1, 2, 3])
    w.abort()
    assert [p.name for p in token_file.parent.iterdir()] == ["d.tokens"]


@pytest.mark.timeout(20)
def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.tokens"
    with pytest.raises(DataError) as e:
        TokenDataset.open(path)
    assert str(path) in str(e.value) and "not found" in str(e.value) and FIX in str(e.value)


@pytest.mark.timeout(20)
def test_truncated_file(token_file: Path) -> None:
    data = token_file.read_bytes()
    token_file.write_bytes(data[:-10])
    with pytest.raises(DataError) as e:
        TokenDataset.open(token_file)
    msg = str(e.value)
    assert str(token_file) in msg and "truncated" in msg and str(len(data) - 10) in msg and FIX in msg
    token_file.write_bytes(data[:100])  # not even a whole header page
    with pytest.raises(DataError, match="truncated"):
        TokenDataset.open(token_file)


@pytest.mark.timeout(20)
def test_wrong_dtype(token_file: Path) -> None:
    _rewrite_header(token_file, dtype="float32")
    with pytest.raises(DataError) as e:
        TokenDataset.open(token_file)
    assert str(token_file) in str(e.value) and "dtype 'float32'" in str(e.value) and FIX in str(e.value)


@pytest.mark.timeout(20)
def test_other_format_version(token_file: Path) -> None:
    _rewrite_header(token_file, format_version=3, new_field=1)
    with pytest.raises(DataError, match="format version 3 is not supported"):
        TokenDataset.open(token_file)


@pytest.mark.timeout(20)
def test_dtype_that_contradicts_vocab(token_file: Path) -> None:
    _rewrite_header(token_file, dtype="uint32")
    with pytest.raises(DataError, match="does not match vocab_size"):
        TokenDataset.open(token_file)


@pytest.mark.timeout(20)
def test_modified_tokens_fail_full_verification(token_file: Path) -> None:
    raw = bytearray(token_file.read_bytes())
    raw[4096 + 300] ^= 0x01  # inside the 5th 64-byte chunk of token bytes
    token_file.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        TokenDataset.open(token_file)
    msg = str(e.value)
    assert str(token_file) in msg and "fingerprint mismatch" in msg and "256..320" in msg and FIX in msg
    # The quick check is documented to cover only header, sizes and the chunk table.
    assert TokenDataset.open(token_file, verify="quick").num_docs == 40


@pytest.mark.timeout(20)
def test_modified_header_fails_even_quick_verification(token_file: Path) -> None:
    _rewrite_header(token_file, eos_id=5)
    with pytest.raises(DataError, match="fingerprint mismatch") as e:
        TokenDataset.open(token_file, verify="quick")
    assert str(token_file) in str(e.value)


@pytest.mark.timeout(20)
def test_modified_index_fails_full_verification(token_file: Path) -> None:
    header = read_header(token_file)
    raw = bytearray(token_file.read_bytes())
    raw[header.index_offset + 8] ^= 0x01
    token_file.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="document index was modified"):
        TokenDataset.open(token_file)


@pytest.mark.timeout(20)
def test_not_a_token_file(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "hello"}\n' * 400)
    with pytest.raises(DataError) as e:
        TokenDataset.open(path)
    assert "not a checkpointless token file" in str(e.value) and str(path) in str(e.value)


@pytest.mark.timeout(20)
def test_unknown_verify_mode_is_a_config_error(token_file: Path) -> None:
    with pytest.raises(ConfigError, match="verify"):
        TokenDataset.open(token_file, verify="none")  # type: ignore[arg-type]
