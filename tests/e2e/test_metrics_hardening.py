"""/metrics under attack, and the metrics' memory over a long job (issue 36).

- A job under ``checkpointless run --metrics-port`` (and a coordinator with 2 agents, each agent a
  network namespace) is flooded for 12 s by 300 clients, slow ones that send half a request and
  hang, fast ones that scrape as fast as they can. The job must keep committing steps with no
  fault and no lease lost, and the launcher's threads and memory must stay bounded.
- The goodput gauge, now kept incrementally, agrees with the ledger that ``report`` builds from
  the same run's files (a real faulted run).
- Fed 100k commits, the metrics hold what they held after 1k.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from checkpointless.observe.goodput import RECENT_COMMITS, GoodputMeter
from checkpointless.observe.httpd import MetricsServer
from checkpointless.observe.ledger import build_ledger
from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.runfiles import load_run, read_jsonl
from checkpointless.recovery.commit_log import CommitLog
from tests.helpers.jobs import ROOT, TINY, alive, start_job
from tests.helpers.wait import deadline_in, wait_for

PACED = ROOT / "tests" / "scripts" / "paced_steps.py"
FLOOD = ROOT / "tests" / "helpers" / "metrics_flood.py"
# long enough for two of check_progress's 5 s windows and for every slow client to be dropped
# at the server's 2 s deadline several times over (was 20 s: the checks need no more)
FLOOD_S = 12.0
# a slow client held longer than this was not dropped at its 2 s deadline (the bound the 20 s
# flood checked as FLOOD_S / 2, kept as it was)
HELD_MAX_S = 10.0


def _proc_status(pid: int) -> tuple[int, int]:
    """(threads, RSS in kB) of ``pid``, from /proc."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0])


def _commits(run_dir: Path) -> int:
    """Rank 0's commits so far: its log rotates, and each new file opens with the count before it."""
    try:
        data = (run_dir / "rank-0.jsonl").read_bytes()
    except FileNotFoundError:
        return 0
    first = data.split(b"\n", 1)[0]
    before = json.loads(first)["commits"] if b'"event":"commit_log"' in first else 0
    return int(before) + data.count(b'"event":"commit"')


def _port(run_dir: Path) -> int | None:
    ev = read_jsonl(run_dir / "events.jsonl")
    return next((int(e["port"]) for e in ev if e.get("event") == "metrics_listening"), None)


class _Watch:
    """Samples the launcher's threads, RSS and rank 0's commits every 0.5 s while a flood runs."""

    def __init__(self, pid: int, run_dir: Path) -> None:
        self.pid, self.run_dir = pid, run_dir
        self.samples: list[tuple[float, int, int, int]] = []  # (monotonic, threads, rss kB, commits)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                threads, rss = _proc_status(self.pid)
            except OSError:
                return
            self.samples.append((time.monotonic(), threads, rss, _commits(self.run_dir)))

    def __enter__(self) -> _Watch:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=5)

    def check_progress(self, window_s: float = 5.0) -> None:
        """Rank 0 committed steps in every ``window_s`` of the flood."""
        t0 = self.samples[0][0]
        t_end = self.samples[-1][0]
        t = t0
        while t + window_s <= t_end:
            inside = [s[3] for s in self.samples if t <= s[0] <= t + window_s]
            assert inside[-1] > inside[0], f"no step committed in [{t - t0:.1f}, {t - t0 + window_s:.1f}] s"
            t += window_s


def _flood(host: str, port: int, popen: Any = subprocess.Popen) -> subprocess.Popen[bytes]:
    # 150 slow + 150 fast: 300 clients at once
    argv = [sys.executable, str(FLOOD), host, str(port), str(FLOOD_S), "150", "150"]
    proc: subprocess.Popen[bytes] = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc


def _flood_result(proc: subprocess.Popen[bytes]) -> dict[str, float]:
    out, _ = proc.communicate(timeout=FLOOD_S + 30)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    res: dict[str, float] = json.loads(out.decode().strip().splitlines()[-1])
    return res


