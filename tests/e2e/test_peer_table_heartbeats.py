"""Heartbeats aggregated by the agent (agent/beats.py): a real process writes its record and is
stopped and resumed; the coordinator reads an agent's rows exactly as the workers' own
heartbeats; a real job runs past its hang timeout on aggregated beats alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpointless.coordinator import Coordinator
from checkpointless.protocol import AgentHeartbeat, Heartbeat, ProtocolError, decode, encode
from checkpointless.protocol.beats import (
    BeatReader,
    BeatWriter,
    WorkerBeat,
    beats_message,
    beats_of,
    make_beat_dir,
)
from tests.helpers.coordinator import new_coordinator
from tests.helpers.jobs import ROOT, start_job
from tests.helpers.wait import deadline_in, wait_for

SLOW = ROOT / "tests" / "scripts" / "slow_steps.py"

WRITER = """
import sys, time
from pathlib import Path
from checkpointless.protocol.beats import BeatWriter
from checkpointless.protocol import Heartbeat
w = BeatWriter(Path(sys.argv[1]))
step = 0
print("ready", flush=True)
while True:
    step += 1
    w.write(Heartbeat(step=step, progress_age=0.01, in_collective=step % 2 == 0, step_time=0.2), time.monotonic())
    time.sleep(0.02)
"""


def test_a_stopped_writer_stops_beating_and_resumes_after_sigcont(tmp_path: Path) -> None:
    reader = BeatReader(make_beat_dir(tmp_path / "job" / "beats"))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(reader.path(7))], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        first = wait_for(lambda: reader.read([7], time.monotonic()), deadline_in(10), "no beat")
        b = first[0]
        assert b.worker_id == 7 and b.step_time == 0.2 and b.progress_age == 0.01 and 0 <= b.age < 5
        time.sleep(0.1)
        later = wait_for(lambda: reader.read([7], time.monotonic()), deadline_in(10), "no second beat")
        assert later[0].step is not None and b.step is not None and later[0].step > b.step
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        reader.read([7], time.monotonic())  # what it wrote before it stopped
        time.sleep(0.3)
        assert reader.read([7], time.monotonic()) == [], "a stopped process must not look alive"
        proc.send_signal(signal.SIGCONT)
        resumed = wait_for(
            lambda: reader.read([7], time.monotonic()), deadline_in(10), "no beat after SIGCONT"
        )
        assert resumed[0].step is not None and resumed[0].step > later[0].step
    finally:
        proc.kill()
        proc.wait(timeout=10)
        reader.close()
    assert reader.read([], time.monotonic()) == []


def test_a_beat_dir_of_someone_else_or_too_open_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "job"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    with pytest.raises(OSError, match="not a private directory"):
        make_beat_dir(open_dir / "beats")


def test_rows_survive_the_wire_and_bad_columns_are_a_protocol_error() -> None:
    beats = [
        WorkerBeat(3, 0.1, 12, 0.05, True, 0.3),
        WorkerBeat(4, 0.0, None, None, False, None),
    ]
    wire = json.loads(json.dumps(encode(beats_message(beats, 1e9))))
    msg = decode(wire)
    assert isinstance(msg, AgentHeartbeat) and beats_of(msg) == beats
    wire["ages"] = [0.1]
    with pytest.raises(ProtocolError, match="columns"):
        beats_of(decode(wire))  # type: ignore[arg-type]


def _coordinator() -> Coordinator:
    c = new_coordinator(2, 0)
    c.start(10.0)
    c.drain()
    for wid in range(2):
        assert c.on_connected(wid, 10.0)
    c.drain()
    return c


def test_an_agents_row_is_the_workers_own_heartbeat_received_age_seconds_earlier() -> None:
    direct, aggregated = _coordinator(), _coordinator()
    hb = Heartbeat(step=5, progress_age=0.4, in_collective=True, step_time=0.25)
    direct.on_message(0, hb, 19.7, 1e9)
    aggregated.on_beats(0, [WorkerBeat(0, 0.3, 5, 0.4, True, 0.25)], 20.0)
    a, b = direct.procs[0], aggregated.procs[0]
    fields = ("step", "in_collective", "step_time", "progress_known")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert b.last_message == pytest.approx(a.last_message) and b.last_progress == pytest.approx(
        a.last_progress
    )
    # an older row never moves the clock back; a row naming another host's process is ignored
    aggregated.on_beats(0, [WorkerBeat(0, 5.0, 1, 0.0, False, None)], 20.1)
    assert aggregated.procs[0].last_message == pytest.approx(19.7)
    aggregated.on_beats(1, [WorkerBeat(1, 0.0, 9, 0.0, False, None)], 20.1)
    assert aggregated.procs[1].step is None


@pytest.mark.timeout(180)
def test_a_job_lives_past_its_hang_timeout_on_aggregated_beats_and_leaves_no_shm(tmp_path: Path) -> None:
    """Workers send no heartbeat frames when their agent reads their records: were the agent's
    rows lost, the coordinator would judge both ranks hung after --hang-timeout."""
    run_dir = tmp_path / "run"
    job = start_job(run_dir, tmp_path, nproc=2, spares=0, script=SLOW, script_args=[], hang_timeout=3)
    try:

        def started() -> list[dict[str, object]]:
            events = run_dir / "events.jsonl"
            lines = events.read_text().splitlines() if events.exists() else []
            return [json.loads(x) for x in lines if '"started"' in x or '"job_start"' in x]

        evs = wait_for(
            lambda: [e for e in started() if e["event"] == "started"] and started(),
            deadline_in(120),
            "no start",
        )
        shm = Path(str(next(e for e in evs if e["event"] == "job_start")["shm"]))
        records = sorted(p.name for p in (shm / "beats").iterdir())
        assert records == ["w0", "w1"], records
        time.sleep(6)  # twice the hang timeout
        text = (run_dir / "events.jsonl").read_text()
        assert '"fault"' not in text, text[-3000:]
    finally:
        job.proc.send_signal(signal.SIGTERM)
        try:
            job.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait(timeout=30)
    assert not shm.exists(), "the job's shared memory (beat records included) must be removed"


def test_a_worker_that_finished_its_loop_is_known_to_its_agent_after_it_has_gone(tmp_path: Path) -> None:
    # what the agent puts in its vote if the coordinator is lost before it ended the job: a rank
    # whose worker left after finishing is done, not lost (coordinator/rules/rebuild.py)
    beats = BeatReader(make_beat_dir(tmp_path / "shm" / "beats"))
    w = BeatWriter(beats.path(3))
    w.write(Heartbeat(step=39), time.monotonic(), rank=2)
    assert beats.finished_rank(3) is None, "still in its loop"
    w.write(Heartbeat(step=39), time.monotonic(), rank=2, done=True)
    w.close()
    assert beats.finished_rank(3) == 2
    assert [b.step for b in beats.read([3], time.monotonic())] == [39], "ordinary beats still read"
    assert beats.finished_rank(4) is None, "no record"
