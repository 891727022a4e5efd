"""Token-file headers: every wrong type or range is a DataError naming the field, before any large
allocation; ids beyond the vocabulary are caught when the file is opened; random headers never
raise anything but DataError."""

from __future__ import annotations

import hashlib
import json
import resource
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointless.data import TokenDataset, read_header, write_token_file
from checkpointless.data.format import FORMAT_VERSION, MAX_VOCAB, TokenFileHeader
from checkpointless.data.format_check import scan_max_token
from checkpointless.errors import DataError

FIX = "checkpointless data prepare"


def _fields(path: Path) -> dict[str, object]:
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<I", raw, 8)
    return json.loads(raw[12 : 12 + length])  # type: ignore[no-any-return]


def _put_header(path: Path, fields: object, *, raw_body: bytes | None = None) -> None:
    data = bytearray(path.read_bytes())
    body = raw_body if raw_body is not None else json.dumps(fields, sort_keys=True).encode()
    page = struct.pack("<8sI", b"CKPLTOK1", len(body)) + body
    data[0:4096] = page[:4096] + b"\0" * (4096 - min(len(page), 4096))
    path.write_bytes(bytes(data))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "d.tokens"
    rng = np.random.default_rng(0)
    write_token_file(
        path, [rng.integers(0, 1000, size=300) for _ in range(5)], 1000, eos_id=999, chunk_bytes=64
    )
    return path


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"vocab_size": "1000"}, "vocab_size is '1000', not an integer"),
        ({"vocab_size": True}, "vocab_size is True, not an integer"),
        ({"vocab_size": 1000.0}, "vocab_size is 1000.0, not an integer"),
        (
            {"vocab_size": 1 << 32, "dtype": "uint32"},
            f"vocab_size {1 << 32} is out of range (1 to {MAX_VOCAB:,})",
        ),
        ({"vocab_size": 0}, "vocab_size 0 is out of range"),
        ({"num_tokens": -5}, "num_tokens is -5, a negative count"),
        ({"num_tokens": None}, "num_tokens is None, not an integer"),
        ({"num_docs": [1]}, "num_docs is [1], not an integer"),
        ({"num_tokens": 10**30}, "do not match its sizes"),
        ({"file_size": 10**12}, "do not match its sizes"),
        ({"chunk_bytes": 3}, "chunk_bytes 3 is not a multiple of 8"),
        ({"chunk_bytes": 1 << 40}, "chunk_bytes 1099511627776 is not a multiple of 8 from 64"),
        ({"eos_id": "x"}, "eos_id is 'x', not a token id"),
        ({"eos_id": 1000}, "eos_id 1000 is outside the vocabulary"),
        ({"max_token_id": 1000}, "max_token_id 1000 is not below vocab_size 1000"),
        ({"max_token_id": -1}, "max_token_id is -1, not a token id"),
        ({"max_token_id": None}, "max_token_id None contradicts num_tokens"),
        ({"dtype": 16}, "dtype is 16, not a string"),
        ({"tokenizer": 7}, "tokenizer is 7, not a string"),
        ({"fingerprint": "zz"}, "fingerprint is 'zz', not a sha256"),
        ({"format_version": True}, "format version True is not supported"),
        ({"format_version": "2"}, "format version '2' is not supported"),
        ({"surprise": 1}, "unknown field 'surprise'"),
    ],
)
def test_bad_header_fields_name_the_field(token_file: Path, change: dict[str, object], needle: str) -> None:
    fields = _fields(token_file)
    fields.update(change)
    _put_header(token_file, fields)
    with pytest.raises(DataError) as e:
        TokenDataset.open(token_file, verify="quick")
    msg = str(e.value)
    assert needle in msg and str(token_file) in msg and FIX in msg, msg