def _check_flood(res: dict[str, float], watch: _Watch, threads0: int, rss0: int) -> None:
    assert res["fast_ok"] >= 50, res  # the endpoint kept answering
    # slow clients were dropped again and again, not held: the 2 s deadline itself is timed in
    # test_bounded_server_deadlines_caps_and_sizes (what a flooding client sees adds its time in
    # the kernel's full accept queue, which the server never sees)
    assert res["slow_dropped"] >= 150 and res["slow_held_max_s"] < HELD_MAX_S, res
    watch.check_progress()
    threads = max(s[1] for s in watch.samples)
    rss = max(s[2] for s in watch.samples)
    assert threads <= threads0 + 2, f"threads grew from {threads0} to {threads} under the flood"
    assert rss - rss0 < 30_000, f"RSS grew from {rss0} kB to {rss} kB under the flood"
    print(f"threads {threads0} -> max {threads}; RSS {rss0} -> max {rss} kB; {res}")


@pytest.mark.timeout(180)
def test_run_keeps_committing_while_metrics_are_flooded(tmp_path: Path, corpus: Path) -> None:
    run_dir = tmp_path / "run"
    job = start_job(
        run_dir, corpus, nproc=2, spares=0, script=PACED, script_args=[], extra=["--metrics-port", "0"]
    )
    pid = job.proc.pid
    try:
        port = wait_for(
            lambda: _port(run_dir), deadline_in(60), "metrics_listening", interval=0.2, proc=job.proc
        )
        wait_for(lambda: _commits(run_dir) > 20, deadline_in(90), "steps", interval=0.2, proc=job.proc)
        threads0, rss0 = _proc_status(pid)
        with _Watch(pid, run_dir) as watch:
            res = _flood_result(_flood("127.0.0.1", port))
        assert job.proc.poll() is None, "the job died under the flood:\n" + job.output()[-4000:]
        _check_flood(res, watch, threads0, rss0)
        # and it still answers afterwards
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"checkpointless_steps_committed_total" in r.read()
    finally:
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGINT)
        try:
            job.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            job.proc.wait(timeout=30)
    ev = read_jsonl(run_dir / "events.jsonl")
    bad = [e for e in ev if e["event"] in ("fault", "coordinator_step_down", "host_lost", "recovery")]
    assert not bad, bad
    pids = [int(x) for x in (run_dir / "pids").read_text().split()] if (run_dir / "pids").exists() else []
    wait_for(
        lambda: not any(alive(p) for p in pids), deadline_in(30), "the job's processes to exit", interval=0.2
    )
    print(f"flood on run: {res}; threads {threads0}; commits {watch.samples[0][3]}->{watch.samples[-1][3]}")


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_coordinator_with_agents_keeps_committing_while_metrics_are_flooded(
    netns_hosts: Any, tmp_path: Path, corpus: Path
) -> None:
    from tests.helpers.harness.netns_job import start_netns_job

    cluster = netns_hosts(2)
    run_dir = tmp_path / "job" / "run"
    job = start_netns_job(
        cluster,
        run_dir,
        corpus,
        [],
        script=PACED,
        launcher_flags=["--metrics-port", "9464"],
        nnodes=2,
        nproc_per_node=1,
        spare_nodes=0,
    )
    pid = job.coordinator.pid
    try:
        wait_for(
            lambda: _port(run_dir), deadline_in(60), "metrics_listening", interval=0.2, proc=job.coordinator
        )
        wait_for(
            lambda: _commits(run_dir) > 20, deadline_in(120), "steps", interval=0.2, proc=job.coordinator
        )
        threads0, rss0 = _proc_status(pid)
        with _Watch(pid, run_dir) as watch:
            res = _flood_result(_flood(cluster.hosts[0].address, 9464, popen=cluster.hosts[0].popen))
        assert job.coordinator.poll() is None, "the coordinator died under the flood"
        _check_flood(res, watch, threads0, rss0)
    finally:
        if job.coordinator.poll() is None:
            job.coordinator.send_signal(signal.SIGINT)
        job.finish(time.monotonic() + 60)
        for p in job.procs:
            if p.poll() is None:
                p.kill()
    ev = read_jsonl(run_dir / "events.jsonl")
    bad = [e for e in ev if e["event"] in ("fault", "coordinator_step_down", "host_lost", "recovery")]
    assert not bad, bad
    print(f"flood on coordinator: {res}; threads {threads0}")


