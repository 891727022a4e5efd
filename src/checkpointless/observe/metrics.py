"""Prometheus metrics of a running job, served by the launcher on ``--metrics-port``.

The launcher's own logic is not touched: :class:`JobMetrics` listens to its event log (faults,
recoveries, spares, generations) and follows ``rank-0.jsonl`` for step commits (rank 0 commits
every step the job commits, whichever process holds it). A private registry keeps the output to
this job's metrics.

Nothing here may slow the control loop, however long the job and however hard it is scraped
(issue 36):

- the event listener runs on the thread that emitted the event, so it only queues the record; a
  follower thread applies the queue and rank 0's new commits every :data:`_TICK` seconds;
- every metric is kept incrementally, O(1) per record and per scrape, and nothing grows with the
  number of steps: goodput is a :class:`~checkpointless.observe.goodput.GoodputMeter`, not the
  ledger rebuilt from every commit at each scrape;
- the endpoint is a :class:`~checkpointless.observe.httpd.MetricsServer`: one thread, a few
  connections, a 2 s deadline each, not a thread per connection.
"""

from __future__ import annotations

import heapq
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from checkpointless.errors import ConfigError
from checkpointless.observe.goodput import GoodputMeter
from checkpointless.observe.httpd import MetricsServer
from checkpointless.observe.runfiles import open_regular

__all__ = ["PHASES", "JobMetrics"]

# the recovery event's phase fields, as the ``phase`` label values
PHASES = ("detect", "collect", "rebuild", "transfer", "first_batch", "first_step")
_RECOVERY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TICK = 0.25  # seconds between the follower's passes
_READ_CHUNK = 1 << 22  # rank-0.jsonl read at most 4 MiB a pass: a backlog is caught up in slices
_MAX_LINE = 1 << 16  # a commit record is ~200 bytes; a longer line is not one, and is skipped
_INBOX = 100_000  # events waiting for the follower (a launcher writes a few per recovery)
_GENERATIONS = 16  # receivers kept per plan, for the recovery of the same generation


def _time_of(item: tuple[int, dict[str, Any]]) -> float:
    try:
        return float(item[1].get("time", 0.0))
    except (TypeError, ValueError):
        return 0.0


