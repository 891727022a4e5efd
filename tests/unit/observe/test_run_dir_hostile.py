"""`checkpointless status` and `report` on hostile run directories: random bytes, numbers out of
range, deep nesting, wrong field types, a garbage rank log, symlinks and FIFOs, an over-long line.
Each gives one error line that names FILE:LINE (or the file) and exit 2, never a traceback; and a
large event log is streamed, not loaded whole (peak RSS measured in a child process)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from checkpointless.observe.report import main as report_main
from checkpointless.observe.runfiles import MAX_LINE, load_run
from checkpointless.observe.status import main as status_main

T0 = 1000.0
pytestmark = pytest.mark.timeout(120)


def _line(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":")) + "\n"


def write_run(d: Path, steps: int = 20) -> Path:
    """A small finished job of two ranks: events.jsonl and rank-0/1.jsonl."""
    d.mkdir(parents=True, exist_ok=True)
    ev = [
        {"time": T0, "event": "job_start", "job": "j", "nproc": 2, "pid": 1 << 30, "host": "h"},
        {"time": T0 + 0.1, "event": "spawn", "worker": 0, "role": "worker", "pid": 100},
        {"time": T0 + 0.1, "event": "spawn", "worker": 1, "role": "worker", "pid": 101},
        {"time": T0 + 1, "event": "started", "generation": 0},
    ]
    for r in range(2):
        with open(d / f"rank-{r}.jsonl", "w") as f:
            for s in range(steps):
                f.write(_line({"time": T0 + 1 + 0.1 * (s + 1), "event": "commit", "rank": r, "step": s}))
    ev.append({"time": T0 + 2 + 0.1 * steps, "event": "job_end", "status": "ok"})
    (d / "events.jsonl").write_text("".join(_line(e) for e in ev))
    return d


def _events_with(first: str) -> Callable[[Path], str]:
    """events.jsonl whose first line is ``first``; the error names line 1."""

    def make(d: Path) -> str:
        good = (d / "events.jsonl").read_text()
        (d / "events.jsonl").write_text(first + "\n" + good)
        return "events.jsonl:1: "

    return make


def _random_bytes(d: Path) -> str:
    data = random.Random(7).randbytes(8192)
    (d / "events.jsonl").write_bytes(data)
    return r"events.jsonl:\d+: "


def _garbage_rank_log(d: Path) -> str:
    with open(d / "rank-0.jsonl", "ab") as f:
        f.write(
            b"\x00\xff garbage \x13\n"
            + _line({"time": T0 + 5, "event": "commit", "rank": 0, "step": 99}).encode()
        )
    return r"rank-0.jsonl:21: "


def _commit_of_another_rank(d: Path) -> str:
    with open(d / "rank-1.jsonl", "a") as f:
        f.write(_line({"time": T0 + 5, "event": "commit", "rank": 0, "step": 99}))
    return r"rank-1.jsonl holds a record of rank 0"


def _symlinked_events(d: Path) -> str:
    real = d.parent / "elsewhere.jsonl"
    (d / "events.jsonl").rename(real)
    (d / "events.jsonl").symlink_to(real)
    return r"events.jsonl is a symlink"


def _symlinked_rank_log(d: Path) -> str:
    real = d.parent / "elsewhere.jsonl"
    (d / "rank-1.jsonl").rename(real)
    (d / "rank-1.jsonl").symlink_to(real)
    return r"rank-1.jsonl is a symlink"


def _fifo_events(d: Path) -> str:
    (d / "events.jsonl").unlink()
    os.mkfifo(d / "events.jsonl")  # opening one for reading with no writer must not block
    return r"events.jsonl is not a regular file"


def _fifo_rank_log(d: Path) -> str:
    (d / "rank-0.jsonl").unlink()
    os.mkfifo(d / "rank-0.jsonl")
    return r"rank-0.jsonl is not a regular file"


def _long_line(d: Path) -> str:
    with open(d / "events.jsonl", "r+") as f:
        lines = f.readlines()
        lines.insert(1, _line({"time": T0, "event": "note", "pad": "x" * MAX_LINE}))
        f.seek(0)
        f.writelines(lines)
    return r"events.jsonl:2: line longer than 64 KiB"


def _bad_commit_step(d: Path) -> str:
    with open(d / "rank-1.jsonl", "a") as f:
        f.write(_line({"time": T0 + 5, "event": "commit", "rank": 1, "step": "x"}))
    return r"rank-1.jsonl:21: field 'step' must be an integer"


def _bad_recovery(d: Path) -> str:
    with open(d / "events.jsonl", "a") as f:
        f.write(
            _line({"time": T0 + 3, "event": "recovery", "generation": 1, "downtime_s": 0.5, "faults": [7]})
        )
    return r"events.jsonl:6: a fault in 'faults' must be an object"


DEEP = 20_000  # within the line cap, past the parser's recursion limit
CASES: dict[str, Callable[[Path], str]] = {
    "random bytes": _random_bytes,
    "nproc 1e999": _events_with('{"time":1000,"event":"job_start","nproc":1e999,"pid":1}'),
    "nproc huge integer": _events_with('{"time":1000,"event":"job_start","nproc":' + "9" * 5000 + "}"),
    "nproc a string": _events_with('{"time":1000,"event":"job_start","nproc":"2"}'),
    "NaN time": _events_with('{"time":NaN,"event":"job_start","nproc":2}'),
    "deeply nested array": _events_with("[" * DEEP + "]" * DEEP),
    "deeply nested field": _events_with('{"time":1,"event":"x","a":' + "[" * DEEP + "]" * DEEP + "}"),
    "time is a string": _events_with('{"time":"x","event":"job_start","nproc":2}'),
    "not an object": _events_with("[1, 2, 3]"),
    "no event name": _events_with('{"time":1000}'),
    "garbage rank-0.jsonl": _garbage_rank_log,
    "commit of another rank": _commit_of_another_rank,
    "commit step a string": _bad_commit_step,
    "recovery fault not an object": _bad_recovery,
    "symlinked events.jsonl": _symlinked_events,
    "symlinked rank log": _symlinked_rank_log,
    "FIFO events.jsonl": _fifo_events,
    "FIFO rank log": _fifo_rank_log,
    "line over the cap": _long_line,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["status", "report"])
def test_a_hostile_run_dir_gives_one_error_line_and_exit_2(
    case: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = write_run(tmp_path / "run")
    want = CASES[case](d)
    main = status_main if command == "status" else report_main
    rc = main([str(d), "--json"] if command == "status" else [str(d), "--no-plot"])
    out = capsys.readouterr()
    assert rc == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith(f"checkpointless {command}: error: {d}/"), lines[0]
    assert re.search(want, lines[0]), lines[0]
    assert len(lines[0]) < 400
    assert out.out == ""


def test_the_cli_prints_no_traceback_on_a_hostile_run_dir(tmp_path: Path) -> None:
    """The same through the real command line, in a child process."""
    d = write_run(tmp_path / "run")
    _events_with('{"time":"x","event":"job_start","nproc":2}')(d)
    for command in ("status", "report"):
        res = subprocess.run(
            [sys.executable, "-m", "checkpointless", command, str(d)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr
        assert res.stderr.strip().splitlines() == [
            f"checkpointless {command}: error: {d}/events.jsonl:1: field 'time' must be a number >= 0 (got \"x\")"
        ]


def test_a_torn_last_line_is_skipped_but_a_bad_complete_one_is_not(tmp_path: Path) -> None:
    d = write_run(tmp_path / "run")
    with open(d / "rank-0.jsonl", "a") as f:
        f.write('{"time":1003.5,"event":"commit","ra')  # a writer died mid line
    run = load_run(d)
    assert len([c for c in run.commits if c["rank"] == 0]) == 20
    with open(d / "rank-0.jsonl", "a") as f:
        f.write("\n")  # now a complete line that is not JSON: damage, not a torn write
    with pytest.raises(ValueError, match=r"rank-0.jsonl:21: is not a JSON line"):
        load_run(d)


def test_a_healthy_run_dir_reads_as_before(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = write_run(tmp_path / "run")
    assert status_main([str(d), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "finished" and st["steps_committed"] == 20 and st["nproc"] == 2
    assert [r["step"] for r in st["ranks"]] == [19, 19]
    assert st["ranks"][0]["step_time_s"] == pytest.approx(0.1)


_PEAK = textwrap.dedent(
    """
    import resource, sys
    from checkpointless.observe.{mod} import main
    rc = main(sys.argv[1:])
    print("RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc, file=sys.stderr)
    """
)


def _peak_kib(command: str, args: list[str]) -> int:
    res = subprocess.run(
        [sys.executable, "-c", _PEAK.format(mod=command), *args], capture_output=True, text=True, timeout=100
    )
    m = re.search(r"^RSS (\d+) 0$", res.stderr, re.M)
    assert m, res.stderr[-2000:]
    return int(m.group(1))


@pytest.mark.timeout(180)
def test_a_large_event_log_is_streamed_in_bounded_memory(tmp_path: Path) -> None:
    """200 MB of valid lines in events.jsonl: status and report's peak RSS stays within a few MB of
    theirs on the small job (reading it whole took about 2x the file's size)."""
    small = write_run(tmp_path / "small")
    big = write_run(tmp_path / "big")
    head, *rest = (big / "events.jsonl").read_text().splitlines(keepends=True)
    pad = "p" * 900
    block = "".join(
        _line({"time": T0 + 1.5, "event": "condition", "name": f"c{i}", "active": True, "note": pad})
        for i in range(1000)
    )
    size = 200 * 1024 * 1024
    with open(big / "events.jsonl", "w") as f:
        f.write(head)
        written = 0
        while written < size:
            f.write(block)
            written += len(block)
        f.writelines(rest)
    assert (big / "events.jsonl").stat().st_size > size
    for command, extra in (("status", ["--json"]), ("report", ["--no-plot"])):
        base = _peak_kib(command, [str(small), *extra])
        peak = _peak_kib(command, [str(big), *extra])
        assert peak - base < 20 * 1024, (command, base, peak)  # KiB: 20 MB against a 200 MB file


def test_the_timeline_of_a_thousand_ranks_and_a_rankless_fault_is_drawn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Values a reader accepts draw too: lanes are capped (MAX_LANES), a fault of no rank is no marker."""
    pytest.importorskip("matplotlib")
    d = write_run(tmp_path / "run")
    text = (d / "events.jsonl").read_text().replace('"nproc":2', '"nproc":1000')
    extra = _line({"time": T0 + 1.5, "event": "fault", "kind": "host_lost", "generation": 0})
    (d / "events.jsonl").write_text(text + extra)
    png = tmp_path / "t.png"
    assert report_main([str(d), "--png", str(png)]) == 0, capsys.readouterr().err
    assert png.stat().st_size < 2_000_000