@pytest.mark.timeout(60)
def test_bounded_server_deadlines_caps_and_sizes() -> None:
    """The server alone, with real sockets: a slow client is closed at its 2 s deadline, one past
    the connection cap at once, an oversized request with 431; one thread serves them all."""
    server = MetricsServer(lambda: b"up 1\n", "text/plain", max_conns=8, timeout_s=2.0, max_request=8192)
    port = server.start("127.0.0.1", 0)
    threads = threading.active_count()
    try:
        slow = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
        t0 = time.monotonic()
        for s in slow:
            s.sendall(b"GET /metr")  # half a request line
        wait_for(
            lambda: server.open_connections == 8,
            deadline_in(5),
            "the slow clients to be accepted",
            interval=0.2,
        )
        assert threading.active_count() == threads, "a thread per connection"
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        t1 = time.monotonic()
        assert extra.recv(100) == b"" and time.monotonic() - t1 < 1.0, "over the cap: closed at once"
        for s in slow:
            assert s.recv(100) == b""  # closed by the server...
        assert 1.5 < time.monotonic() - t0 < 3.5  # ...at its 2 s deadline
        assert server.expired == 8 and server.refused == 1
        with socket.create_connection(("127.0.0.1", port), timeout=10) as big:
            big.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10_000)
            assert big.recv(100).startswith(b"HTTP/1.1 431")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as ok:
            ok.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := ok.recv(4096):
                data += chunk
            assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"up 1\n")
        for s in [*slow, extra]:
            s.close()
    finally:
        server.close()


def _feed(meter: GoodputMeter, events: list[dict[str, Any]], commits: list[dict[str, Any]]) -> None:
    """Records in time order, as the metrics' follower applies them."""
    recs = sorted([(float(e["time"]), 0, e) for e in events] + [(float(c["time"]), 1, c) for c in commits])
    for t, src, rec in recs:
        meter.commit(t) if src else meter.event(rec)


@pytest.mark.timeout(240)
def test_goodput_gauge_agrees_with_the_ledger_of_a_real_faulted_run(tmp_path: Path, corpus: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*TINY[:1], "60", *TINY[2:]]
    job = start_job(
        run_dir, corpus, nproc=2, spares=1, faults=["kill:rank=1:step=20"], script_args=args,
        extra=["--metrics-port", "0"],
    )  # fmt: skip
    res = job.finish(200)
    assert res.rc == 0, res.output[-4000:]
    run = load_run(run_dir)
    assert any(e["event"] == "recovery" for e in run.events), "the fault was not recovered"
    rank0 = [c for c in run.commits if c.get("rank") == 0]

    meter = GoodputMeter()
    _feed(meter, run.events, rank0)
    # fed the same records, the meter is the ledger, to rounding
    assert meter.goodput(0.0) == pytest.approx(build_ledger(run.events, rank0).goodput, abs=1e-9)
    # report's ledger reads every rank's commits: the last commit before the fault, and before
    # the end, can be another rank's, a fraction of a step later (observe/goodput.py)
    full = build_ledger(run.events, run.commits)
    step = full.step_time_s or 0.1
    assert abs(meter.goodput(0.0) - full.goodput) <= 2 * step / full.wall_s + 1e-9, (meter.goodput(0.0), full)
    assert 0 < full.goodput < 1

    # and mid-run: cut the records at a time inside the recovery and after it
    rec = next(e for e in run.events if e["event"] == "recovery")
    for cut in (float(rec["time"]) - float(rec["downtime_s"]) / 2, float(rec["time"]) + 0.5):
        ev = [e for e in run.events if float(e["time"]) <= cut]
        cm = [c for c in rank0 if float(c["time"]) <= cut]
        m = GoodputMeter()
        _feed(m, ev, cm)
        assert m.goodput(cut) == pytest.approx(build_ledger(ev, cm, now=cut).goodput, abs=1e-9), cut

    # the live path: JobMetrics follows the same files (its own thread's pump, run here by hand)
    jm = JobMetrics(run_dir)
    for e in run.events:
        jm.on_event(e)
    jm.pump(run_dir / "rank-0.jsonl")
    assert jm.meter.goodput(0.0) == pytest.approx(meter.goodput(0.0), abs=1e-9)
    assert jm.steps._value.get() == len(rank0)