class JobMetrics:
    """Metric families for one job, fed by launcher events and rank 0's commits."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.steps = Counter("checkpointless_steps_committed", "Steps the job committed (rank 0)", registry=r)
        self.step_time = Histogram(
            "checkpointless_step_duration_seconds",
            "Wall time of one committed step on rank 0, recoveries excluded",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.faults = Counter("checkpointless_faults", "Detected faults by kind", ["kind"], registry=r)
        self.recoveries = Counter("checkpointless_recoveries", "Finished recoveries", registry=r)
        self.downtime = Histogram(
            "checkpointless_recovery_downtime_seconds",
            "From detection until every rank committed a step again",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "checkpointless_recovery_phase_seconds",
            "One phase of a recovery (detect, collect, rebuild, transfer, first_batch, first_step)",
            ["phase"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.spares_ready = Gauge(
            "checkpointless_spares_ready", "Hot spares ready to take a rank", registry=r
        )
        self.generation = Gauge("checkpointless_generation", "Current communicator generation", registry=r)
        # degraded mode: live data-parallel replicas (processes holding slots), set from `width`
        # events; --nproc from job_start on
        self.width = Gauge(
            "checkpointless_replicas",
            "Live data-parallel replicas (fewer than --nproc while degraded)",
            registry=r,
        )
        self.state_bytes = Counter(
            "checkpointless_state_transferred_bytes",
            "Training state sent to receivers in recoveries",
            registry=r,
        )
        # host health (coordinator/health.py): how many hosts are quarantined, and each one's
        # latest verdict and quarantine as labelled gauges (bounded by the job's hosts)
        self.hosts_quarantined = Gauge(
            "checkpointless_hosts_quarantined",
            "Hosts in quarantine: never promoted, given no spare",
            registry=r,
        )
        self.host_health = Gauge(
            "checkpointless_host_health_ok",
            "1 while a host's newest health checks passed, 0 while they failed",
            ["host", "address"],
            registry=r,
        )
        self.host_quarantine = Gauge(
            "checkpointless_host_quarantined",
            "1 for each host in quarantine, with why (health: its checks failed; faults: its ranks kept faulting)",
            ["host", "address", "reason"],
            registry=r,
        )
        self._quarantined: dict[str, tuple[str, str]] = {}  # host -> (address, reason)
        self._checked: dict[str, str] = {}  # host -> address, of hosts that reported health
        self.meter = GoodputMeter()
        goodput = Gauge(
            "checkpointless_goodput_ratio", "Productive share of the wall time so far (0-1)", registry=r
        )
        goodput.set_function(lambda: self.meter.goodput(time.time()))
        self.generation.set(-1)
        self._inbox: deque[dict[str, Any]] = deque(maxlen=_INBOX)
        self._ready: set[int] = set()  # bounded by the job's workers
        self._receivers: dict[int, int] = {}  # generation -> receivers in its plan (the last few)
        self._stop = threading.Event()
        self._file: BinaryIO | None = None  # rank-0.jsonl, open across passes (it rotates)
        self._ino = 0
        self._read_commits = 0  # commit lines read, to compare with a rotated log's summary
        self._partial = b""
        self._skipping = False  # inside an over-long line, dropped up to its newline
        self._last_commit: dict[str, Any] | None = None
        self._tail = threading.Thread(target=self._follow, name="cl-metrics-tail", daemon=True)
        self._server: MetricsServer | None = None

    # -- inputs ------------------------------------------------------------------------------
    def on_event(self, e: dict[str, Any]) -> None:
        """Listener for the launcher's EventLog. It runs on the emitting thread (the control loop),
        so it only queues the record (``deque.append`` is atomic); the follower applies it."""
        self._inbox.append(e)

    def _apply_event(self, e: dict[str, Any]) -> None:
        self.meter.event(e)
        kind = e.get("event")
        if kind == "fault":
            self.faults.labels(kind=str(e.get("kind"))).inc()
        elif kind == "spare_ready":
            self._ready.add(int(e["worker"]))
        elif kind in ("spare_assigned", "spare_lost"):
            self._ready.discard(int(e["worker"]))
        elif kind == "plan":
            self._receivers[int(e["generation"])] = len(e.get("receivers") or [])
            while len(self._receivers) > _GENERATIONS:
                del self._receivers[min(self._receivers)]
        elif kind == "started":
            self.generation.set(int(e["generation"]))
        elif kind == "width" or (kind == "job_start" and "nproc" in e):
            self.width.set(int(e["width"] if kind == "width" else e["nproc"]))
        elif kind in ("host_health", "host_quarantined", "host_readmitted", "host_lost"):
            self._apply_host(kind, e)
        elif kind == "recovery":
            gen = int(e["generation"])
            self.generation.set(gen)
            self.recoveries.inc()
            self.downtime.observe(float(e["downtime_s"]))
            for p in PHASES:
                if f"{p}_s" in e:
                    self.phase.labels(phase=p).observe(float(e[f"{p}_s"]))
            self.state_bytes.inc(float(e.get("state_bytes") or 0.0) * self._receivers.get(gen, 1))
        self.spares_ready.set(len(self._ready))

    def _apply_host(self, kind: str, e: dict[str, Any]) -> None:
        host, address = str(e.get("host")), str(e.get("address", "?"))
        if kind == "host_health":
            self._checked[host] = address
            self.host_health.labels(host=host, address=address).set(1 if e.get("ok") else 0)
            return
        was = self._quarantined.pop(host, None)
        if was is not None:
            self.host_quarantine.remove(host, *was)
        if kind == "host_quarantined":
            self._quarantined[host] = (address, str(e.get("reason", "?")))
            self.host_quarantine.labels(host, *self._quarantined[host]).set(1)
        elif kind == "host_lost" and host in self._checked:
            self.host_health.remove(host, self._checked.pop(host))
        self.hosts_quarantined.set(len(self._quarantined))

    def _apply_commit(self, c: dict[str, Any]) -> None:
        self.steps.inc()
        self.meter.commit(float(c["time"]))
        prev = self._last_commit
        if (
            prev is not None
            and prev.get("generation") == c.get("generation")
            and c.get("step") == prev.get("step", -2) + 1
            and not c.get("rolled_forward")
        ):
            self.step_time.observe(float(c["time"]) - float(prev["time"]))
        self._last_commit = c

    def _follow(self) -> None:
        path = self.run_dir / "rank-0.jsonl"
        while not self._stop.wait(_TICK):
            self.pump(path)

    def pump(self, path: Path, parse: Callable[[bytes], Any] = json.loads) -> None:
        """One pass of the follower: the events queued so far and the commits appended since the
        last pass, applied in time order (as the ledger sorts them), each in O(1)."""
        events = [self._inbox.popleft() for _ in range(len(self._inbox))]
        commits = self.poll_commits(path, parse)
        merged = heapq.merge(((0, e) for e in events), ((1, c) for c in commits), key=_time_of)
        for src, rec in merged:
            try:
                (self._apply_commit if src else self._apply_event)(rec)
            except (KeyError, TypeError, ValueError):
                continue  # a malformed record is not worth stopping the metrics for

    def _read(self, path: Path) -> bytes:
        """The next bytes of rank 0's log, across its rotations (recovery/commit_log.py): the open
        file is read to its end, then a new file at ``path`` (another inode) is started at 0."""
        if self._file is None:
            try:
                fd = open_regular(path)  # no symlink, no FIFO
            except ConfigError:
                return b""
            if fd is None:
                return b""
            # held open across passes: the inode cannot be reused while it is, so "another inode
            # at the path" always means a rotation (a follower that reopens each pass can see a
            # new file take the inode of one deleted two rotations ago, and skip it)
            self._file = os.fdopen(fd, "rb")
            self._ino = os.fstat(fd).st_ino
        chunk = self._file.read(_READ_CHUNK)
        if chunk:
            return chunk
        try:
            rotated = os.lstat(path).st_ino != self._ino
        except OSError:
            rotated = False  # between the rename and the new file: next pass
        if rotated:
            self._file.close()
            self._file, self._partial, self._skipping = None, b"", False  # a torn last line: gone
            return self._read(path)
        return b""

    def poll_commits(self, path: Path, parse: Callable[[bytes], Any] = json.loads) -> list[dict[str, Any]]:
        """The commit records in the complete lines appended to ``path`` since the last call."""
        chunk = self._read(path)
        *lines, rest = chunk.split(b"\n")  # a line being written waits for its newline
        if lines:
            lines[0] = self._partial + lines[0]
            self._partial, skip_first = b"", self._skipping
            self._skipping = False
        else:
            rest, skip_first = self._partial + rest, False
        if len(rest) > _MAX_LINE:  # not a commit record: drop it, and the rest of it when it comes
            rest, self._skipping = b"", True
        self._partial = rest
        out = []
        for i, line in enumerate(lines):
            if (i == 0 and skip_first) or not line.strip() or len(line) > _MAX_LINE:
                continue
            try:
                rec = parse(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            if rec.get("event") == "commit" and "time" in rec:
                out.append(rec)
                self._read_commits += 1
            elif rec.get("event") == "commit_log":
                # a rotated log's summary of every commit before it: the step counter catches up
                # with commits in a file this follower never saw (rotated twice in one pass)
                missed = int(rec.get("commits") or 0) - self._read_commits
                if missed > 0:
                    self.steps.inc(missed)
                    self._read_commits += missed
        return out

    # -- serving -----------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port); the port actually bound."""
        if not 0 <= port <= 65535:
            raise ConfigError(f"--metrics-port must be 0-65535 (got {port})")
        server = MetricsServer(lambda: generate_latest(self.registry), CONTENT_TYPE_LATEST)
        try:
            bound = server.start(host, port)
        except OSError as e:
            server.close()
            raise ConfigError(
                f"cannot serve metrics on {host}:{port} ({e.strerror}); choose another --metrics-port"
            ) from None
        self._server = server
        self._tail.start()
        return bound

    @property
    def server(self) -> MetricsServer | None:
        return self._server

    def close(self) -> None:
        self._stop.set()
        if self._tail.is_alive():
            self._tail.join(timeout=2.0)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._file is not None and not self._tail.is_alive():
            self._file.close()
            self._file = None