@pytest.mark.timeout(20)
def test_missing_field_and_non_object_header(token_file: Path) -> None:
    fields = _fields(token_file)
    del fields["num_docs"]
    _put_header(token_file, fields)
    with pytest.raises(DataError, match="lacks the field 'num_docs'"):
        read_header(token_file)
    _put_header(token_file, [1, 2, 3])
    with pytest.raises(DataError, match="header is a JSON list, not an object"):
        read_header(token_file)
    _put_header(token_file, None, raw_body=b"[" * 4000)
    with pytest.raises(DataError, match="not valid JSON"):
        read_header(token_file)


@pytest.mark.timeout(20)
def test_one_token_beyond_the_vocab_is_caught_by_quick_verify(token_file: Path) -> None:
    header = read_header(token_file)
    assert header.format_version == FORMAT_VERSION and header.max_token_id == 999
    raw = bytearray(token_file.read_bytes())
    struct.pack_into("<H", raw, 4096 + 2 * 777, 4321)  # token 777 -> an id the model cannot embed
    token_file.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        TokenDataset.open(token_file, verify="quick")
    assert "token 777 has id 4321, beyond the vocabulary [0, 1000)" in str(e.value)
    with pytest.raises(DataError, match="fingerprint mismatch: token bytes"):
        TokenDataset.open(token_file, verify="full")


@pytest.mark.timeout(20)
def test_quick_verify_catches_a_changed_largest_id(tmp_path: Path) -> None:
    path = tmp_path / "d.tokens"
    write_token_file(path, [np.array([1, 2, 3, 500])], 1000, eos_id=None, chunk_bytes=64)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, 4096 + 2 * 1, 900)  # still inside the vocab, but above the recorded max
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"largest token id is 900 .* header records 500"):
        TokenDataset.open(path, verify="quick")


def _as_version_1(path: Path) -> None:
    """Rewrite a file as the version-1 writer made it: no max_token_id, fingerprint without it."""
    fields = _fields(path)
    del fields["max_token_id"]
    fields["format_version"] = 1
    header = TokenFileHeader(**fields)  # type: ignore[arg-type]
    table = path.read_bytes()[header.chunks_offset :]
    fields["fingerprint"] = hashlib.sha256(header.canonical_json() + table).hexdigest()
    _put_header(path, fields)


@pytest.mark.timeout(20)
def test_version_1_files_are_read_and_their_max_is_scanned(token_file: Path) -> None:
    _as_version_1(token_file)
    ds = TokenDataset.open(token_file, verify="full")
    assert ds.header.format_version == 1 and ds.max_token_id is None
    assert scan_max_token(token_file, ds.header)[0] == int(np.asarray(ds.tokens).max())
    raw = bytearray(token_file.read_bytes())
    struct.pack_into("<H", raw, 4096 + 2 * 5, 1000)  # exactly vocab_size: one past the last id
    token_file.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="token 5 has id 1000, beyond the vocabulary"):
        TokenDataset.open(token_file, verify="quick")


# --- fuzzing: random and garbled headers --------------------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _open_must_fail_cleanly(path: Path) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        TokenDataset.open(path, verify="quick")
    except DataError:
        pass
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 256 * 1024, f"opening a garbled header grew the process by {grown_kb} kB"


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(sorted(TokenFileHeader.__dataclass_fields__)), value=_json_values)
def test_fuzz_one_field(token_file: Path, field: str, value: object) -> None:
    # Keep a pristine copy: hypothesis reuses the fixture across examples.
    pristine = token_file.with_suffix(".orig")
    if not pristine.exists():
        pristine.write_bytes(token_file.read_bytes())
    token_file.write_bytes(pristine.read_bytes())
    fields = _fields(token_file)
    fields[field] = value
    _put_header(token_file, fields)
    _open_must_fail_cleanly(token_file)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.binary(max_size=600) | _json_values.map(lambda v: json.dumps(v).encode()),
    length=st.integers(0, 2**32 - 1),
)
def test_fuzz_whole_header(token_file: Path, body: bytes, length: int) -> None:
    data = bytearray(token_file.read_bytes())
    page = struct.pack("<8sI", b"CKPLTOK1", length) + body
    data[0 : len(page)] = page
    token_file.write_bytes(bytes(data))
    _open_must_fail_cleanly(token_file)