@pytest.mark.timeout(60)
def test_the_follower_reads_across_rotations_of_rank_0s_log(tmp_path: Path) -> None:
    """rank-0.jsonl is rotated by its writer (recovery/commit_log.py); no commit may be lost,
    even when it rotated twice between two passes (the step counter then takes the summary's)."""
    log = CommitLog(tmp_path / "rank-0.jsonl", rotate_bytes=2048, rank=0)
    jm = JobMetrics(tmp_path)
    n = 0
    for burst in (5, 30, 1, 60, 7, 200, 3):  # 200 lines: about ten rotations in one pass
        for _ in range(burst):
            log.emit("commit", step=n, generation=0)
            n += 1
        jm.pump(tmp_path / "rank-0.jsonl")
    log.close()
    for _ in range(3):
        jm.pump(tmp_path / "rank-0.jsonl")
    assert jm.steps._value.get() == n
    assert jm.meter.commits <= n  # those of a file rotated away unseen are only counted
    jm.close()


def _synthetic(meter: GoodputMeter, jm: JobMetrics, n: int, t: float, step: int) -> tuple[float, int]:
    """``n`` commits of rank 0, 10 ms apart, with a fault and a recovery every 10k steps."""
    for _ in range(n):
        t += 0.01
        step += 1
        rec = {"event": "commit", "rank": 0, "step": step, "generation": step // 10_000, "time": t}
        jm._apply_commit(rec)
        if step % 10_000 == 0:
            gen = step // 10_000
            fault = {"time": t + 0.005, "rank": 1, "kind": "killed"}
            for e in (
                {"event": "fault", "generation": gen - 1, **fault},
                {"event": "plan", "generation": gen, "receivers": [1], "time": t + 0.01},
                {"event": "spare_assigned", "rank": 1, "worker": 2, "generation": gen, "time": t + 0.02},
                {
                    "event": "recovery", "generation": gen, "time": t + 0.3, "downtime_s": 0.295,
                    "detect_s": 0.001, "collect_s": 0.05, "rebuild_s": 0.1, "transfer_s": 0.05,
                    "first_step_s": 0.05, "faults": [fault], "state_bytes": 1000,
                },
            ):  # fmt: skip
                jm._apply_event(e)
            t += 0.3
    return t, step


@pytest.mark.timeout(120)
def test_metrics_memory_is_flat_from_1k_to_100k_commits(tmp_path: Path) -> None:
    jm = JobMetrics(tmp_path)
    meter = jm.meter
    jm._apply_event({"event": "job_start", "time": 1000.0, "nproc": 2})
    jm._apply_event({"event": "started", "generation": 0, "time": 1001.0})
    tracemalloc.start()
    try:
        t, step = _synthetic(meter, jm, 1_000, 1001.0, -1)
        held_1k = meter.held()
        mem_1k, _ = tracemalloc.get_traced_memory()
        t, step = _synthetic(meter, jm, 99_000, t, step)
        mem_100k, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meter.commits == 100_000 and meter.recoveries == 10
    assert mem_100k - mem_1k < 2 << 20, f"{(mem_100k - mem_1k) / 1e6:.1f} MB more after 100k commits"
    # nothing per step is kept: the rings are full at their bound, nothing else grows
    assert held_1k <= meter.held() <= RECENT_COMMITS + 2 * 10
    assert len(jm._receivers) <= 16 and not jm._inbox
    assert not [k for k, v in vars(jm).items() if isinstance(v, list)], "a list in JobMetrics"
    assert 0.9 < meter.goodput(t) < 1.0
