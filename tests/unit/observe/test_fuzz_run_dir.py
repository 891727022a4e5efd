"""Property-based fuzzing of what is read from a run directory: the event logs behind `status` and
`report`, the agent's coordinator record, its secret file and the job's outcome.

Arbitrary bytes, or well-formed records with arbitrary values, give the readers' own error (a
``ConfigError`` naming FILE:LINE, exit 2) or a result, never another exception. Each property has
a fixed budget so the file runs in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from checkpointless.agent.join import job_outcome, read_secret
from checkpointless.errors import ConfigError
from checkpointless.launcher.runfiles import recorded_coordinator
from checkpointless.observe.report import main as report_main
from checkpointless.observe.runfiles import iter_jsonl, load_run
from checkpointless.observe.status import main as status_main

pytestmark = pytest.mark.timeout(180)
BUDGET = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fuzz-run-dir-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fresh(scratch: Path) -> Path:
    d = scratch / "run"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    return d


# -- the event logs ------------------------------------------------------------------------


@BUDGET
@given(data=st.binary(max_size=4096), rank_log=st.binary(max_size=2048))
def test_arbitrary_bytes_give_a_run_or_a_config_error(scratch: Path, data: bytes, rank_log: bytes) -> None:
    d = _fresh(scratch)
    (d / "events.jsonl").write_bytes(data)
    (d / "rank-0.jsonl").write_bytes(rank_log)
    try:
        run = load_run(d)
    except ConfigError as e:
        assert str(d) in str(e) and "\n" not in str(e)
        return
    assert all(isinstance(e["time"], int | float) for e in run.events)


@BUDGET
@given(lines=st.lists(st.binary(max_size=200).filter(lambda b: b"\n" not in b), max_size=20))
def test_arbitrary_lines_name_the_line_that_is_wrong(scratch: Path, lines: list[bytes]) -> None:
    d = _fresh(scratch)
    path = d / "events.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    try:
        list(iter_jsonl(path))
    except ConfigError as e:
        at = str(e).split(": ", 1)[0]
        assert at.startswith(f"{path}:"), str(e)
        lineno = int(at.rsplit(":", 1)[1])
        assert 1 <= lineno <= len(lines)


_KINDS = ["job_start", "job_end", "spawn", "spare_ready", "spare_assigned", "spare_lost", "started"]
_KINDS += ["recovery", "fault", "commit", "condition"]
_FIELDS = ["nproc", "pid", "host", "job", "status", "worker", "role", "rank", "generation", "step"]
_FIELDS += ["downtime_s", "detect_s", "collect_s", "rebuild_s", "transfer_s", "first_step_s", "kind"]
_FIELDS += ["state_bytes", "first_batch_s", "rolled_forward"]
_SMALL = st.integers(min_value=-3, max_value=6)
_VALUES = st.one_of(
    _SMALL,
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.lists(st.dictionaries(st.sampled_from(["time", "rank", "kind"]), _SMALL, max_size=3), max_size=2),
)
_RECORDS = st.lists(
    st.builds(
        lambda kind, t, extra: {"time": t, "event": kind, **extra},
        st.sampled_from(_KINDS),
        st.floats(min_value=0, max_value=50),
        st.dictionaries(st.sampled_from([*_FIELDS, "faults"]), _VALUES, max_size=6),
    ),
    max_size=25,
)


@BUDGET
@given(events=_RECORDS, commits=_RECORDS)
# found by a run of this test (session 35): a fault whose generation is null crashed status
@example(events=[{"time": 1.0, "event": "fault", "nproc": None, "generation": None}], commits=[])
def test_status_and_report_of_any_records_exit_0_or_2(
    scratch: Path, events: list[dict[str, Any]], commits: list[dict[str, Any]]
) -> None:
    """Well-formed JSON with arbitrary values: checked where it is read, so nothing deeper fails."""
    d = _fresh(scratch)
    start = {"time": 0, "event": "job_start", "nproc": 2, "pid": 1 << 30, "host": "h"}
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [start, *events]))
    (d / "rank-0.jsonl").write_text("".join(json.dumps({**c, "rank": 0}) + "\n" for c in commits))
    for main, args in ((status_main, ["--json"]), (report_main, ["--no-plot", "--json", "-"])):
        assert main([str(d), *args]) in (0, 2)


# -- the agent's readers -------------------------------------------------------------------


@BUDGET
@given(raw=st.binary(max_size=300))
def test_the_coordinator_record_is_an_address_or_none(scratch: Path, raw: bytes) -> None:
    path = _fresh(scratch) / "coordinator"
    path.write_bytes(raw)
    got = recorded_coordinator(path)
    if got is not None:
        host, _, port = got.rpartition(":")
        assert host and 0 < int(port) < 65536 and got.isascii() and "\n" not in got


@BUDGET
@given(raw=st.binary(max_size=300))
def test_the_secret_reader_returns_the_secret_or_a_config_error(scratch: Path, raw: bytes) -> None:
    path = _fresh(scratch) / "secret"
    path.write_bytes(raw)
    try:
        got = read_secret(path, deadline=time.monotonic())  # no waiting: the file is there
    except ConfigError:
        return
    assert got and got == raw.strip()


@BUDGET
@given(tail=st.binary(max_size=2000), deep=st.integers(min_value=0, max_value=2))
def test_the_job_outcome_reader_never_raises(scratch: Path, tail: bytes, deep: int) -> None:
    d = _fresh(scratch)
    nested = b'{"event":"job_end","status":' + b"[" * 10**deep + b"]" * 10**deep + b"}\n"
    (d / "events.jsonl").write_bytes(b'{"time":1,"event":"job_start"}\n' + tail + b"\n" + nested)
    got = job_outcome(d)
    assert got is None or isinstance(got, str)


def test_the_job_outcome_of_a_deeply_nested_end_record_is_none(tmp_path: Path) -> None:
    deep = b"[" * 20_000 + b"]" * 20_000  # within the 64 KiB tail that it reads
    (tmp_path / "events.jsonl").write_bytes(b'{"event":"job_end","status":' + deep + b"}\n")
    assert job_outcome(tmp_path) is None


def _does_not_block(fn: Any, fifo: Path) -> tuple[bool, Any]:
    """Run ``fn`` in a thread for 3 s; a reader stuck on the FIFO is released by opening its other end."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except Exception as e:
            box["value"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(3.0)
    stuck = t.is_alive()
    if stuck:  # a blocked open() of a FIFO returns once a writer opens it; EOF follows its close
        with open(fifo, "wb"):
            pass
        t.join(5.0)
    return not stuck, box.get("value")


def test_a_fifo_as_the_coordinator_record_is_no_record(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "coordinator")
    done, got = _does_not_block(
        lambda: recorded_coordinator(tmp_path / "coordinator"), tmp_path / "coordinator"
    )
    assert done and got is None


def test_a_fifo_as_the_event_log_does_not_block_the_job_outcome(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "events.jsonl")
    done, got = _does_not_block(lambda: job_outcome(tmp_path), tmp_path / "events.jsonl")
    assert done and got is None


def test_a_fifo_as_the_secret_file_is_a_clear_error_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "secret")
    done, got = _does_not_block(
        lambda: read_secret(tmp_path / "secret", time.monotonic() + 1), tmp_path / "secret"
    )
    assert done and isinstance(got, ConfigError) and "regular file" in str(got)


def test_an_empty_secret_file_is_called_empty(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"\bempty\b"):
        read_secret(tmp_path / "secret", time.monotonic())


def test_an_oversized_secret_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    with open(tmp_path / "secret", "wb") as f:
        f.truncate(64 << 20)  # sparse: no disk; a secret is 32 bytes
    with pytest.raises(ConfigError):
        read_secret(tmp_path / "secret", time.monotonic())
