"""A rank's commit log is rotated and summed up (recovery/commit_log.py): the run directory stays
bounded whatever the job's length, and the report read from it stays exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpointless.observe.ledger import build_ledger
from checkpointless.observe.report import main as report_main
from checkpointless.observe.runfiles import load_run
from checkpointless.recovery.commit_log import KEPT_GENERATIONS, ROTATE_BYTES, CommitLog
from tests.unit.observe.test_observe_ledger import T0, _job

pytestmark = pytest.mark.timeout(120)


def _write(d: Path, events: list[dict[str, Any]], commits: list[dict[str, Any]], cap: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    logs: dict[int, CommitLog] = {}
    for c in commits:
        r = c["rank"]
        if r not in logs:
            logs[r] = CommitLog(d / f"rank-{r}.jsonl", rotate_bytes=cap, rank=r, worker=r)
        fields = {k: v for k, v in c.items() if k not in ("event", "rank")}
        logs[r].emit("commit", **fields)
    for log in logs.values():
        log.close()


def _report(d: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert report_main([str(d), "--json", "-"]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_a_rotated_log_keeps_the_report_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Faults long rotated away are still charged exactly: the summaries keep the commits the
    ledger places them against, and the count of steps. (As in a real job, no rank commits more
    than one step between a fault and its detection: the others wait for the lost rank in the
    step's all-reduce.)"""
    events, commits = _job([(15.0, 0.02, 0.0), (30.0, 0.09, 0.3), (52.0, 0.05, 0.2)], end=60.0, steps=10_000)
    full = build_ledger(events, commits)
    _write(tmp_path / "run", events, commits, cap=2048)  # about 25 commits a file
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert files == ["events.jsonl", "rank-0.jsonl", "rank-0.jsonl.1", "rank-1.jsonl", "rank-1.jsonl.1"]
    run = load_run(tmp_path / "run")
    assert run.dropped[0]["commits"] > 400 and len(run.commits) < 200  # most commits are gone
    got = _report(tmp_path / "run", capsys)
    assert got["steps_committed"] == full.steps_committed > 400
    assert got["wall_s"] == pytest.approx(full.wall_s)
    for bucket, seconds in full.totals.items():
        assert got["totals_s"][bucket] == pytest.approx(seconds, abs=1e-6), bucket
    assert [f["phases"] for f in got["faults"]] == [pytest.approx(f.phases) for f in full.faults]
    assert got["step_time_s"] == pytest.approx(full.step_time_s)


def test_a_long_job_leaves_two_files_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """100k commits through the real writer, a recovery every 500 steps: rank 0's log stays at
    most two capped files, and the report still counts every step."""
    d = tmp_path / "run"
    d.mkdir()
    log = CommitLog(d / "rank-0.jsonl", rank=0, worker=0)
    n = 100_000
    # a commit line as a worker writes it, with the buddy figures that make it ~135 bytes
    extra = {"buddy": {"bytes": 123456, "wait_s": 0.0012}}
    for step in range(n):
        log.emit("commit", time=T0 + 1 + step * 0.01, step=step, generation=step // 500, **extra)
    log.close()
    line = len(
        json.dumps(
            {"time": T0, "event": "commit", "rank": 0, "worker": 0, "step": n, "generation": 200, **extra}
        )
    )
    sizes = {p.name: p.stat().st_size for p in d.iterdir()}
    assert set(sizes) == {"rank-0.jsonl", "rank-0.jsonl.1"}
    assert all(s <= ROTATE_BYTES + line + 1 for s in sizes.values()), sizes
    # the model in docs/operations.md: two files a rank, 8,000 ranks under 1 GB
    assert 8000 * 2 * (ROTATE_BYTES + line) < 1e9
    head = json.loads((d / "rank-0.jsonl").read_text().splitlines()[0])
    assert head["event"] == "commit_log" and len({k[2] for k in head["kept"]}) <= KEPT_GENERATIONS
    events = [
        {"time": T0, "event": "job_start", "job": "j", "nproc": 1, "pid": 1, "host": "h"},
        {"time": T0 + 1, "event": "started", "generation": 0},
        {"time": T0 + 1 + n * 0.01, "event": "job_end", "status": "ok"},
    ]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    got = _report(d, capsys)
    assert got["steps_committed"] == n
    assert got["step_time_s"] == pytest.approx(0.01)


def test_a_rank_taken_over_continues_its_log_s_counts(tmp_path: Path) -> None:
    """A spare that takes a rank over appends to its log: the counts carry on from the file."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "events.jsonl").write_text("")
    for part in range(3):
        log = CommitLog(d / "rank-0.jsonl", rotate_bytes=1500, rank=0, worker=part)
        for s in range(part * 300, (part + 1) * 300):
            log.emit("commit", time=T0 + s, step=s, generation=part)
        log.close()
    run = load_run(d)
    assert run.steps_committed(len({c["step"] for c in run.commits})) == 900
    assert run.dropped[0]["commits"] + len([c for c in run.commits if not c.get("kept")]) == 900
    gens = {c["generation"] for c in run.commits}
    assert gens == {0, 1, 2}  # every generation's boundary commits are kept


def test_a_follower_sees_every_commit_once_across_rotations(tmp_path: Path) -> None:
    """What the metrics endpoint needs of rank-0.jsonl: a LogTail polled while the real writer
    rotates (every ~25 commits here) returns each commit once, in order."""
    from checkpointless.observe.runfiles import LogTail

    log = CommitLog(tmp_path / "rank-0.jsonl", rotate_bytes=2048, rank=0, worker=0)
    tail = LogTail(tmp_path / "rank-0.jsonl")
    seen: list[int] = []
    for step in range(3000):
        log.emit("commit", step=step, generation=0)
        if step % 7 == 0:
            seen += [json.loads(x)["step"] for x in tail.poll() if b'"event":"commit"' in x]
    log.close()
    seen += [json.loads(x)["step"] for x in tail.poll() if b'"event":"commit"' in x]
    assert seen == list(range(3000))


def test_a_follower_that_misses_rotations_never_reads_a_reused_inode_from_an_old_offset(
    tmp_path: Path,
) -> None:
    """Polled less than once per rotation, a follower misses the files in between, but each line it
    returns is whole, once, and in order: the file it follows is held open, so a new log that
    reuses a freed inode is never mistaken for it and read from the old file's offset."""
    from checkpointless.observe.runfiles import LogTail

    log = CommitLog(tmp_path / "rank-0.jsonl", rotate_bytes=2048, rank=0, worker=0)
    tail = LogTail(tmp_path / "rank-0.jsonl")
    seen: list[int] = []
    for step in range(3000):
        log.emit("commit", step=step, generation=0)
        if step % 97 == 0:  # about four rotations between polls
            seen += [json.loads(x)["step"] for x in tail.poll() if b'"event":"commit"' in x]
    log.close()
    seen += [json.loads(x)["step"] for x in tail.poll() if b'"event":"commit"' in x]
    tail.close()
    assert seen == sorted(set(seen))  # whole lines, each once, in order
    assert seen[-1] == 2999  # and it always comes back to the current file
