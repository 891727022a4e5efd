"""A worker's stderr as the launcher keeps it (launcher/output.py): passed through, its last lines
remembered for the error message, and kept in the worker's log file, bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpointless.launcher.output import OutputTail, worker_log

pytestmark = pytest.mark.timeout(30)


def _feed(data: bytes, log: Path | None, log_max: int = 1 << 20) -> OutputTail:
    r, w = os.pipe()
    tail = OutputTail(os.fdopen(r, "rb"), log=log, log_max=log_max)
    with os.fdopen(w, "wb") as f:
        f.write(data)
    tail.tail(wait=5.0)  # the pump has drained the pipe and closed the file
    return tail


def test_lines_are_kept_in_the_log_and_the_cause_is_found(tmp_path: Path) -> None:
    log = worker_log(tmp_path / "run", 3)
    lines = b"[rank 1 step 2] starting\nTraceback (most recent call last):\n  x\nValueError: bad batch\n"
    tail = _feed(lines, log)
    assert log == tmp_path / "run" / "logs" / "worker-3.log"
    assert log.read_bytes() == lines
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    assert tail.cause() == "ValueError: bad batch"


def test_the_log_stops_at_its_limit_and_the_pipe_still_drains(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "w.log"
    data = b"".join(b"line %06d\n" % i for i in range(20000))  # 220 kB, more than a pipe holds
    tail = _feed(data, log, log_max=1000)
    kept = log.read_bytes()
    assert len(kept) < 1100 and kept.endswith(b"log truncated here: it reached its size limit\n")
    assert data.startswith(kept[: kept.index(b"[launcher]")])
    assert tail.tail(1) == "line 019999"  # every line was read: the worker never blocked


def test_a_log_that_cannot_be_opened_leaves_the_pass_through_working(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "w.log").symlink_to(tmp_path / "elsewhere")
    tail = _feed(b"hello\n", tmp_path / "logs" / "w.log")
    assert tail.tail(1) == "hello"
    assert not (tmp_path / "elsewhere").exists()  # never written through a planted symlink
